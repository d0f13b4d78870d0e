"""Build, cache and load the tiny student/teacher checkpoints, offline and deterministically.

Why:
1. verl loads models and tokenizers from HF-format folders. Building ours in that format
   (``config.json``, safetensors weights, ``generation_config.json``, tokenizer files with a
   chat template) lets every verl code path treat them like a downloaded checkpoint.
2. Builds are cached under ``<root>/<version-hash>/<variant>``; the hash covers the specs,
   seed and data/protocol versions, so editing any of them rebuilds instead of silently
   reusing a stale model. ``root`` is ``cache_dir``, else ``$THUNDERSYNC_MODEL_DIR``, else
   ``~/.cache/thundersync_verl/models``.
3. A build writes into a temporary sibling folder and renames it into place, so a crash or
   a concurrent build never leaves a half-written model where a reader would find it.
4. Student and teacher share one tokenizer (trained on a variant-independent stream):
   on-policy distillation compares their log-probs token by token, which needs equal vocabularies.
5. A missing model is first taken from the copy shipped in the package (``shipped.py``) when its
   hash matches the current specs; building is the fallback, and says so in its log line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
import zlib
from pathlib import Path
from typing import Callable

from thundersync_verl.envs import protocol
from thundersync_verl.models.tokenizer import EOS_TOKEN, PAD_TOKEN, render_chat, train_tokenizer
from thundersync_verl.models.variants import TinyModelSpec, get_spec, version_hash

MARKER_FILE = "thundersync_model.json"
ENV_MODEL_DIR = "THUNDERSYNC_MODEL_DIR"
BUILD_THREADS = 2
BUILD_COMMAND = "thundersync build-model"
BUILD_MINUTES = {"student": "about 4 on 2 cores", "teacher": "about 19 on 2 cores"}  # measured on a busy 2-core box


def default_root() -> Path:
    """``$THUNDERSYNC_MODEL_DIR`` or ``~/.cache/thundersync_verl/models``."""
    env = os.environ.get(ENV_MODEL_DIR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "thundersync_verl" / "models"


def _logger(progress: bool) -> Callable[[str], None]:
    def log(message: str) -> None:
        if progress:
            print(f"[thundersync models] {message}", file=sys.stderr, flush=True)

    return log


def build_tokenizer(spec: TinyModelSpec, seed: int):
    """The shared tokenizer: trained on a stream that depends on the seed, not on the variant."""
    corpus = [
        render_chat(messages)
        for messages in protocol.transcripts(spec.tokenizer_corpus, seed, tool_fraction=0.5, stream="tokenizer")
    ]
    return train_tokenizer(corpus, vocab_size=spec.vocab_size)


def _model_config(spec: TinyModelSpec, tokenizer):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        attn_implementation="sdpa",
        dtype="float32",
        use_cache=True,
    )


def _generation_config(tokenizer):
    from transformers import GenerationConfig

    # Plain sampling at temperature 1, as RL rollouts use; generation stops at <|im_end|>.
    return GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    )


def _train_into(folder: Path, spec: TinyModelSpec, seed: int, log: Callable[[str], None]) -> dict:
    """Everything a build does, written into ``folder``; returns the marker record."""
    import torch
    from transformers import Qwen2ForCausalLM

    from thundersync_verl.models.warm_start import warm_start

    started = time.perf_counter()
    tokenizer = build_tokenizer(spec, seed)
    log(f"{spec.name}: tokenizer trained, vocab {len(tokenizer)} ({time.perf_counter() - started:.1f} s)")
    torch.manual_seed(zlib.crc32(f"init:{spec.name}:{seed}".encode()))
    model = Qwen2ForCausalLM(_model_config(spec, tokenizer))
    n_params = sum(p.numel() for p in model.parameters())
    shape = f"Qwen2 {spec.num_layers}x{spec.hidden_size}, {n_params / 1e6:.2f} M params"
    log(f"{spec.name}: {shape}; warm start {spec.train_steps} steps")
    stats = warm_start(model, tokenizer, spec, seed, log)
    model.generation_config = _generation_config(tokenizer)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    record = {"variant": spec.name, "seed": seed, "params": n_params, "version": version_hash({spec.name: spec}, seed)}
    record["spec"] = dataclasses.asdict(spec)
    # Timings vary run to run: they go to the log, not into the deterministic files.
    log(f"{spec.name}: warm-start loss {stats['first_loss']:.3f} -> {stats['final_loss']:.3f} in {stats['seconds']:.0f} s")
    (folder / MARKER_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def build_model(
    out_dir: str | Path,
    variant: str,
    seed: int = 0,
    *,
    train_steps: int | None = None,
    n_transcripts: int | None = None,
    progress: bool = True,
) -> Path:
    """Build one tiny model into ``out_dir`` (replaced if present) and return its path.

    ``train_steps``/``n_transcripts`` shrink the budget (tests); the default is the full recipe.
    """
    import torch

    out_dir = Path(out_dir)
    spec = get_spec(variant).scaled(train_steps=train_steps, n_transcripts=n_transcripts)
    log = _logger(progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(out_dir)
    staging = out_dir.parent / f".{out_dir.name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)  # fixed thread count: part of bitwise determinism
    try:
        _train_into(staging, spec, seed, log)
        _publish(staging, out_dir)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(staging, ignore_errors=True)
    log(f"{variant}: ready at {out_dir}")
    return out_dir


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_staging(out_dir: Path) -> None:
    """Delete staging folders left by builds whose process died (a SIGKILL skips cleanup)."""
    for stale in out_dir.parent.glob(f".{out_dir.name}.*-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if stale.is_dir() and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _publish(staging: Path, out_dir: Path) -> None:
    """Move a finished build into place; an existing folder is moved aside first, then removed."""
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    if out_dir.exists():
        out_dir.rename(old)
    try:
        staging.rename(out_dir)
    finally:
        shutil.rmtree(old, ignore_errors=True)


def is_built(path: str | Path) -> bool:
    path = Path(path)
    return (path / MARKER_FILE).is_file() and (path / "config.json").is_file()


def ensure_tiny_models(
    cache_dir: str | Path | None = None, *, force: bool = False, progress: bool = True, seed: int = 0,
    variants: tuple[str, ...] = ("student", "teacher"),
) -> dict[str, Path]:
    """Paths of the student and teacher; whichever of ``variants`` is missing comes from the shipped
    copy when it matches the current specs (``shipped.py``), else is built. ``force`` rebuilds them all."""
    from thundersync_verl.models.shipped import install_shipped

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_root()
    folder = root / version_hash(seed=seed)
    paths = {variant: folder / variant for variant in ("student", "teacher")}
    log = _logger(progress)
    for variant in variants:
        path = paths[variant]
        if force or not (is_built(path) or install_shipped(variant, path, seed, log=log)):
            log(f"building {variant} into {path} (minutes on a CPU: {BUILD_MINUTES[variant]})")
            build_model(path, variant, seed, progress=progress)
    return paths


def load_tiny_model(path: str | Path):
    """``(model, tokenizer)`` from a built folder, in eval mode, fp32."""
    path = Path(path)
    if not is_built(path):
        raise FileNotFoundError(
            f"no tiny model at {path}: the folder is missing or was not completely built. Models "
            f"are built locally, never downloaded; run `{BUILD_COMMAND}` (or "
            "`python -m thundersync_verl.models build`), or call "
            "thundersync_verl.models.ensure_tiny_models() and use the path it returns."
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32", attn_implementation="sdpa")
    model.eval()
    return model, tokenizer
