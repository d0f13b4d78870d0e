"""The batch barrier: fixed order, a guard that refuses early steps, verl's skip rules.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import math

import pytest
import torch

from thundersync_verl.core import GRPOEstimator, StreamingConfigError, StreamingGradientAccumulator, StreamingStateError


def _params():
    return [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))]


def _grad(v: float):
    return [torch.full((3,), v, dtype=torch.float64), torch.full((2, 2), 2 * v, dtype=torch.float64)]


class Recorder:
    """Stands in for optimizer / scheduler / hooks and records the call order."""

    def __init__(self, params, log):
        self.params, self.log = params, log

    def step(self):
        self.log.append(("step", [p.grad.clone() for p in self.params]))

    def zero_grad(self):
        self.log.append(("zero", None))
        for p in self.params:
            p.grad = None


class Scheduler:
    def __init__(self, log):
        self.log = log

    def step(self):
        self.log.append(("lr", None))


def _full_batch(acc):
    acc.begin_batch({"g": 2})
    acc.add_policy_grad("g", 0, _grad(1.0), num_tokens=2, reward=1.0)
    acc.add_policy_grad("g", 1, _grad(3.0), num_tokens=2, reward=0.0)


def test_order_fold_normalise_reduce_clip_step_schedule_zero():
    params, log = _params(), []
    acc = StreamingGradientAccumulator(params, estimator=GRPOEstimator(norm_by_std=False))
    _full_batch(acc)
    seen = {}

    def dp_reduce(tensors):
        seen["reduce"] = [t.clone() for t in tensors]
        log.append(("reduce", None))

    def clip():
        log.append(("clip", None))
        return torch.tensor(5.0)

    opt, sched = Recorder(params, log), Scheduler(log)
    report = acc.finish_batch(params, optimizer=opt, lr_scheduler=sched, dp_reduce=dp_reduce, clip_grad=clip)
    assert [name for name, _ in log] == ["reduce", "clip", "step", "lr", "zero"]
    # Dr.GRPO: A = r - 0.5 -> coefficients -0.5 and +0.5; token-mean over 4 tokens
    expected = (-0.5 * 1.0 + 0.5 * 3.0) / 4
    assert torch.allclose(seen["reduce"][0], torch.full((3,), expected, dtype=torch.float64))
    assert torch.allclose(log[2][1][1], torch.full((2, 2), 2 * expected, dtype=torch.float64))
    assert report.stepped and report.scale == 0.25 and report.grad_norm == 5.0
    assert report.num_tokens == 4 and report.num_sequences == 2
    assert not acc.batch_open and all(p.grad is None for p in params)


def test_guard_refuses_open_group_and_changes_nothing():
    params, log = _params(), []
    acc = StreamingGradientAccumulator(params, estimator=GRPOEstimator())
    acc.begin_batch({"g": 2, "h": 1})
    acc.add_policy_grad("g", 0, _grad(1.0), num_tokens=2, reward=1.0)
    acc.report_reward("h", 0, 0.5)
    before = acc.bytes_in_use
    with pytest.raises(StreamingStateError, match="group 'g' is open: 1/2 rewards known") as err:
        acc.finish_batch(params, optimizer=Recorder(params, log))
    assert "group 'h' misses 1 trajectory gradient" in str(err.value)
    assert "why:" in str(err.value) and "fix:" in str(err.value)
    assert log == [] and acc.batch_open and acc.bytes_in_use == before
    assert all(p.grad is None for p in params)
    # finishing the work makes the same call succeed
    acc.add_policy_grad("g", 1, _grad(2.0), num_tokens=1, reward=0.0)
    acc.add_policy_grad("h", 0, _grad(2.0), num_tokens=1)
    assert acc.finish_batch(params, optimizer=Recorder(params, log)).stepped


def test_guard_refuses_accepted_but_unprocessed_trajectory():
    params = _params()
    acc = StreamingGradientAccumulator(params, estimator=GRPOEstimator())
    acc.begin_batch({"g": 2})
    acc.report_reward("g", 0, 1.0)
    acc.report_reward("g", 1, 0.0)  # the group closes, but no gradient arrived yet
    with pytest.raises(StreamingStateError, match="misses 2 trajectory gradient"):
        acc.compute_batch_gradient()


def test_non_finite_norm_skips_step_but_advances_scheduler():
    params, log = _params(), []
    acc = StreamingGradientAccumulator(params, estimator=GRPOEstimator())
    _full_batch(acc)
    report = acc.finish_batch(params, optimizer=Recorder(params, log), lr_scheduler=Scheduler(log),
                              clip_grad=lambda: torch.tensor(math.inf))
    assert [name for name, _ in log] == ["lr", "zero"]
    assert not report.stepped and "non-finite" in report.skipped_reason


def test_max_grad_norm_clips_the_full_batch_gradient():
    params = _params()
    acc = StreamingGradientAccumulator(params, estimator=GRPOEstimator(norm_by_std=False), loss_agg_mode="token-sum")
    _full_batch(acc)
    report = acc.finish_batch(params, max_grad_norm=0.1)
    total = math.sqrt(sum(float((p.grad**2).sum()) for p in params))
    assert total == pytest.approx(0.1, rel=1e-6)
    assert report.grad_norm > 0.1 and report.stepped is False  # no optimizer: gradient left in .grad


def test_no_scored_tokens_skips_like_verl():
    params, log = _params(), []
    acc = StreamingGradientAccumulator(params, estimator=GRPOEstimator())
    acc.begin_batch({"g": 1})
    acc.add_policy_grad("g", 0, _grad(1.0), num_tokens=0, reward=1.0)
    report = acc.finish_batch(params, optimizer=Recorder(params, log), lr_scheduler=Scheduler(log))
    assert report.skipped_reason == "no scored tokens" and not report.stepped
    assert [name for name, _ in log] == ["zero", "lr"]


def test_write_grads_hook_receives_the_normalised_gradient():
    params = _params()
    acc = StreamingGradientAccumulator(params, estimator=GRPOEstimator(norm_by_std=False))
    _full_batch(acc)
    shards = [torch.zeros(3, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64)]

    def write(grads):
        for s, g in zip(shards, grads):
            s.copy_(g)
        return shards

    reduced = []
    acc.finish_batch(write_grads=write, dp_reduce=lambda ts: reduced.extend(ts))
    assert reduced[0] is shards[0]
    assert torch.allclose(shards[0], torch.full((3,), 0.25, dtype=torch.float64))
    assert all(p.grad is None for p in params)


def test_barrier_argument_errors():
    params = _params()
    acc = StreamingGradientAccumulator(params, estimator=GRPOEstimator())
    _full_batch(acc)
    with pytest.raises(StreamingConfigError, match="params"):
        acc.finish_batch()
    with pytest.raises(StreamingConfigError, match="either clip_grad or max_grad_norm"):
        acc.finish_batch(params, clip_grad=lambda: 1.0, max_grad_norm=1.0)
    with pytest.raises(StreamingConfigError, match="2 shards"):
        acc.finish_batch(params[:1])
    assert acc.batch_open


def test_a_new_batch_needs_the_old_one_finished():
    params = _params()
    acc = StreamingGradientAccumulator(params, estimator=GRPOEstimator())
    _full_batch(acc)
    with pytest.raises(StreamingStateError, match="begin_batch called while a batch is open"):
        acc.begin_batch({"x": 1})
    acc.abort_batch()
    assert acc.bytes_in_use == 0 and acc.open_groups == 0
    acc.begin_batch({"x": 1})


def test_harvest_from_params_adds_then_zeroes_and_treats_none_as_zero():
    params = _params()
    acc = StreamingGradientAccumulator(params, estimator=GRPOEstimator(), loss_agg_mode="token-sum")
    acc.begin_batch({"g": 1})
    params[0].grad = torch.full((3,), 2.0, dtype=torch.float64)  # params[1].grad stays None
    acc.add_policy_grad_from_params(params, "g", 0, num_tokens=1, reward=1.0)
    assert torch.equal(params[0].grad, torch.zeros(3, dtype=torch.float64)) and params[1].grad is None
    got = acc.compute_batch_gradient()
    divisor = float(torch.tensor(1.0) + 1e-6)  # verl's group-of-one rule: A = r / float32(1 + 1e-6)
    assert torch.equal(got[0], torch.full((3,), -2.0 / divisor, dtype=torch.float64))
    assert torch.equal(got[1], torch.zeros(2, 2, dtype=torch.float64))
