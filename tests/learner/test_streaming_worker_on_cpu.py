"""The streaming worker on verl's real FSDP2 engine (a 1-process Ray worker group on the CPU).

Needs no GPU: Ray gets one logical device slot, verl runs on the project's CPU platform (gloo).
One streamed step must equal verl's own ``update_actor`` step, and every refusal must leave the
weights untouched. The module starts Ray once (~20-40 s on 2 cores) and shuts it down.
"""

from __future__ import annotations

import pytest
import torch

from thundersync_harness.engine_setup import make_trajectories
from thundersync_harness.engine_steps import relative_gap, stream_step, sync_step, train
from thundersync_verl.core import StreamingConfigError, StreamingInputError, StreamingStateError
from thundersync_verl.step.chunk_layout import build_stream_chunk

pytestmark = pytest.mark.slow  # Ray and verl's FSDP2 engine, started once per module (20-40 s), then real steps
GROUPS = 2


@pytest.fixture(scope="module")
def harness(start_engine):
    engine = start_engine(groups=GROUPS)
    return {"wg": engine.wg, "pad": engine.pad_id, "vocab": engine.vocab}


def test_one_streamed_step_equals_verls_update_actor(harness):
    wg, pad = harness["wg"], harness["pad"]
    trajs, arrival = make_trajectories(5, GROUPS, harness["vocab"])
    [d_sync], [info_sync] = train(wg, [lambda: sync_step(wg, trajs, list(range(len(trajs))), pad)])
    [d_stream], [info] = train(wg, [lambda: stream_step(wg, trajs, arrival, pad)])
    assert float(d_sync.norm()) > 1e-4  # the step moved the weights
    assert relative_gap(d_stream, d_sync) < 1e-5  # fp32 summation order only (floor ~1e-6)
    assert info["grad_norm"] == pytest.approx(info_sync["grad_norm"], rel=1e-5)
    assert info["ops/bucket"] > 0 and info["ops/fold"] > 0 and info["ops/direct"] > 0  # all routes ran
    assert info["stream/peak_bytes"] >= info["stream/buffer_bytes"] > 0 and info["stream/bytes_in_use"] == 0


def test_queued_calls_run_in_ticket_order_and_give_the_same_step(harness):
    wg, pad = harness["wg"], harness["pad"]
    trajs, arrival = make_trajectories(5, GROUPS, harness["vocab"])
    [d_sync], _ = train(wg, [lambda: sync_step(wg, trajs, list(range(len(trajs))), pad)])
    finished: list = []
    # depth 4: backward and fold calls wait on the worker together; folds must not overtake their buckets
    [d_queued], [info] = train(wg, [lambda: stream_step(wg, trajs, arrival, pad, every=3, max_chunk=2,
                                                        pipeline=4, finished=finished)])
    assert relative_gap(d_queued, d_sync) < 1e-5
    assert info["ops/fold"] > 0 and len(finished) >= 4
    for (_, _, prev_end), (_, start, end) in zip(finished, finished[1:]):
        assert prev_end <= start + 1e-3 and start <= end  # one at a time, in submission order


def test_a_call_that_arrives_before_its_predecessor_waits_for_it(harness):
    # Ray starts a task once its arguments are fetched: a small fold can reach the worker before
    # the chunk that fills its bucket. Sent in that order on purpose, the fold must still run second.
    import ray

    from thundersync_verl import verl_adapter as va
    from thundersync_verl.step.chunk_layout import SEQ_KEY

    wg, pad = harness["wg"], harness["pad"]
    wg.stream_begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": GROUPS})
    fold = va.worker_result_refs(wg.stream_fold_queued({"g=0|r=1.0": 0.5}, 1))
    chunk = _bucket_chunk(pad)
    va.assign_non_tensor(chunk, **{SEQ_KEY: 0})
    backward = va.worker_result_refs(wg.stream_backward_queued(chunk))
    [fold_row], [backward_row] = ray.get(fold, timeout=60), ray.get(backward, timeout=60)
    assert float(fold_row["ts_t_start"]) >= float(backward_row["ts_t_end"]) - 1e-3
    assert wg.stream_memory()[0]["stream/open_buckets"] == []  # the fold found its bucket filled
    assert wg.finalize_step(0.25)[0]["grad_norm"] > 0


def test_a_streamed_call_reports_its_forwards_seconds_inside_its_own(harness):
    # the simulator prices a separate old-log-prob forward from these (forward_clock.py, sim/transfer.py)
    import ray

    from thundersync_verl import verl_adapter as va
    from thundersync_verl.step.chunk_layout import SEQ_KEY

    wg, pad = harness["wg"], harness["pad"]
    wg.stream_begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": GROUPS})
    chunk = _bucket_chunk(pad)
    va.assign_non_tensor(chunk, **{SEQ_KEY: 0})
    [row] = ray.get(va.worker_result_refs(wg.stream_backward_queued(chunk)), timeout=60)
    forward, span = float(row["ts_forward_s"]), float(row["ts_t_end"]) - float(row["ts_t_start"])
    assert 0.0 < forward < span  # the model's forward, not the call's backward and bookkeeping
    ray.get(va.worker_result_refs(wg.stream_fold_queued({"g=0|r=1.0": 0.5}, 1)), timeout=60)
    assert wg.finalize_step(0.25)[0]["grad_norm"] > 0


def test_a_reused_ticket_is_refused_with_the_rule(harness):
    import ray

    from thundersync_verl import verl_adapter as va
    from thundersync_verl.step.chunk_layout import SEQ_KEY

    wg, pad = harness["wg"], harness["pad"]
    wg.stream_begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": GROUPS})
    first = _bucket_chunk(pad)
    va.assign_non_tensor(first, **{SEQ_KEY: 0})
    ray.get(va.worker_result_refs(wg.stream_backward_queued(first)))
    again = _bucket_chunk(pad)
    va.assign_non_tensor(again, **{SEQ_KEY: 0})
    with pytest.raises(Exception, match="ticket already used"):
        ray.get(va.worker_result_refs(wg.stream_backward_queued(again)))
    with pytest.raises(Exception, match="needs a ticket"):
        ray.get(va.worker_result_refs(wg.stream_backward_queued(_bucket_chunk(pad))))


def _bucket_chunk(pad, coef=1.0, dest="g=0|r=1.0"):
    return build_stream_chunk([[11, 12, 13]], [[14, 15, 16, 17]], [coef], dest, dp_size=1, pad_token_id=pad)


def test_refusals_state_the_rule_and_leave_the_weights_unchanged(harness):
    wg, pad = harness["wg"], harness["pad"]
    wg.reset_actor()
    theta0 = wg.gather_flat_params()[0]
    with pytest.raises(StreamingStateError, match="no streaming batch open"):
        wg.stream_backward(_bucket_chunk(pad))
    wg.stream_begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": GROUPS})
    wg.stream_backward(_bucket_chunk(pad))
    assert wg.stream_memory()[0]["stream/open_buckets"] == ["g=0|r=1.0"]
    with pytest.raises(StreamingStateError, match="not folded"):
        wg.finalize_step(0.25)
    with pytest.raises(StreamingInputError, match="hold no gradient"):
        wg.stream_fold({"g=7|r=0.0": 1.0})
    wg.stream_fold({"g=0|r=1.0": 0.5})
    with pytest.raises(StreamingInputError, match="finite positive scale"):
        wg.finalize_step(float("nan"))
    assert torch.equal(wg.gather_flat_params()[0], theta0)  # nothing stepped so far
    metrics = wg.finalize_step(0.25)[0]  # the refused calls changed nothing: the step still works
    assert metrics["grad_norm"] > 0 and metrics["stream/bytes_in_use"] == 0
    assert not torch.equal(wg.gather_flat_params()[0], theta0)
    with pytest.raises(StreamingStateError, match="no streaming batch open"):
        wg.stream_fold({})


def test_worker_refuses_a_batch_that_verl_cannot_cut_into_equal_mini_batches(harness):
    harness["wg"].stream_begin_batch({"train_batch_size": 2 * GROUPS})  # two mini-batches: streamed (minibatch_plan)
    with pytest.raises(StreamingConfigError, match=f"must divide data.train_batch_size={2 * GROUPS + 1}"):
        harness["wg"].stream_begin_batch({"train_batch_size": 2 * GROUPS + 1})
    with pytest.raises(StreamingConfigError, match="asks for loss_agg_mode"):
        harness["wg"].stream_begin_batch({"loss_agg_mode": "seq-mean-token-mean"})


def test_host_buckets_under_a_budget_give_the_unbudgeted_device_buckets_update(harness):
    """``thundersync.bucket_device=host`` (core/bucket_memory.py) with a budget of 2 buckets: the same update as
    device buckets without a budget, at most 2 buckets held, all of them in host memory."""
    from thundersync_harness.megatron_engine import budgeted_stream_step

    wg, pad = harness["wg"], harness["pad"]
    trajs, arrival = make_trajectories(7, GROUPS, harness["vocab"])
    bucket = int(wg.stream_memory()[0]["stream/buffer_bytes"])

    def step(budget, device):
        return budgeted_stream_step(wg, trajs, arrival, pad, grad_numel=bucket // 4, bucket_bytes=bucket,
                                    budget_buckets=budget, extra_meta={"bucket_device": device})

    [d_device], [info_device] = train(wg, [lambda: step(None, "device")])
    [d_host], [info_host] = train(wg, [lambda: step(2, "host")])
    rank = info_host["ranks"][0]
    assert relative_gap(d_host, d_device) < 1e-5
    assert 0 < rank["thundersync/peak_bucket_bytes"] <= 2 * bucket
    assert rank["stream/peak_host_bytes"] == rank["thundersync/peak_bucket_bytes"]
    assert info_device["ranks"][0]["stream/peak_host_bytes"] == 0
