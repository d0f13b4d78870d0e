"""``thundersync plan`` and the learner agree on where buckets live and what they cost (``core/bucket_memory.py``).

GPUs needed: 0.
"""

from __future__ import annotations

import torch

from thundersync_verl.core import BufferPool, GradLayout
from thundersync_verl.core.bucket_memory import bucket_memory
from thundersync_verl.sim.hardware import ClusterSpec, ModelSpec, group_buckets, rank_numel
from thundersync_verl.sim.sim_cli import main


def test_the_plan_prices_buckets_with_the_learners_function(capsys):
    main(["plan", "--params", "8.2B", "--layers", "36", "--hidden", "4096", "--gpus", "8", "--learner-gpus", "4",
          "--cp", "4", "--steps", "4"])
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("Buckets"))
    one = bucket_memory(8_200_000_000 // 4, bucket_device="host", accelerator=True)
    assert f"x {one.bucket_bytes:,} B" in line and "thundersync.bucket_device=host" in line  # auto on GPUs: host
    buckets = int(line.split(": ")[1].split(" x ")[0])
    assert f"thundersync.memory_budget_bytes={buckets * one.bucket_bytes}" in line


def test_the_learners_pool_has_the_planned_bucket_size():
    model, cluster = ModelSpec("m", 4096.0, 2, 64), ClusterSpec(gpus=2, learner_gpus=1)
    layout = GradLayout.from_tensors([torch.zeros(rank_numel(model, cluster))])
    assert BufferPool.for_learner(layout).buffer_bytes == group_buckets(model, cluster, 1).bucket_bytes
    assert group_buckets(model, cluster, 3, per_group=8).buckets == 24
