"""Fixtures for the tests that run verl's real FSDP2 engine on the CPU (no GPU).

``start_engine`` is module-scoped: a module that asks for it gets ONE 1-rank worker group of
the streaming worker (Ray started once, ~20-40 s on 2 cores) that its tests share; at the end
of the module Ray is shut down and the process environment and torch threads are restored.
Each module builds its own engine (GRPO or OPD settings), so modules do not depend on each other.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from thundersync_harness import engine_setup as setup


@dataclass(frozen=True)
class Engine:
    wg: object  # verl's RayWorkerGroup of StreamingActorWorker, one rank
    pad_id: int
    vocab: int
    teacher: Path | None  # the OPD teacher model (opd=True), else None


@pytest.fixture(scope="module")
def start_engine(tmp_path_factory):
    """``start_engine(groups=..., opd=False) -> Engine``: tiny model, verl's config, worker group.

    ``opd=True`` also builds the teacher and gives the worker verl's ``distillation_config``, so
    its own ``update_actor`` runs verl's distillation loss. Call it once per module.
    """
    saved, threads = dict(os.environ), torch.get_num_threads()
    ray_tmp: list[Path] = []

    def start(*, groups: int, opd: bool = False, micro: int = 4) -> Engine:
        assert not ray_tmp, "one engine per test module"
        work = tmp_path_factory.mktemp("engine")
        ray_tmp.append(setup.prepare_environment())
        model_path, pad_id, vocab = setup.build_tiny_model(work / "model")
        teacher = setup.build_teacher(model_path, work / "teacher") if opd else None
        config = setup.verl_config(model_path, groups=groups, micro=micro, teacher=teacher)
        return Engine(setup.start_workers(config, dp=1, distillation=opd), pad_id, vocab, teacher)

    try:
        yield start
    finally:
        if ray_tmp:
            import ray

            ray.shutdown()
            shutil.rmtree(ray_tmp[0], ignore_errors=True)
        os.environ.clear()
        os.environ.update(saved)
        torch.set_num_threads(threads)
