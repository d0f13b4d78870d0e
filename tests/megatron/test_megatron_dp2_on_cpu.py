"""The streamed step on verl's Megatron engine with DP=2 and the distributed optimizer.

Buckets hold only this rank's reduce-scattered region (P / DP values), folded into the grad buffer
before the one ``finalize_model_grads``. Several mini-batches per batch (``MiniBatchPlanner``) step the
sharded optimizer once per mini-batch, as verl's ``update_actor`` does. Needs no GPU: two Ray workers on the
CPU platform. One launch for the module (~30-90 s on 2 cores).
"""

from __future__ import annotations

import pytest

from megatron_checks import streamed_vs_verl

pytestmark = pytest.mark.slow  # one Ray launch of verl's Megatron engine over gloo

GROUPS = 2


@pytest.fixture(scope="module")
def group(start_megatron):
    return start_megatron(dp=2, distributed_optimizer=True, groups=GROUPS)


def test_dp2_distributed_optimizer_buckets_hold_one_data_parallel_shard(group):
    memory = group.wg.stream_memory()[0]
    params = group.wg.gather_flat_params()[0].numel() // group.world  # every DP replica holds all parameters
    full = 4 * params  # fp32 grad buffer of one rank
    assert full / 2 <= memory["stream/buffer_bytes"] < 1.1 * full / 2  # one region of the DP reduce-scatter


def test_dp2_streamed_step_equals_verls_update_and_finalize_per_call_does_not(group):
    from thundersync_harness.engine_steps import relative_gap
    from thundersync_verl import verl_adapter as va

    assert va.actor_dp_size(group.wg) == 2  # rows are split over the two data-parallel ranks
    out = streamed_vs_verl(group, GROUPS)
    assert float(out["sync"].norm()) > 1e-4
    assert out["gap"] < 1e-5, out["gap"]  # fp32 summation order (floor ~6e-7 on this layout)
    # the applied gradient (learner/engines/megatron.py point 8): both ranks' shards, each parameter once; its norm
    # is the clipped norm of the gradient Megatron reports (clip 1.0), so no element is missing or counted twice
    params = group.wg.gather_flat_params()[0].numel() // group.world
    for info in (out["info"], out["info_sync"]):
        clipped = info["grad_norm"] * min(1.0, 1.0 / (info["grad_norm"] + 1e-6))
        assert info["applied"].numel() == params
        assert float(info["applied"].norm()) == pytest.approx(clipped, rel=1e-5)
    assert relative_gap(out["info"]["applied"], out["info_sync"]["applied"]) < 1e-5
    assert out["info"]["grad_norm"] == pytest.approx(out["info_sync"]["grad_norm"], rel=1e-5)
    assert out["info"]["ops/bucket"] > 0 and out["info"]["ops/fold"] > 0
    # the grad buffer reduce-scattered in place at every call, then again at the barrier
    assert out["gap_every_call"] > 1e-2 > 1000 * out["gap"], out["gap_every_call"]


def test_dp2_bucket_budget_refuses_a_bucket_that_does_not_fit_and_the_batch_goes_on(group):
    from thundersync_verl.core import StreamingStateError
    from thundersync_verl.step.chunk_layout import build_stream_chunk

    wg, pad = group.wg, group.pad_id
    one = wg.stream_memory()[0]["stream/buffer_bytes"]  # one bucket: this rank's DP region of the grad buffer

    def chunk(dest):
        return build_stream_chunk([[11, 12], [13]], [[14, 15], [16, 17]], [1.0, 1.0], dest, dp_size=group.world,
                                  pad_token_id=pad)

    wg.stream_begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": GROUPS, "memory_budget_bytes": one})
    wg.stream_backward(chunk("g=0|r=1.0"))
    wg.stream_backward(chunk("g=0|r=1.0"))  # the same bucket again: no new buffer
    with pytest.raises(StreamingStateError, match="budget full"):
        wg.stream_backward(chunk("g=1|r=0.0"))  # a second bucket does not fit
    wg.stream_fold({"g=0|r=1.0": 0.5})  # its group closes: the buffer is free again
    wg.stream_backward(chunk("g=1|r=0.0"))  # the refused call changed nothing: it runs now
    wg.stream_fold({"g=1|r=0.0": -0.5})
    metrics = wg.finalize_step(0.1)[0]
    assert metrics["thundersync/peak_bucket_bytes"] == one and metrics["stream/bytes_in_use"] == 0
    assert metrics["grad_norm"] > 0


@pytest.mark.parametrize("mb_groups, epochs", [(1, 1), (1, 2)])
def test_dp2_streamed_mini_batches_equal_verls_update_on_the_same_partition(group, mb_groups, epochs):
    # several optimizer steps per batch through the sharded optimizer: mini-batch 1 streamed at ratio 1, later
    # mini-batches and epochs as PPO chunks, one finalize and one distributed-optimizer step per mini-batch
    from thundersync_harness.engine_setup import make_trajectories
    from thundersync_harness.engine_steps import relative_gap, stream_step, sync_step, train
    from thundersync_harness.minibatch_steps import MiniBatchSpec, partition_rows, verl_order

    wg, pad = group.wg, group.pad_id
    trajs, arrival = make_trajectories(31, GROUPS, group.vocab)
    order = verl_order(partition_rows(trajs, arrival, mb_groups), dp=2)  # verl's mini-batch j = the stream's
    spec = MiniBatchSpec(mb_groups=mb_groups, epochs=epochs)
    [d_stream], [info] = train(wg, [lambda: stream_step(wg, trajs, arrival, pad, spec)])
    # a mini-batch of one group is 2 rows per data-parallel rank: verl's micro-batches must divide it
    [d_verl], _ = train(wg, [lambda: sync_step(wg, trajs, order, pad, spec, micro=2)])
    [d_one], _ = train(wg, [lambda: sync_step(wg, trajs, order, pad)])  # one optimizer step for the batch
    steps = GROUPS // mb_groups * epochs
    assert info["thundersync/optimizer_steps"] == info["ops/steps"] + 1 == steps and info["ops/ppo"] > 0
    assert relative_gap(d_one, d_verl) > 1e-2  # several steps land elsewhere than one
    assert relative_gap(d_stream, d_verl) < 1e-5, relative_gap(d_stream, d_verl)  # fp32 summation order
