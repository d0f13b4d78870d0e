"""The checks every Megatron layout runs (``test_megatron_*_on_cpu.py`` call them with their worker group)..

1. One streamed step (arrival order permuted, buckets for open groups, folds, ONE finalize) equals
   verl's own ``update_actor`` on the same batch, to fp32 summation order.
2. The same stream with verl's per-call ``finalize_model_grads`` left on is far off: the test of (1)
   can fail, and the learner's switch is what makes it pass. The per-token-loss tests use another control
   (the stream without the regime's compensation, ``probe_raw_per_token``).
"""

from __future__ import annotations

from thundersync_harness.engine_setup import make_trajectories
from thundersync_harness.engine_steps import relative_gap, stream_step, sync_step, train

SEED = 5


def streamed_vs_verl(group, groups: int, control: str = "probe_finalize_every_call", key: str = "every_call") -> dict:
    """dθ of verl's update, of the streamed step, and of the stream under a broken control (the worker's probe
    method ``control`` switched on: by default finalize on every call), reported as ``key`` and ``gap_<key>``."""
    wg, pad = group.wg, group.pad_id
    trajs, arrival = make_trajectories(SEED, groups, group.vocab)
    [d_sync], [info_sync] = train(wg, [lambda: sync_step(wg, trajs, list(range(len(trajs))), pad)])
    [d_stream], [info] = train(wg, [lambda: stream_step(wg, trajs, arrival, pad)])
    getattr(wg, control)(True)
    try:
        [d_control], _ = train(wg, [lambda: stream_step(wg, trajs, arrival, pad)])
    finally:
        getattr(wg, control)(False)
    return {"sync": d_sync, "stream": d_stream, key: d_control, "info": info, "info_sync": info_sync,
            "gap": relative_gap(d_stream, d_sync), f"gap_{key}": relative_gap(d_control, d_sync)}
