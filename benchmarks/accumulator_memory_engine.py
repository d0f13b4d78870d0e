"""``accumulator_memory.py --bucket-device D --budget-buckets K``: the streaming worker's buckets, placed and budgeted.

Why:
1. The core figures of ``accumulator_memory.py`` count buffers of a simulated learner; this part runs the real
   streaming worker on verl's FSDP2 engine (one CPU worker, the equivalence benchmark's tiny model and
   trajectories) with its buckets where ``thundersync.bucket_device`` puts them (``core/bucket_memory.py``) and
   a budget of K buckets on both sides (the planner's reservations, the learner's ``memory_budget_bytes``).
2. The reference is the same stream unbudgeted with device buckets; the floor is verl's own ``update_actor``
   against itself with the rows in another micro-batch order (``equivalence.transposed_order``). The budgeted,
   placed run must give the same update (``gap_over_floor`` <= 2), hold at most K buckets
   (``peak_bucket_bytes`` <= the budget) and report where the bytes were (``peak_host_bytes``).
3. On a CPU learner ``host`` and ``device`` are the same memory; the host path's code (``core/buffers.py``:
   ``_into_host_`` / ``_into_device_``) is what runs, with its side stream and events as no-ops.
"""

from __future__ import annotations

import shutil
import tempfile
from functools import partial
from pathlib import Path

GROUPS, STEPS = 4, 2


def engine_bucket_run(args) -> dict:
    """Run the three kinds of step on one FSDP2 worker group; the figures of point 2."""
    import ray

    from equivalence import transposed_order
    from thundersync_harness.engine_setup import build_tiny_model, make_trajectories, prepare_environment, start_workers, verl_config
    from thundersync_harness.engine_steps import relative_gap, sync_step, train
    from thundersync_harness.megatron_engine import budgeted_stream_step

    work = Path(tempfile.mkdtemp(prefix="ts_bucket_device_"))
    ray_tmp = prepare_environment()
    try:
        model_path, pad_id, vocab = build_tiny_model(work / "model")
        wg = start_workers(verl_config(model_path, groups=GROUPS, micro=4), 1)
        bucket = int(wg.stream_memory()[0]["stream/buffer_bytes"])
        batches = [make_trajectories(1000 + s, GROUPS, vocab) for s in range(STEPS if args.quick else STEPS + 1)]

        def stream(budget, device):
            return [partial(budgeted_stream_step, wg, trajs, arrival, pad_id, grad_numel=bucket // 4, bucket_bytes=bucket,
                            budget_buckets=budget, extra_meta={"bucket_device": device}) for trajs, arrival in batches]

        (da, _), (db, _) = (train(wg, [partial(sync_step, wg, t, order(len(t)), pad_id) for t, _ in batches])
                            for order in (lambda n: list(range(n)), lambda n: transposed_order(n, 4)))
        du, info_u = train(wg, stream(None, "device"))
        dq, info_q = train(wg, stream(args.budget_buckets, args.bucket_device))
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    gap = max(relative_gap(q, a) / relative_gap(b, a) for q, a, b in zip(dq, da, db))
    ranks_q = [r for i in info_q for r in i["ranks"]]
    peak = max(r["thundersync/peak_bucket_bytes"] for r in ranks_q)
    out = {"engine": "fsdp2", "bucket_device": args.bucket_device, "bucket_bytes": bucket,
           "budget_buckets": args.budget_buckets, "bucket_budget_bytes": args.budget_buckets * bucket,
           "peak_bucket_bytes": peak, "peak_host_bytes": max(r["stream/peak_host_bytes"] for r in ranks_q),
           "unbudgeted_peak_bucket_bytes": max(r["thundersync/peak_bucket_bytes"] for i in info_u for r in i["ranks"]),
           "waits": sum(i["waits"] for i in info_q), "gap_over_floor": gap,
           "budget_vs_unbudgeted_gap": max(relative_gap(q, u) for q, u in zip(dq, du))}
    print(f"fsdp2 bucket_device={args.bucket_device}: bucket {bucket} B, budget {args.budget_buckets} buckets, peak "
          f"{peak} B ({out['peak_host_bytes']} B host), unbudgeted peak {out['unbudgeted_peak_bucket_bytes']} B, "
          f"{out['waits']} waits, gap/floor {gap:.2f}")
    assert peak <= out["bucket_budget_bytes"], "the budgeted run held more bucket bytes than its budget"
    assert gap <= 2.0, f"the budgeted run's update differs from verl's beyond the floor (gap/floor {gap:.2f})"
    return out
