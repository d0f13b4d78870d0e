"""Accumulator memory manager: exact accounting, byte budget, ranking, waiting, canonical headroom.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync_verl.core import (
    AccumulatorBudgetError,
    GRPOEstimator,
    RLOOEstimator,
    StreamingConfigError,
    StreamingGradientAccumulator,
    StreamingInputError,
)

SHAPES = [(4, 3), (5,)]
BUF = (12 + 5) * 4  # bytes of one float32 buffer


def _params(dtype=torch.float32):
    return [torch.zeros(s, dtype=dtype) for s in SHAPES]


def _grad(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]


def _allocated_bytes(acc) -> int:
    """Bytes of every tensor the accumulator holds, found by walking its gradient buffers."""
    return sum(t.numel() * t.element_size() for t in acc.buffers.tensors())


def test_exact_accounting_on_the_affine_path():
    acc = StreamingGradientAccumulator(_params(), estimator=GRPOEstimator())
    assert acc.layout.buffer_bytes == BUF
    acc.begin_batch({"a": 3, "b": 2})
    assert acc.bytes_in_use == BUF == _allocated_bytes(acc)  # the batch buffer
    acc.add_policy_grad("a", 0, _grad(0), 4, reward=1.0)  # S0 only (first reward is r_ref)
    assert acc.bytes_in_use == 2 * BUF == _allocated_bytes(acc) and acc.open_groups == 1
    acc.add_policy_grad("a", 1, _grad(1), 4, reward=0.0)  # S1 appears
    assert acc.bytes_in_use == 3 * BUF == _allocated_bytes(acc)
    assert acc.reserved_bytes == 3 * BUF  # batch + 2 reserved for group a
    acc.add_policy_grad("b", 0, _grad(2), 4)  # reward unknown: pending buffer + b's reservation
    assert acc.bytes_in_use == 4 * BUF == _allocated_bytes(acc) and acc.open_groups == 2
    acc.report_reward("a", 2, 1.0)  # a closes: its buffers fold and go
    assert acc.bytes_in_use == 2 * BUF == _allocated_bytes(acc) and acc.open_groups == 1
    acc.report_reward("b", 0, 0.0)  # pending moves into b's S0
    assert acc.bytes_in_use == 2 * BUF == _allocated_bytes(acc)
    acc.add_policy_grad("a", 2, _grad(3), 4)  # closed group: direct, no buffer
    assert acc.bytes_in_use == 2 * BUF
    assert acc.peak_bytes == 4 * BUF and acc.peak_open_groups == 2


def test_bucket_reservation_follows_max_distinct_rewards():
    acc = StreamingGradientAccumulator(_params(), estimator=RLOOEstimator(), path="buckets", max_distinct_rewards=2)
    acc.begin_batch({"a": 4})
    acc.add_policy_grad("a", 0, _grad(0), 3, reward=1.0)
    assert acc.reserved_bytes == 3 * BUF
    acc.add_policy_grad("a", 1, _grad(1), 3, reward=0.0)
    with pytest.raises(StreamingInputError, match="max_distinct_rewards=2"):
        acc.add_policy_grad("a", 2, _grad(2), 3, reward=0.5)
    assert acc.bytes_in_use == 3 * BUF  # nothing changed


def test_budget_too_small_for_one_group_is_a_config_error():
    acc = StreamingGradientAccumulator(_params(), estimator=GRPOEstimator(), budget_bytes=2 * BUF)
    with pytest.raises(StreamingConfigError, match="cannot hold even one open group") as err:
        acc.begin_batch({"a": 4})
    assert f"at least {3 * BUF}" in str(err.value)
    assert not acc.batch_open
    bucket_acc = StreamingGradientAccumulator(_params(), estimator=GRPOEstimator(), path="buckets", budget_bytes=3 * BUF)
    with pytest.raises(StreamingConfigError, match="max_distinct_rewards"):
        bucket_acc.begin_batch({"a": 4})


def test_full_budget_makes_new_groups_wait_and_rank_ready_orders():
    acc = StreamingGradientAccumulator(_params(), estimator=GRPOEstimator(), budget_bytes=5 * BUF)
    acc.begin_batch({"a": 2, "b": 3, "c": 3, "d": 1})
    acc.add_policy_grad("a", 0, _grad(0), 2, reward=1.0)
    acc.add_policy_grad("b", 0, _grad(1), 2, reward=0.0)  # budget now full: batch + 2 x 2
    acc.report_reward("d", 0, 1.0)  # d closed before any gradient
    with pytest.raises(AccumulatorBudgetError, match="must wait|let this trajectory wait"):
        acc.add_policy_grad("c", 0, _grad(2), 2, reward=1.0)
    assert acc.open_groups == 2 and "c" not in [g for g, s in acc.ledger.groups.items() if s.trajs]
    acc.report_reward("c", 1, 0.0)
    acc.report_reward("b", 1, 1.0)
    hint = acc.rank_ready([("c", 0), ("b", 2), ("b", 1), ("d", 0), ("c", 1)])
    # closed group first, then a group holding buffers; (b, 2) has no reward yet, so it would
    # need a pending buffer that the full budget cannot hold: it waits with group c
    assert hint.run == [("d", 0), ("b", 1)]
    assert hint.wait == [("b", 2), ("c", 0), ("c", 1)]
    acc.report_reward("a", 1, 0.0)  # a closes and frees two buffers
    acc.report_reward("c", 0, 1.0)  # the failed add recorded nothing: report it now
    hint = acc.rank_ready([("c", 0), ("c", 1)])
    assert hint.run == [("c", 0), ("c", 1)] and hint.wait == []


def test_host_storage_gives_the_same_result():
    results = []
    for storage in ("device", "host"):
        acc = StreamingGradientAccumulator(_params(torch.float64), estimator=GRPOEstimator(), storage=storage)
        acc.begin_batch({"a": 3})
        for tid, r in enumerate([1.0, 0.0, 1.0]):
            acc.add_policy_grad("a", tid, _grad(tid, torch.float64), 3, reward=r)
        results.append(acc.compute_batch_gradient())
        assert not acc.buffers.pinned or torch.cuda.is_available()
    assert all(torch.equal(x, y) for x, y in zip(*results))


def _simulate(acc, sizes, order, rewards, seed):
    """Rewards known on arrival; the learner runs rank_ready's picks after each arrival."""
    acc.begin_batch(sizes)
    ready, peak = [], 0

    def learner_runs(ready):
        nonlocal peak
        while ready:  # run what may run; stop when nothing more can be admitted
            hint = acc.rank_ready(ready)
            if not hint.run:
                return ready
            for gid, tid in hint.run:
                acc.add_policy_grad(gid, tid, _grad(seed + 31 * int(gid[1:]) + tid, torch.float64), 2)
                peak = max(peak, acc.reserved_bytes)
            ready = hint.wait
        return ready

    for gid, tid in order:
        acc.report_reward(gid, tid, rewards[(gid, tid)])
        ready = learner_runs(ready + [(gid, tid)])
    assert ready == []  # all rewards are in: nothing may be left waiting (no deadlock)
    return acc.compute_batch_gradient(), peak


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=2, max_size=6),
    canonical=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_budgeted_schedules_finish_within_budget_and_stay_exact(sizes, canonical, seed):
    rng = random.Random(seed)
    group_sizes = {f"g{i}": n for i, n in enumerate(sizes)}
    items = [(g, t) for g, n in group_sizes.items() for t in range(n)]
    rewards = {it: float(rng.random() < 0.5) for it in items}
    order = items[:]
    rng.shuffle(order)
    params = _params(torch.float64)
    buf = StreamingGradientAccumulator(params, estimator=GRPOEstimator()).layout.buffer_bytes
    per_group = max(sizes) if canonical else 2
    budget = (1 + per_group) * buf  # room for exactly one open group: the tightest legal budget
    kwargs = dict(estimator=GRPOEstimator(), canonical_order=canonical)
    free, _ = _simulate(StreamingGradientAccumulator(params, **kwargs), group_sizes, order, rewards, seed)
    tight_acc = StreamingGradientAccumulator(params, budget_bytes=budget, **kwargs)
    tight, peak = _simulate(tight_acc, group_sizes, order, rewards, seed)
    assert peak <= budget and tight_acc.peak_bytes <= budget
    if canonical:
        assert all(torch.equal(x, y) for x, y in zip(free, tight))
    else:
        assert tight_acc.peak_open_groups <= 1  # 2 buffers per group: the budget holds one
        assert all(torch.allclose(x, y, rtol=1e-12, atol=1e-14) for x, y in zip(free, tight))


def test_new_groups_closest_to_closing_are_admitted_first():
    acc = StreamingGradientAccumulator(_params(), estimator=GRPOEstimator(), budget_bytes=3 * BUF)
    acc.begin_batch({"far": 4, "near": 4})
    for tid in range(3):
        acc.report_reward("near", tid, float(tid % 2))
    hint = acc.rank_ready([("far", 0), ("near", 0)])
    assert hint.run == [("near", 0)] and hint.wait == [("far", 0)]


def test_min_open_chunk_defers_small_open_chunks_only():
    acc = StreamingGradientAccumulator(_params(), estimator=GRPOEstimator())
    acc.begin_batch({"a": 4, "b": 2})
    for tid, r in enumerate([1.0, 1.0, 0.0]):
        acc.report_reward("a", tid, r)
    acc.report_reward("b", 0, 1.0)
    acc.report_reward("b", 1, 0.0)  # b is closed
    ready = [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    chunks, wait = acc.split_into_chunks(ready, 8, min_open_chunk=2)
    assert chunks == [[("b", 0), ("b", 1)], [("a", 0), ("a", 1)]]  # closed first, then a's reward-1 pair
    assert wait == [("a", 2)]
    chunks, wait = acc.split_into_chunks(ready, 8)
    assert len(chunks) == 3 and wait == []
    with pytest.raises(StreamingConfigError, match="min_open_chunk"):
        acc.split_into_chunks(ready, 8, min_open_chunk=0)
