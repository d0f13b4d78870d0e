"""Input and config validation: every rule raises a rule/why/fix error and changes nothing.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import math

import pytest
import torch

from thundersync_verl.core import (
    FunctionEstimator,
    GRPOEstimator,
    StreamingConfigError,
    StreamingError,
    StreamingGradientAccumulator,
    StreamingInputError,
    StreamingStateError,
    validate_streaming_config,
)

SHAPES = [(2, 3), (4,)]


def _params():
    return [torch.zeros(s, dtype=torch.float64) for s in SHAPES]


def _grad(v=1.0):
    return [torch.full(s, v, dtype=torch.float64) for s in SHAPES]


def _snapshot(acc):
    groups = {
        gid: (g.closed, sorted((repr(t), s.reward, s.processed, s.independent) for t, s in g.trajs.items()))
        for gid, g in acc.ledger.groups.items()
    }
    direct = [d.clone() for d in acc.buffers.batch] if acc.buffers.batch is not None else None
    return acc.bytes_in_use, acc.reserved_bytes, acc.counts, groups, direct


def _same(a, b) -> bool:
    return a[:4] == b[:4] and (a[4] is None) == (b[4] is None) and all(torch.equal(x, y) for x, y in zip(a[4] or [], b[4] or []))


@pytest.fixture
def acc():
    a = StreamingGradientAccumulator(_params(), estimator=GRPOEstimator())
    a.begin_batch({"g": 2, "h": 3})
    a.add_policy_grad("g", 0, _grad(), 3, reward=1.0)
    return a


BAD_CALLS = {
    "unknown group reward": (lambda a: a.report_reward("zz", 0, 1.0), StreamingInputError, "not part of the current batch"),
    "NaN reward": (lambda a: a.report_reward("h", 0, math.nan), StreamingInputError, "finite number"),
    "inf reward with grad": (lambda a: a.add_policy_grad("h", 0, _grad(), 2, reward=math.inf), StreamingInputError, "finite"),
    "bool reward": (lambda a: a.report_reward("h", 0, True), StreamingInputError, "finite number"),
    "added twice": (lambda a: a.add_policy_grad("g", 0, _grad(), 3, reward=1.0), StreamingInputError, "already added"),
    "conflicting reward": (lambda a: a.report_reward("g", 0, 0.0), StreamingInputError, "already has reward"),
    "too many members": (lambda a: [a.report_reward("g", 1, 0.0), a.report_reward("g", 2, 0.0)], StreamingInputError, "more than its declared size"),
    "wrong shape": (lambda a: a.add_policy_grad("h", 0, [torch.zeros(3, 2), torch.zeros(4)], 2), StreamingInputError, r"expected \(2, 3\)"),
    "wrong count": (lambda a: a.add_policy_grad("h", 0, _grad()[:1], 2), StreamingInputError, "has 1 tensors"),
    "int gradient": (lambda a: a.add_policy_grad("h", 0, [torch.zeros(2, 3, dtype=torch.long), torch.zeros(4)], 2), StreamingInputError, "dtype"),
    "negative tokens": (lambda a: a.add_policy_grad("h", 0, _grad(), -1), StreamingInputError, "non-negative int"),
    "float tokens": (lambda a: a.add_policy_grad("h", 0, _grad(), 2.0), StreamingInputError, "non-negative int"),
    "grads_negative without sign buckets": (lambda a: a.add_policy_grad("h", 0, _grad(), 2, grads_negative=_grad()), StreamingConfigError, "sign_buckets"),
    "independent twice": (lambda a: [a.add_independent_grad(_grad(), key=("h", 0)), a.add_independent_grad(_grad(), key=("h", 0))], StreamingInputError, "already added"),
    "bad chunk": (lambda a: a.plan_chunk([("g", 1), ("h", 0)]), StreamingInputError, "cannot share one backward"),
    "new batch while open": (lambda a: a.begin_batch({"x": 1}), StreamingStateError, "while a batch is open"),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_call_raises_rule_why_fix_and_changes_nothing(acc, name):
    call, exc, text = BAD_CALLS[name]
    before = _snapshot(acc)
    with pytest.raises(exc, match=text) as err:
        call(acc)
    msg = str(err.value)
    assert isinstance(err.value, StreamingError) and "why:" in msg and "fix:" in msg
    if name not in ("too many members", "independent twice"):  # their first step is legal
        assert _same(before, _snapshot(acc)), name


def test_calls_outside_a_batch_are_state_errors():
    a = StreamingGradientAccumulator(_params(), estimator=GRPOEstimator())
    for call in (lambda: a.report_reward("g", 0, 1.0), lambda: a.add_policy_grad("g", 0, _grad(), 1),
                 lambda: a.add_independent_grad(_grad()), lambda: a.rank_ready([])):
        with pytest.raises(StreamingStateError, match="begin_batch"):
            call()


def test_local_members_and_group_declarations():
    a = StreamingGradientAccumulator(_params(), estimator=GRPOEstimator())
    with pytest.raises(StreamingInputError, match="needs a mapping"):
        a.begin_batch([("g", 2)])
    with pytest.raises(StreamingInputError, match="size 0"):
        a.begin_batch({"g": 0})
    with pytest.raises(StreamingInputError, match="not in group_sizes"):
        a.begin_batch({"g": 2}, local_members={"x": [0]})
    a.begin_batch({"g": 2}, local_members={"g": [0]})
    with pytest.raises(StreamingInputError, match="not a local member"):
        a.add_policy_grad("g", 1, _grad(), 2, reward=0.0)
    a.report_reward("g", 1, 0.0)  # remote rewards are welcome
    a.add_policy_grad("g", 0, _grad(), 2, reward=1.0)
    assert a.pending_work() == []


def test_stale_chunk_plan_and_canonical_rules():
    a = StreamingGradientAccumulator(_params(), estimator=GRPOEstimator())
    a.begin_batch({"g": 1})
    a.report_reward("g", 0, 1.0)
    plan = a.plan_chunk([("g", 0)])
    a.abort_batch()
    a.begin_batch({"g": 1})
    with pytest.raises(StreamingStateError, match="earlier batch"):
        a.add_chunk_grad(plan, _grad(), [2])
    c = StreamingGradientAccumulator(_params(), estimator=GRPOEstimator(), canonical_order=True)
    c.begin_batch({"g": 1})
    with pytest.raises(StreamingConfigError, match="key=\\(gid, tid\\)"):
        c.add_independent_grad(_grad())
    with pytest.raises(StreamingConfigError, match="chunks are not available"):
        c.plan_chunk([("g", 0)])


def test_estimator_breaking_the_equal_reward_rule_is_caught_at_close():
    # advantage depends on the trajectory's position, not only its reward
    est = FunctionEstimator(lambda rs: [float(i) for i in range(len(rs))], name="positional")
    a = StreamingGradientAccumulator(_params(), estimator=est)
    a.begin_batch({"g": 2})
    a.add_policy_grad("g", 0, _grad(), 2, reward=1.0)
    before = _snapshot(a)
    with pytest.raises(StreamingConfigError, match="two different advantages"):
        a.report_reward("g", 1, 1.0)
    assert _same(before, _snapshot(a))


def test_constructor_rules():
    with pytest.raises(StreamingConfigError, match="loss_scale_factor"):
        StreamingGradientAccumulator(_params(), estimator=GRPOEstimator(), loss_agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(StreamingConfigError, match="affine"):
        StreamingGradientAccumulator(_params(), estimator=FunctionEstimator(lambda r: r), path="affine")
    with pytest.raises(StreamingConfigError, match="storage"):
        StreamingGradientAccumulator(_params(), estimator=GRPOEstimator(), storage="disk")
    with pytest.raises(StreamingConfigError, match="at least one parameter"):
        StreamingGradientAccumulator([], estimator=GRPOEstimator())
    with pytest.raises(StreamingConfigError, match="max_distinct_rewards"):
        StreamingGradientAccumulator(_params(), estimator=GRPOEstimator(), max_distinct_rewards=0)


GOOD = dict(ppo_epochs=1, ppo_mini_batch_size=32, train_batch_size=32, rollout_n=8)
CONFIG_CASES = {
    "epochs": (dict(ppo_epochs=0), "actor_rollout_ref.actor.ppo_epochs"),
    "mini-batches": (dict(ppo_mini_batch_size=12), "actor_rollout_ref.actor.ppo_mini_batch_size"),
    "mini-batch above the batch": (dict(ppo_mini_batch_size=64), "actor_rollout_ref.actor.ppo_mini_batch_size"),
    "agg mode": (dict(loss_agg_mode="seq-mean"), "actor_rollout_ref.actor.loss_agg_mode"),
    "sum-norm divisor": (dict(loss_agg_mode="seq-mean-token-sum-norm"), "actor_rollout_ref.actor.loss_scale_factor"),
    "policy loss": (dict(policy_loss_mode="clip_cov"), "actor_rollout_ref.actor.policy_loss.loss_mode"),
    "estimator": (dict(adv_estimator="gae"), "algorithm.adv_estimator"),
    "clip band": (dict(clip_ratio_low=1.5), "actor_rollout_ref.actor.clip_ratio_low"),
    "dual clip": (dict(clip_ratio_c=0.9), "actor_rollout_ref.actor.clip_ratio_c"),
    "kl type": (dict(use_kl_loss=True, kl_loss_type="k9"), "actor_rollout_ref.actor.kl_loss_type"),
    "bypass ppo clip": (dict(bypass_mode=True), "algorithm.rollout_correction.bypass_mode"),
    "batch-normalised IS": (dict(rollout_is="token", rollout_is_batch_normalize=True), "rollout_is_batch_normalize"),
    "IS level": (dict(rollout_is="tokens"), "algorithm.rollout_correction.rollout_is"),
    "IS threshold": (dict(rollout_is="token", rollout_is_threshold="2_1"), "rollout_is_threshold"),
    "group size": (dict(rollout_n=0), "actor_rollout_ref.rollout.n"),
}


@pytest.mark.parametrize("name", sorted(CONFIG_CASES))
def test_validate_streaming_config_names_the_verl_key(name):
    change, key = CONFIG_CASES[name]
    with pytest.raises(StreamingConfigError) as err:
        validate_streaming_config(**{**GOOD, **change})
    assert key in str(err.value) and "why:" in str(err.value) and "fix:" in str(err.value)


def test_validate_streaming_config_accepts_and_derives_settings():
    s = validate_streaming_config(**GOOD)
    assert s.estimator.name == "grpo" and s.ratio_is_one and not s.sign_buckets
    s = validate_streaming_config(**{**GOOD, "ppo_mini_batch_size": 8, "ppo_epochs": 3})  # 4 mini-batches x 3 epochs
    assert s.ratio_is_one
    s = validate_streaming_config(**GOOD, adv_estimator="rloo", rollout_is="sequence", rollout_is_threshold="0.5_2.0")
    assert s.estimator.name == "rloo" and (s.rollout_is_lower, s.rollout_is_upper) == (0.5, 2.0)
    s = validate_streaming_config(**GOOD, bypass_mode=True, sign_buckets=True)
    assert s.sign_buckets and not s.ratio_is_one
    s = validate_streaming_config(**GOOD, bypass_mode=True, bypass_loss_type="reinforce", rollout_is="token")
    assert not s.sign_buckets
    s = validate_streaming_config(**GOOD, norm_adv_by_std_in_grpo=False, loss_agg_mode="seq-mean-token-sum-norm",
                                  loss_scale_factor=4096)
    assert s.estimator.name == "grpo_no_std" and s.loss_scale_factor == 4096
