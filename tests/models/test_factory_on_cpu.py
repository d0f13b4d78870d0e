"""The tiny model factory: deterministic builds, atomic caching, loadable HF folders. CPU only.

Builds here use a reduced budget (a few optimizer steps on a few dozen transcripts) so the
whole file runs in well under a minute on two cores.
"""

from __future__ import annotations

import json

import pytest
import torch

from thundersync_verl.models import factory
from thundersync_verl.models.variants import VARIANTS, get_spec, version_hash

QUICK = {"train_steps": 3, "n_transcripts": 64}


@pytest.fixture(scope="module")
def quick_student(tmp_path_factory):
    return factory.build_model(tmp_path_factory.mktemp("a") / "student", "student", 0, progress=False, **QUICK)


@pytest.mark.slow  # builds and trains a model
def test_two_builds_with_the_same_seed_are_bitwise_identical(quick_student, tmp_path):
    again = factory.build_model(tmp_path / "student", "student", 0, progress=False, **QUICK)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json", "generation_config.json"):
        assert (quick_student / name).read_bytes() == (again / name).read_bytes(), name
    other = factory.build_model(tmp_path / "other", "student", 1, progress=False, **QUICK)
    assert (other / "model.safetensors").read_bytes() != (quick_student / "model.safetensors").read_bytes()


@pytest.mark.slow  # builds and trains a model
def test_student_and_teacher_share_the_tokenizer(quick_student, tmp_path):
    teacher = factory.build_model(tmp_path / "teacher", "teacher", 0, progress=False, **QUICK)
    assert (teacher / "tokenizer.json").read_bytes() == (quick_student / "tokenizer.json").read_bytes()
    assert (teacher / "model.safetensors").read_bytes() != (quick_student / "model.safetensors").read_bytes()


@pytest.mark.slow  # builds and trains a model
def test_built_folder_is_a_loadable_qwen2_checkpoint(quick_student):
    model, tokenizer = factory.load_tiny_model(quick_student)
    config = model.config
    assert config.model_type == "qwen2" and config.tie_word_embeddings
    assert config.max_position_embeddings >= 1024 and config._attn_implementation == "sdpa"
    assert model.dtype == torch.float32 and config.vocab_size == len(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config.eos_token_id == im_end and model.generation_config.eos_token_id == im_end
    assert tokenizer.eos_token_id == im_end
    marker = json.loads((quick_student / factory.MARKER_FILE).read_text())
    assert marker["variant"] == "student" and marker["seed"] == 0
    ids = torch.tensor([tokenizer.encode("<|im_start|>user\nhi", add_special_tokens=False)])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], config.vocab_size)


def test_full_size_models_fit_the_cpu_budget():
    from transformers import Qwen2ForCausalLM

    tokenizer = factory.build_tokenizer(get_spec("student").scaled(n_transcripts=200), 0)
    sizes = {}
    for variant in ("student", "teacher"):
        with torch.device("meta"):
            model = Qwen2ForCausalLM(factory._model_config(get_spec(variant), tokenizer))
        sizes[variant] = sum(p.numel() for p in model.parameters())
    assert 0.3e6 <= sizes["student"] <= 1.5e6
    assert sizes["teacher"] > 2 * sizes["student"]


def test_build_is_atomic_when_it_fails(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated crash during training")

    monkeypatch.setattr("thundersync_verl.models.warm_start.warm_start", broken)
    with pytest.raises(RuntimeError, match="simulated crash"):
        factory.build_model(tmp_path / "student", "student", 0, progress=False, **QUICK)
    assert list(tmp_path.iterdir()) == []  # neither the model nor a staging folder is left


def test_staging_left_by_a_dead_build_is_removed(tmp_path, monkeypatch):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    stale = tmp_path / f".student.building-{dead.pid}"
    live = tmp_path / f".student.building-{__import__('os').getpid()}"
    stale.mkdir()
    live.mkdir()
    factory._remove_stale_staging(tmp_path / "student")
    assert not stale.exists() and live.exists()


def test_ensure_builds_only_what_is_missing(tmp_path, monkeypatch):
    calls = []

    def fake_build(path, variant, seed, progress=True):
        calls.append(variant)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text("{}")
        (path / factory.MARKER_FILE).write_text("{}")
        return path

    monkeypatch.setattr(factory, "build_model", fake_build)
    monkeypatch.setattr("thundersync_verl.models.shipped.SHIPPED_DIR", tmp_path / "no-shipped-models")
    monkeypatch.setenv(factory.ENV_MODEL_DIR, str(tmp_path / "env-root"))
    paths = factory.ensure_tiny_models(progress=False)
    assert calls == ["student", "teacher"]
    assert paths["student"] == tmp_path / "env-root" / version_hash() / "student"
    factory.ensure_tiny_models(progress=False)
    assert calls == ["student", "teacher"]  # cached: nothing rebuilt
    factory.ensure_tiny_models(progress=False, force=True)
    assert calls == ["student", "teacher"] * 2
    explicit = factory.ensure_tiny_models(tmp_path / "explicit", progress=False)
    assert explicit["teacher"].parent.parent == tmp_path / "explicit"


def test_version_hash_tracks_the_recipe():
    import dataclasses

    base = version_hash()
    assert base == version_hash() and len(base) == 12
    assert version_hash(seed=1) != base
    changed = dict(VARIANTS, student=dataclasses.replace(VARIANTS["student"], train_steps=VARIANTS["student"].train_steps + 1))
    assert version_hash(changed) != base


def test_missing_model_error_says_how_to_build(tmp_path):
    with pytest.raises(FileNotFoundError, match="thundersync build-model"):
        factory.load_tiny_model(tmp_path / "nowhere")


@pytest.mark.slow  # builds and trains a model
def test_evaluate_policy_runs_the_agent_loop(quick_student):
    from thundersync_verl.models.evaluate import evaluate_policy

    report = evaluate_policy(quick_student, n_problems=4, seed=0, max_turns=2, max_new_tokens=8)
    assert report["n_problems"] == 4 and 0.0 <= report["reward"] <= 1.0
    assert sum(report["reasons"].values()) == 4
    assert report == {**evaluate_policy(quick_student, n_problems=4, seed=0, max_turns=2, max_new_tokens=8), "seconds": report["seconds"]}
