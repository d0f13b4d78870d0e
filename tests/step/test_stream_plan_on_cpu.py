"""The stream planner: routes, fold coefficients, chunks, budget and input validation. No GPU, no Ray."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync_verl.core import StreamingInputError, StreamingStateError
from thundersync_harness.plan_ops import effective_coefficients
from thundersync_verl.step.stream_plan import BackwardOp, FoldOp, StreamPlanner, bucket_key

EPS = 1e-6


def _grpo(rewards: list[float]) -> list[float]:
    """verl's GRPO advantage for one group, by hand: (r - mean) / (unbiased std + eps)."""
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + EPS) for r in rewards]


def test_hand_computed_grpo_group_buckets_then_fold_then_direct():
    planner = StreamPlanner()
    planner.begin_batch({"g": 4})
    rewards = [1.0, 0.0, 1.0, 1.0]  # mean 0.75, unbiased std 0.5
    ops = []
    for tid, r in enumerate(rewards):
        planner.arrive("g", tid, r, num_tokens=tid + 2)
        ops += planner.next_ops()
    backward = [op for op in ops if isinstance(op, BackwardOp)]
    assert [op.dest for op in backward] == [bucket_key("g", 1.0), bucket_key("g", 0.0), bucket_key("g", 1.0), "direct"]
    assert all(op.coefs == (1.0,) for op in backward[:3])
    fold = [op for op in ops if isinstance(op, FoldOp)]
    assert len(fold) == 1 and ops.index(fold[0]) < ops.index(backward[3])  # folded as the group closes
    a_win, a_lose = 0.25 / (0.5 + EPS), -0.75 / (0.5 + EPS)
    assert fold[0].folds[bucket_key("g", 1.0)] == pytest.approx(a_win, rel=1e-6)
    assert fold[0].folds[bucket_key("g", 0.0)] == pytest.approx(a_lose, rel=1e-6)
    assert backward[3].coefs[0] == pytest.approx(a_win, rel=1e-6)  # the last member goes direct
    final = planner.finalize()
    assert final.num_tokens == 2 + 3 + 4 + 5 and final.scale == pytest.approx(1 / 14)


def test_fold_coefficients_equal_verls_grpo_advantages():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    import numpy as np

    rewards = {0: [1.0, 0.0, 0.0, 1.0], 1: [0.0, 0.0, 0.0, 1.0], 2: [1.0, 1.0, 1.0, 1.0]}
    planner = StreamPlanner()
    planner.begin_batch({g: 4 for g in rewards})
    ops = []
    for tid in range(4):  # round-robin arrivals keep every group open until its last member
        for g, rs in rewards.items():
            planner.arrive(g, tid, rs[tid], num_tokens=3)
            ops += planner.next_ops()
    coef = effective_coefficients(ops)
    flat = [(g, t, r) for g, rs in rewards.items() for t, r in enumerate(rs)]
    scores = torch.zeros(len(flat), 3)
    scores[:, -1] = torch.tensor([r for _, _, r in flat])
    adv, _ = compute_grpo_outcome_advantage(scores, torch.ones(len(flat), 3), np.array([g for g, _, _ in flat]))
    for i, (g, t, _) in enumerate(flat):
        assert coef[(g, t)] == float(adv[i, 0]), (g, t)  # bit-equal: same float32 statistics


def test_closed_group_goes_direct_in_one_chunk_without_buckets():
    planner = StreamPlanner(max_chunk_size=8)
    planner.begin_batch({0: 4})
    for tid, r in enumerate([0.0, 1.0, 1.0, 0.0]):
        planner.arrive(0, tid, r, num_tokens=5)
    ops = planner.next_ops()
    assert len(ops) == 1 and ops[0].dest == "direct" and len(ops[0].items) == 4
    adv = _grpo([0.0, 1.0, 1.0, 0.0])
    assert ops[0].coefs == pytest.approx(tuple(adv), rel=1e-6)
    assert planner.memory()["peak_open_groups"] == 0  # no bucket was ever needed


def test_same_destination_trajectories_share_a_chunk_up_to_max_size():
    planner = StreamPlanner(max_chunk_size=2)
    planner.begin_batch({0: 5, 1: 2})
    for tid in range(3):
        planner.arrive(0, tid, 1.0, num_tokens=4)  # same open group, same reward
    planner.arrive(0, 3, 0.0, num_tokens=4)
    ops = planner.next_ops()
    dests = [(op.dest, len(op.items)) for op in ops]
    assert dests == [(bucket_key(0, 1.0), 2), (bucket_key(0, 1.0), 1), (bucket_key(0, 0.0), 1)]
    assert planner.ready == []


def test_a_capped_plan_leaves_the_other_rows_to_go_direct_once_their_group_closes():
    """``max_backwards``: only the best-ranked chunks are planned; an open group's rows left over are planned
    later, direct and in one chunk with the other rows, once their group has closed (no bucket, no fold)."""
    planner = StreamPlanner(max_chunk_size=8)
    planner.begin_batch({0: 2, 1: 2, 2: 2})
    for gid in (0, 1):
        planner.arrive(gid, 0, 1.0, num_tokens=3)
        planner.arrive(gid, 1, 0.0, num_tokens=3)  # groups 0 and 1 closed
    planner.arrive(2, 0, 1.0, num_tokens=3)  # group 2 open
    ops = planner.next_ops(max_backwards=1)
    assert [(op.dest, len(op.items)) for op in ops] == [("direct", 4)]  # closed groups first
    assert planner.ready_count == 1 and planner.held_count == 0  # left by the cap, not by the memory budget
    planner.arrive(2, 1, 0.0, num_tokens=3)
    ops = planner.next_ops(max_backwards=1)
    assert [(op.dest, len(op.items)) for op in ops] == [("direct", 2)] and planner.ready_count == 0
    assert planner.memory()["peak_open_groups"] == 0  # group 2's early row never needed a bucket
    planner.finalize()
    uncapped = StreamPlanner(max_chunk_size=8)  # the control: planned at once, the open row takes a bucket
    uncapped.begin_batch({0: 2, 1: 2, 2: 2})
    for gid in (0, 1):
        uncapped.arrive(gid, 0, 1.0, num_tokens=3)
        uncapped.arrive(gid, 1, 0.0, num_tokens=3)
    uncapped.arrive(2, 0, 1.0, num_tokens=3)
    assert [op.dest for op in uncapped.next_ops()] == ["direct", bucket_key(2, 1.0)]
    with pytest.raises(ValueError, match="max_backwards must be >= 0"):
        uncapped.next_ops(max_backwards=-1)


def test_memory_budget_makes_a_new_group_wait_until_one_closes():
    # grad_numel=1 float32 -> 4-byte buffers; batch buffer + 2 buckets (one binary group) = 12 bytes
    planner = StreamPlanner(grad_numel=1, budget_bytes=12, max_distinct_rewards=2)
    planner.begin_batch({0: 2, 1: 2})
    planner.arrive(0, 0, 1.0, num_tokens=1)
    planner.arrive(1, 0, 0.0, num_tokens=1)
    hint = planner.rank_ready()
    assert hint.run == [(0, 0)] and hint.wait == [(1, 0)]
    ops = planner.next_ops()
    assert [op.items for op in ops] == [((0, 0),)] and planner.ready == [(1, 0)]
    planner.arrive(0, 1, 0.0, num_tokens=1)  # group 0 closes: its fold frees the budget
    ops = planner.next_ops()
    assert isinstance(ops[0], FoldOp) and {op.items for op in ops[1:]} == {((0, 1),), ((1, 0),)}
    assert planner.memory()["peak_bytes"] <= 12


@pytest.mark.parametrize(
    "mode, expected",
    [("token-mean", 1 / 9), ("token-sum", 1.0), ("seq-mean-token-sum", 1 / 3), ("seq-mean-token-mean", 1 / 3)],
)
def test_final_scale_is_the_deferred_normaliser(mode, expected):
    planner = StreamPlanner(loss_agg_mode=mode)
    planner.begin_batch({0: 3})
    for tid, (r, n) in enumerate([(1.0, 2), (0.0, 3), (1.0, 4)]):
        planner.arrive(0, tid, r, num_tokens=n)
    planner.next_ops()
    assert planner.finalize().scale == pytest.approx(expected)


def _must_raise(exc_type, match: str, fn, *args, **kwargs):
    with pytest.raises(exc_type, match=match) as info:
        fn(*args, **kwargs)
    assert "why:" in str(info.value) and "fix:" in str(info.value)


def test_invalid_arrivals_are_refused_and_leave_the_planner_unchanged():
    planner = StreamPlanner()
    _must_raise(StreamingStateError, "no batch is open", planner.arrive, 0, 0, 1.0, 3)
    planner.begin_batch({0: 2})
    planner.arrive(0, 0, 1.0, num_tokens=3)
    _must_raise(StreamingInputError, "arrived twice", planner.arrive, 0, 0, 1.0, 3)
    _must_raise(StreamingInputError, "not part of the current batch", planner.arrive, 9, 0, 1.0, 3)
    _must_raise(StreamingInputError, "finite number", planner.arrive, 0, 1, float("nan"), 3)
    _must_raise(StreamingInputError, "non-negative int", planner.arrive, 0, 1, 1.0, -1)
    planner.arrive(0, 1, 0.0, num_tokens=2)
    _must_raise(StreamingInputError, "one more than its declared size", planner.arrive, 0, 2, 1.0, 3)
    assert planner.ready == [(0, 0), (0, 1)]  # the refused calls left no trace
    ops = planner.next_ops()
    assert sum(len(op.items) for op in ops if isinstance(op, BackwardOp)) == 2
    assert planner.finalize().num_tokens == 5


def test_finalize_refuses_an_open_group_or_unplanned_trajectories():
    planner = StreamPlanner()
    planner.begin_batch({0: 2})
    planner.arrive(0, 0, 1.0, num_tokens=3)
    _must_raise(StreamingStateError, "finalize refused", planner.finalize)
    planner.arrive(0, 1, 0.0, num_tokens=3)
    _must_raise(StreamingStateError, "finalize refused", planner.finalize)  # ready, not yet planned
    planner.next_ops()
    assert planner.finalize().scale == pytest.approx(1 / 6)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), every=st.integers(1, 5), max_chunk=st.integers(1, 6))
def test_any_arrival_order_and_chunking_gives_every_trajectory_its_advantage(seed, every, max_chunk):
    rng = random.Random(seed)
    sizes = {g: rng.randint(1, 5) for g in range(rng.randint(1, 4))}
    rewards = {(g, t): float(rng.choice([0.0, 1.0, 0.5])) for g, n in sizes.items() for t in range(n)}
    arrival = list(rewards)
    rng.shuffle(arrival)
    planner = StreamPlanner(max_chunk_size=max_chunk)
    planner.begin_batch(sizes)
    ops = []
    for k, (g, t) in enumerate(arrival):
        planner.arrive(g, t, rewards[(g, t)], num_tokens=1 + (t % 3))
        if (k + 1) % every == 0:
            ops += planner.next_ops()
    ops += planner.next_ops()
    coef = effective_coefficients(ops)
    for g, n in sizes.items():
        group = [rewards[(g, t)] for t in range(n)]
        adv = [group[0] / (1 + EPS)] if n == 1 else _grpo(group)  # verl: a group of one has mean 0, std 1
        for t in range(n):
            assert coef[(g, t)] == pytest.approx(adv[t], rel=1e-5, abs=1e-6)
    assert all(len(op.items) <= max_chunk for op in ops if isinstance(op, BackwardOp))
    planner.finalize()
