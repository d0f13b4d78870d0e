"""Chunks built per data-parallel rank reach verl's FSDP2 engine (2 ranks, gloo) and give verl's update.

With several data-parallel ranks ``stream_exec`` builds a chunk as one part per rank (``build_stream_parts``) and
the streaming dispatch sends each part as built (``va.DataParallelParts``), instead of verl splitting the whole
chunk on every call. The streamed step through the trainer's queued pipeline must still equal verl's own
``update_actor`` step. Needs no GPU: two Ray workers on the CPU platform (~40-90 s on 2 cores, started once).
"""

from __future__ import annotations

import contextlib

import pytest

from thundersync_harness import engine_setup as setup
from thundersync_harness.engine_setup import make_trajectories
from thundersync_harness.engine_steps import relative_gap, stream_step, sync_step, train

pytestmark = pytest.mark.slow  # Ray and verl's FSDP2 engine on two ranks
GROUPS = 2


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    with contextlib.ExitStack() as session:
        session.enter_context(setup.ray_session())
        model_path, pad_id, vocab = setup.build_tiny_model(tmp_path_factory.mktemp("engine") / "model")
        config = setup.verl_config(model_path, groups=GROUPS, micro=4)
        yield {"wg": setup.start_workers(config, dp=2), "pad": pad_id, "vocab": vocab}


def test_dp2_chunks_sent_per_rank_give_verls_update(dp2):
    from thundersync_verl import verl_adapter as va

    wg, pad = dp2["wg"], dp2["pad"]
    assert va.actor_dp_size(wg) == 2
    trajs, arrival = make_trajectories(11, GROUPS, dp2["vocab"])
    [d_sync], [info_sync] = train(wg, [lambda: sync_step(wg, trajs, list(range(len(trajs))), pad)])
    finished: list = []
    [d_stream], [info] = train(wg, [lambda: stream_step(wg, trajs, arrival, pad, every=3, max_chunk=3, pipeline=2,
                                                        finished=finished)])
    assert float(d_sync.norm()) > 1e-4
    assert relative_gap(d_stream, d_sync) < 1e-5  # fp32 summation order only
    assert info["grad_norm"] == pytest.approx(info_sync["grad_norm"], rel=1e-5)
    assert info["ops/direct"] > 0 and len(finished) >= 3  # chunks of 1-3 rows, padded per rank, all through parts
