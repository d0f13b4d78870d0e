"""Batches and the learner lane (CPU, no GPU, < 15 s)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync_verl.sim.dists import const, lognormal
from thundersync_verl.sim.lane import IDLE_BUDGET, LanePolicy, LaneWork, run_lane
from thundersync_verl.sim.workload import RolloutSpec, SyntheticSource, WorkloadSpec

WORK = WorkloadSpec(groups_per_step=8, group_size=4, turns=lognormal(6, 0.8), max_turns=20, max_context=3000,
                    prompt_tokens=const(200), gen_tokens=lognormal(60, 0.5), obs_tokens=lognormal(80, 0.8),
                    tool_s=lognormal(0.5, 0.8), reward_s=lognormal(1.0, 0.3))
ROLL = RolloutSpec(slots=32, decode_s_per_token=0.01, prefill_s_per_token=1e-4)


def test_batches_are_deterministic_per_seed_and_index():
    a, b = SyntheticSource(WORK, ROLL, seed=1), SyntheticSource(WORK, ROLL, seed=1)
    assert np.array_equal(a.batch(3).dur_s, b.batch(3).dur_s)
    assert not np.array_equal(a.batch(3).dur_s, a.batch(4).dur_s)
    assert not np.array_equal(a.batch(3).dur_s, SyntheticSource(WORK, ROLL, seed=2).batch(3).dur_s)


def test_turn_structure_is_consistent():
    batch = SyntheticSource(WORK, ROLL, seed=0).batch(0)
    ptr = batch.turn_ptr
    assert batch.n_turns.max() <= WORK.max_turns
    assert np.all(batch.seq_tokens <= WORK.max_context)
    assert np.array_equal(batch.turn_hi[ptr[1:] - 1], batch.seq_tokens)  # the last turn ends the sequence
    inner = np.setdiff1d(np.arange(1, ptr[-1]), ptr[:-1])
    assert np.array_equal(batch.turn_lo[inner], batch.turn_hi[inner - 1])  # turns tile the sequence
    assert np.all(batch.turn_tool_s[ptr[1:] - 1] == 0)  # no tool call after the last turn
    slot = np.add.reduceat(batch.turn_gen_s + batch.turn_tool_s, ptr[:-1])
    assert np.allclose(slot, batch.dur_s)
    assert np.allclose(batch.turn_end_s[ptr[1:] - 1], batch.dur_s)


def test_aggregate_detail_matches_full_detail_on_average():
    big = replace(WORK, groups_per_step=256, max_context=100_000)
    full = SyntheticSource(big, ROLL, seed=0)
    agg = SyntheticSource(replace(big, detail="aggregate"), ROLL, seed=0)
    f = np.concatenate([full.batch(k).dur_s for k in range(4)])
    g = np.concatenate([agg.batch(k).dur_s for k in range(4)])
    assert abs(f.mean() / g.mean() - 1) < 0.03
    ft = np.concatenate([full.batch(k).seq_tokens for k in range(4)])
    gt = np.concatenate([agg.batch(k).seq_tokens for k in range(4)])
    assert abs(ft.mean() / gt.mean() - 1) < 0.03


def _work(rng, n_groups, size):
    ready = rng.uniform(0, 10, n_groups * size)
    group = np.repeat(np.arange(n_groups), size)
    close = np.full(n_groups, -np.inf)
    np.maximum.at(close, group, ready)
    cost = rng.uniform(0.01, 1.0, len(ready))
    return LaneWork(ready, group, close, cost, rng.integers(1, 100, len(ready)))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), dp=st.integers(1, 4), min_chunk=st.integers(1, 6),
       overhead=st.sampled_from([0.0, 0.05]))
def test_vectorised_lane_equals_general_lane(seed, dp, min_chunk, overhead):
    work = _work(np.random.default_rng(seed), 5, 4)
    pol = LanePolicy(dp=dp, chunk_overhead_s=overhead, min_chunk=min_chunk)
    fast, slow = run_lane(work, pol, 1.0), run_lane(work, pol, 1.0, fast=False)
    assert fast.finish == pytest.approx(slow.finish, rel=1e-12)
    assert fast.peak_open_groups == slow.peak_open_groups
    assert [c[2] for c in fast.chunks] == [c[2] for c in slow.chunks]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(0, 4))
def test_budget_caps_open_groups_and_tokens_are_conserved(seed, budget):
    work = _work(np.random.default_rng(seed), 6, 3)
    run = run_lane(work, LanePolicy(budget_groups=budget, min_chunk=1), 0.0)
    assert run.peak_open_groups <= budget
    assert run.tokens == int(work.tokens.sum()) and run.units == work.size
    # work-conserving bounds (dp = 1, no overhead): no unit before it is ready, all done by the end
    assert run.finish >= work.ready.max() + work.cost[np.argmax(work.ready)] - 1e-9
    assert run.finish <= work.close.max() + work.cost.sum() + 1e-9


def test_closed_groups_go_first_and_budget_blocks_new_groups():
    # group 0 opens at t=0; group 1 is ready at t=0.1 but the budget (1) blocks it until group 0 closes at t=5
    ready = np.array([0.0, 5.0, 0.1, 0.2])
    group = np.array([0, 0, 1, 1])
    close = np.array([5.0, 0.2])
    work = LaneWork(ready, group, close, np.full(4, 0.01), np.ones(4, dtype=np.int64))
    run = run_lane(work, LanePolicy(budget_groups=1, min_chunk=1), 0.0)
    # group 1 closes at 0.2 (all its rewards are in) so it needs no buffer and is trained right away
    assert run.chunks[1][0] == pytest.approx(0.2) and run.peak_open_groups == 1
    work2 = LaneWork(ready, group, np.array([5.0, 6.0]), np.full(4, 0.01), np.ones(4, dtype=np.int64))
    run2 = run_lane(work2, LanePolicy(budget_groups=1, min_chunk=1), 0.0)
    assert run2.idle[IDLE_BUDGET] > 4.0  # group 1 waited for group 0 to close
    assert run2.peak_open_groups == 1


def test_recomputed_turns_of_one_trajectory_in_one_chunk_run_as_its_latest_prefix():
    """Lane point 6: turns 0 and 1 of trajectory 7 and turn 0 of trajectory 8 are ready together: two rows, trajectory 7's
    at its latest prefix (100 tokens, 1 s); turn 2 of trajectory 7, ready later, is a row of its own (150 tokens)."""
    ready = np.array([0.0, 0.0, 0.0, 5.0])
    row, prefix = np.array([7, 7, 8, 7]), np.array([60, 100, 40, 150])
    cost = prefix / 100.0  # a prefix recomputed: cost follows its length
    none = np.full(4, -1)
    work = LaneWork(ready, none, np.zeros(0), cost, np.array([60, 40, 40, 50]), row=row, computed=prefix)
    run = run_lane(work, LanePolicy(min_chunk=1), 0.0)
    assert [c[2] for c in run.chunks] == [3, 1]  # every turn trained, in two chunks
    assert run.chunks[0][1] == pytest.approx(1.0 + 0.4) and run.tokens == 190  # trajectory 7's turn 0 rides in turn 1's row
    assert run.computed_tokens == 100 + 40 + 150
    alone = run_lane(LaneWork(ready, none, np.zeros(0), cost, np.array([60, 40, 40, 50])), LanePolicy(min_chunk=1), 0.0)
    assert alone.chunks[0][1] == pytest.approx(0.6 + 1.0 + 0.4) and alone.computed_tokens is None  # no rows: one per unit
