"""Fixtures for the tests that run verl's Megatron engine on the CPU (gloo, one Ray worker per rank; no GPU).

``start_megatron`` is module-scoped: a module that asks for it gets ONE worker group of the given
layout (TP x PP x DP ranks; startup 30-90 s on 2 cores) that its tests share; Ray is shut down and
the process environment restored at the end of the module. Keep one layout per module.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from thundersync_harness import engine_setup, megatron_dynamic, megatron_engine, megatron_per_token
from thundersync_harness import moe as moe_harness


@dataclass(frozen=True)
class MegatronGroup:
    wg: object  # verl's RayWorkerGroup of the probe streaming worker, one worker per rank
    pad_id: int
    vocab: int
    model_path: Path
    world: int


@pytest.fixture(scope="module")
def start_megatron(tmp_path_factory):
    """``start_megatron(tp=1, pp=1, dp=1, distributed_optimizer=False, groups=2, per_token_loss=False,
    remove_padding=False)``.

    ``per_token_loss``: Megatron's per-token-loss regime forced on (``thundersync_harness.megatron_per_token``).
    ``remove_padding``: verl's packed (THD) path (``use_remove_padding=True``; the CPU spec's packed attention).
    ``moe``: the tiny Qwen3-MoE (4 experts, top-2) instead of the dense model, experts over ``ep`` of the
    ``dp`` ranks (``thundersync_harness.moe``).
    ``max_token_len``: verl's token-budgeted micro-batches (``use_dynamic_bsz=True`` with that
    ``ppo_max_token_len_per_gpu``), on workers that can record the engine's cut
    (``thundersync_harness.megatron_dynamic``)."""
    with contextlib.ExitStack() as session:  # Ray and the environment, restored at the module's end if started
        started: list[Path] = []

        def start(*, tp: int = 1, pp: int = 1, dp: int = 1, distributed_optimizer: bool = False,
                  groups: int = 2, micro: int = 4, per_token_loss: bool = False,
                  remove_padding: bool = False, moe: bool = False, ep: int = 1,
                  max_token_len: int | None = None) -> MegatronGroup:
            assert not started, "one layout per test module"
            work = tmp_path_factory.mktemp("megatron")
            started.append(session.enter_context(engine_setup.ray_session()))
            path, pad_id, vocab = (moe_harness.build_moe_model if moe else megatron_engine.build_megatron_model)(
                work / "model")
            build = megatron_per_token.per_token_config if per_token_loss else megatron_engine.megatron_config
            config = build(path, groups=groups, micro=micro, tp=tp, pp=pp, distributed_optimizer=distributed_optimizer,
                           **({"remove_padding": True} if remove_padding else {}),
                           **({"max_token_len": max_token_len} if max_token_len else {}))
            if moe:
                moe_harness.apply_moe(config, ep=ep)
            world = tp * pp * dp
            if per_token_loss:
                wg = megatron_per_token.start_per_token_workers(config, world)
            elif max_token_len:
                wg = megatron_dynamic.start_dynamic_workers(config, world)
            else:
                wg = megatron_engine.start_megatron_workers(config, world, probe=True)
            return MegatronGroup(wg, pad_id, vocab, path, world)

        yield start
