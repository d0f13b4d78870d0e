"""What each tiny model is: architecture, warm-start data and training budget, in one record.

Why:
1. The student must leave room for RL. Its warm start first learns to use the tool on
   tool-only transcripts, then trains on a 50/50 mix of correct tool-using transcripts and
   transcripts that skip the tool and guess (wrongly). Sampled at temperature 1 it calls the
   tool about half the time and gets reward ~0.35: RL can raise it by always calling the tool
   and copying more reliably.
2. The teacher (for on-policy distillation) is bigger and trained only on correct tool-using
   transcripts, so it always calls the tool and its reward is far above the student's.
3. Both are small enough for a 2-core CPU: the student's forward+backward on a batch of
   trajectories takes tens of milliseconds, so a CPU demo runs real GRPO steps.
4. Every field takes part in :func:`version_hash`, together with the data and protocol
   versions, so any change to what a model is produces a new cache folder and a rebuild.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from thundersync_verl.envs import protocol

# Bump when the transcript generator or the training loop changes in a way fields don't show.
DATA_VERSION = 1
BUILD_VERSION = 1


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture and warm-start recipe of one tiny Qwen2 model."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tool_fraction: float  # phase-2 share of warm-start transcripts that use the tool correctly
    train_steps: int  # both phases together
    tool_only_steps: int  # phase 1: tool-using transcripts only (teaches copying)
    batch_size: int = 16
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    n_transcripts: int = 12_000
    retry_prob: float = 0.2
    vocab_size: int = 512
    tokenizer_corpus: int = 4000  # transcripts the tokenizer is trained on
    max_position_embeddings: int = 1024
    rope_theta: float = 10_000.0

    def scaled(self, train_steps: int | None = None, n_transcripts: int | None = None) -> "TinyModelSpec":
        """A copy with a smaller budget (tests use it to build in seconds)."""
        changes = {}
        if train_steps is not None:
            changes["train_steps"] = train_steps
            changes["tool_only_steps"] = self.tool_only_steps * train_steps // self.train_steps
            changes["warmup_steps"] = min(self.warmup_steps, max(1, train_steps // 10))
        if n_transcripts is not None:
            changes["n_transcripts"] = n_transcripts
            changes["tokenizer_corpus"] = min(self.tokenizer_corpus, n_transcripts)
        return dataclasses.replace(self, **changes)


VARIANTS: dict[str, TinyModelSpec] = {
    "student": TinyModelSpec(
        name="student",
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=384,
        tool_fraction=0.5,
        train_steps=1300,
        tool_only_steps=800,
    ),
    "teacher": TinyModelSpec(
        name="teacher",
        hidden_size=192,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=576,
        tool_fraction=1.0,
        train_steps=2000,
        tool_only_steps=2000,
        learning_rate=2e-3,
    ),
}


def get_spec(variant: str) -> TinyModelSpec:
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny model variant {variant!r}; known variants are {sorted(VARIANTS)}")
    return VARIANTS[variant]


def version_hash(specs: dict[str, TinyModelSpec] | None = None, seed: int = 0) -> str:
    """12 hex digits identifying the specs, seed, data, protocol and build versions."""
    specs = VARIANTS if specs is None else specs
    payload = {
        "specs": {k: dataclasses.asdict(v) for k, v in sorted(specs.items())},
        "seed": seed,
        "data_version": DATA_VERSION,
        "build_version": BUILD_VERSION,
        "protocol_version": protocol.PROTOCOL_VERSION,
        "system_prompt": protocol.SYSTEM_PROMPT,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()[:12]
