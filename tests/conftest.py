"""Shared fixtures. Every test here runs on a CPU (files are named *_on_cpu.py); none needs a GPU.

``thundersync_verl`` and the shared harness ``thundersync_harness`` (tests/harness/) are imported
from the editable install (``make install``), not through path edits.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("VERL_PLATFORM", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_random_lm(tmp_path_factory):
    """A random 2-layer Qwen2 with the project's tokenizer, saved in HF format (seconds to build)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from thundersync_verl.envs import protocol
    from thundersync_verl.models.tokenizer import render_chat, train_tokenizer

    corpus = [render_chat(t) for t in protocol.transcripts(300, 0, tool_fraction=0.5)]
    tokenizer = train_tokenizer(corpus, vocab_size=400)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny_random_lm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def latency_sleeps(monkeypatch):
    """Every ``asyncio.sleep`` length asked for (``asked``), and how many sleeps of one given length
    (``delay``, a modelled latency) were in flight at once.

    The real sleep still runs; the wrapper only counts, so calls that overlap show ``most == n`` on any
    machine, however slow, and calls awaited one after another show 1: concurrency and modelled delays
    observed by what the code does, never by how long it took.
    """
    real_sleep = asyncio.sleep

    class Sleeps:
        delay, now, most, count, asked = None, 0, 0, 0, []

        @staticmethod
        async def sleep(delay, *args, **kwargs):
            Sleeps.asked.append(delay)
            if delay != Sleeps.delay:
                return await real_sleep(delay, *args, **kwargs)
            Sleeps.now += 1
            Sleeps.count += 1
            Sleeps.most = max(Sleeps.most, Sleeps.now)
            try:
                return await real_sleep(delay, *args, **kwargs)
            finally:
                Sleeps.now -= 1

    monkeypatch.setattr(asyncio, "sleep", Sleeps.sleep)
    return Sleeps



@dataclass(frozen=True)
class Engine:
    wg: object  # verl's RayWorkerGroup of StreamingActorWorker, one rank
    pad_id: int
    vocab: int
    teacher: Path | None  # the OPD teacher model (opd=True), else None


@pytest.fixture(scope="module")
def start_engine(tmp_path_factory):
    """``start_engine(groups=..., opd=False) -> Engine``: tiny model, verl's FSDP2 config, streaming worker group.

    Module-scoped: a module that asks for it gets ONE 1-rank worker group (Ray started once, ~20-40 s on 2 cores)
    that its tests share; at the module's end Ray is shut down and the process environment and torch threads are
    restored. ``opd=True`` also builds the teacher and gives the worker verl's ``distillation_config``, so its own
    ``update_actor`` runs verl's distillation loss. Call it once per module.
    """
    import contextlib

    from thundersync_harness import engine_setup as setup

    with contextlib.ExitStack() as session:  # Ray and the environment, restored at the module's end if started
        started: list[Path] = []

        def start(*, groups: int, opd: bool = False, micro: int = 4, worker_cls=None) -> Engine:
            assert not started, "one engine per test module"
            work = tmp_path_factory.mktemp("engine")
            started.append(session.enter_context(setup.ray_session()))
            model_path, pad_id, vocab = setup.build_tiny_model(work / "model")
            teacher = setup.build_teacher(model_path, work / "teacher") if opd else None
            config = setup.verl_config(model_path, groups=groups, micro=micro, teacher=teacher)
            return Engine(setup.start_workers(config, dp=1, distillation=opd, worker_cls=worker_cls), pad_id, vocab, teacher)

        yield start


@pytest.fixture(scope="module")
def equivalence_bench():
    """``benchmarks/equivalence.py`` loaded as a module (the benchmark's argument and result tests call it, no Ray)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "equivalence.py"
    spec = importlib.util.spec_from_file_location("equivalence_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
