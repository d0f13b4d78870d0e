"""The checks every Megatron layout runs (``test_megatron_*_on_cpu.py`` call them with their worker group)..

1. One streamed step (arrival order permuted, buckets for open groups, folds, ONE finalize) equals
   verl's own ``update_actor`` on the same batch, to fp32 summation order.
2. The same stream with verl's per-call ``finalize_model_grads`` left on is far off: the test of (1)
   can fail, and the learner's switch is what makes it pass.
"""

from __future__ import annotations

from thundersync_harness.engine_setup import make_trajectories
from thundersync_harness.engine_steps import relative_gap, stream_step, sync_step, train

SEED = 5


def streamed_vs_verl(group, groups: int) -> dict:
    """dθ of verl's update, of the streamed step, and of the stream with finalize on every call."""
    wg, pad = group.wg, group.pad_id
    trajs, arrival = make_trajectories(SEED, groups, group.vocab)
    [d_sync], [info_sync] = train(wg, [lambda: sync_step(wg, trajs, list(range(len(trajs))), pad)])
    [d_stream], [info] = train(wg, [lambda: stream_step(wg, trajs, arrival, pad)])
    wg.probe_finalize_every_call(True)
    try:
        [d_every], _ = train(wg, [lambda: stream_step(wg, trajs, arrival, pad)])
    finally:
        wg.probe_finalize_every_call(False)
    return {"sync": d_sync, "stream": d_stream, "every_call": d_every, "info": info, "info_sync": info_sync,
            "gap": relative_gap(d_stream, d_sync), "gap_every_call": relative_gap(d_every, d_sync)}
