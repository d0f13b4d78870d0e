"""The streamed step on verl's Megatron engine with PP=2 (1F1B over gloo, embeddings tied across the stages).

Needs no GPU: two Ray workers on the CPU platform. One launch for the module (~30-90 s on 2 cores).
"""

from __future__ import annotations

import pytest

from megatron_checks import streamed_vs_verl

pytestmark = pytest.mark.slow  # one Ray launch of verl's Megatron engine over gloo

GROUPS = 2


@pytest.fixture(scope="module")
def group(start_megatron):
    return start_megatron(pp=2, groups=GROUPS)


def test_pp2_streamed_step_equals_verls_update_and_finalize_per_call_does_not(group):
    out = streamed_vs_verl(group, GROUPS)
    assert float(out["sync"].norm()) > 1e-4
    assert out["gap"] < 1e-5, out["gap"]  # fp32 summation order (floor ~5e-7 on this layout)
    assert out["info"]["grad_norm"] == pytest.approx(out["info_sync"]["grad_norm"], rel=1e-5)
    assert out["info"]["ops/bucket"] > 0 and out["info"]["ops/fold"] > 0
    # the tied embedding's two copies all-reduced at every call: counted again and again
    assert out["gap_every_call"] > 1e-2 > 1000 * out["gap"], out["gap_every_call"]
    # the applied gradient (learner/engines/megatron.py applied_gradient): SGD at lr 0.05, before storage rounding,
    # both pipeline stages' parameters in flat_params's layout
    for d, info in ((out["sync"], out["info_sync"]), (out["stream"], out["info"])):
        assert d.shape == info["applied"].shape and float(info["applied"].norm()) > 1e-3
        assert float((d + 0.05 * info["applied"]).abs().max()) <= 2.4e-7
    from thundersync_harness.engine_steps import relative_gap

    assert relative_gap(out["info"]["applied"], out["info_sync"]["applied"]) < 1e-5


def test_pp2_a_batch_dropped_half_way_leaves_no_trace_in_the_next_step(group):
    # a batch dropped half-way (begin again) leaves no trace: the next full stream still equals verl
    from thundersync_harness.engine_setup import make_trajectories
    from thundersync_harness.engine_steps import relative_gap, stream_step, sync_step, train
    from thundersync_verl.step.chunk_layout import build_stream_chunk

    wg, pad = group.wg, group.pad_id
    trajs, arrival = make_trajectories(11, GROUPS, group.vocab)
    [d_sync], _ = train(wg, [lambda: sync_step(wg, trajs, list(range(len(trajs))), pad)])

    def dropped_then_streamed():
        wg.stream_begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": GROUPS})
        wg.stream_backward(build_stream_chunk([[11, 12]], [[13, 14, 15]], [1.0], "g=0|r=1.0", dp_size=group.world,
                                              pad_token_id=pad))
        wg.stream_backward(build_stream_chunk([[11, 12]], [[16, 17]], [0.5], "direct", dp_size=group.world,
                                              pad_token_id=pad))
        return stream_step(wg, trajs, arrival, pad)  # begins a new batch: the open one is dropped

    [d_stream], _ = train(wg, [dropped_then_streamed])
    assert relative_gap(d_stream, d_sync) < 1e-5
