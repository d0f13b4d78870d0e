"""ThunderSync with verify overlap: hand-computed lanes, second-backward counts, bounds, invariants (CPU, < 60 s)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from thundersync_verl.sim.dists import const, lognormal
from thundersync_verl.sim.sim_engine import SimConfig, simulate
from thundersync_verl.sim.hardware import LearnerCosts
from thundersync_verl.sim.lane import LanePolicy, LaneWork, run_lane
from thundersync_verl.sim.sim_verifier import SWE_VERIFIER, VerifiedSource, VerifierSpec, draw_verifier, scaled
from thundersync_verl.sim.verify_overlap import VERIFY_OVERLAP_MODE, VerifyWork, run_verify_lane
from thundersync_verl.sim.workload import RolloutSpec, SyntheticSource, WorkloadSpec

WORK = WorkloadSpec(groups_per_step=6, group_size=4, turns=lognormal(5, 0.9), max_turns=30, max_context=20_000,
                    prompt_tokens=const(300), gen_tokens=lognormal(80, 0.5), obs_tokens=lognormal(120, 0.8),
                    tool_s=lognormal(0.4, 0.8), reward_s=lognormal(1.5, 0.4))
ROLL = RolloutSpec(slots=24, decode_s_per_token=0.01, prefill_s_per_token=1e-4)
COSTS = LearnerCosts(s_per_token=1e-3, s_per_token_sq=2e-9, chunk_overhead_s=0.05, optimizer_s=0.5, weight_sync_s=0.8)
STEPS = 10
FREE = LanePolicy(min_chunk=1)  # dp 1, no chunk overhead, no budget


def source(latency=lognormal(6.0, 0.8), pass_rate=0.5, seed=0, work=WORK, **spec):
    return VerifiedSource(SyntheticSource(work, ROLL, seed=seed), VerifierSpec(latency, pass_rate=pass_rate, **spec),
                          seed=seed)


def run(src, costs=COSTS, verify_overlap=True, mode="thundersync", **kw):
    cfg = SimConfig(mode=mode, steps=STEPS, rollout_slots=ROLL.slots, gpus=4, verify_overlap=verify_overlap, **kw)
    return simulate(cfg, src, costs)


def one_group(land, passed, done=None, cost=None):
    n = len(land)
    done = np.zeros(n) if done is None else np.asarray(done, dtype=float)
    cost = np.ones(n) if cost is None else np.asarray(cost, dtype=float)
    return VerifyWork(done, np.asarray(land, dtype=float), np.asarray(passed, dtype=bool), np.zeros(n, dtype=np.int64),
                      cost, np.full(n, 10, dtype=np.int64), 1)


def plain_finish(work: VerifyWork, policy: LanePolicy) -> float:
    return plain_run(work, policy).finish


def plain_run(work: VerifyWork, policy: LanePolicy):
    lane = LaneWork(work.land, work.group, work.close(), work.cost, work.tokens)
    return run_lane(lane, policy, 0.0, fast=False)


# ------------------------------------------------------------------ hand-computed lanes
def test_one_group_hand_computed():
    # 4 trajectories complete at t=0 (1 s of backward each), all rewards land at t=10, one pass.
    work = one_group([10, 10, 10, 10], [True, False, False, False])
    run, stats = run_verify_lane(work, FREE, 0.0)
    # early: 0..4 (the lane would idle otherwise); at 10 the passes are the smaller class: one second backward
    assert run.finish == pytest.approx(11.0)
    assert plain_finish(work, FREE) == pytest.approx(14.0)
    assert (stats.early, stats.late, stats.second) == (4, 0, 1)
    assert stats.second_lane_s == pytest.approx(1.0)


def test_the_decision_comes_before_the_last_reward():
    # One pass lands at t=1, three fails at t=2, 3, 4, two rewards are still out until t=100. At t=4
    # a + u = 1 + 2 <= b = 3: the passes are the smaller class whatever the last two say, so the landed
    # pass is backpropagated again at t=4, and the pass landing at t=100 right after it lands.
    work = one_group([1, 2, 3, 4, 100, 100], [True, False, False, False, True, False], cost=[0.5] * 6)
    run, stats = run_verify_lane(work, FREE, 0.0)
    starts = [c[0] for c in run.chunks]
    assert starts[0] == 0.0 and run.chunks[0][2] == 6  # all six early, 0..3
    assert 4.0 in starts  # the second backward of trajectory 0 starts as soon as the class is fixed
    assert stats.second == 2  # trajectory 0 at t=4, trajectory 4 when it lands at t=100
    assert run.finish == pytest.approx(100.5)


def test_zero_latency_lane_is_plain_thundersync():
    rng = np.random.default_rng(0)
    done = rng.uniform(0, 10, 12)
    group = np.repeat(np.arange(3), 4)
    work = VerifyWork(done, done.copy(), rng.random(12) < 0.5, group, rng.uniform(0.1, 1, 12),
                      np.ones(12, dtype=np.int64), 3)
    for policy in (FREE, LanePolicy(min_chunk=1, budget_groups=1, chunk_overhead_s=0.05)):
        run, stats = run_verify_lane(work, policy, 0.0)
        assert (stats.early, stats.second) == (0, 0)
        assert run.finish == pytest.approx(plain_finish(work, policy), rel=1e-12)


# ------------------------------------------------------------------ counts and bounds (random lanes)
def random_work(seed: int, n_groups: int, size: int, latency: float, p: float) -> VerifyWork:
    rng = np.random.default_rng(seed)
    n = n_groups * size
    done = rng.uniform(0, 10, n)
    land = done + latency * rng.lognormal(0.0, 1.0, n)
    return VerifyWork(done, land, rng.random(n) < p, np.repeat(np.arange(n_groups), size),
                      rng.uniform(0.05, 1.0, n), rng.integers(1, 100, n), n_groups)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), latency=st.sampled_from([0.1, 1.0, 10.0]), p=st.sampled_from([0.1, 0.5, 0.9]),
       budget=st.sampled_from([None, 1, 3]))
def test_second_backwards_are_the_smaller_early_class(seed, latency, p, budget):
    work = random_work(seed, 5, 4, latency, p)
    run, stats = run_verify_lane(work, LanePolicy(min_chunk=1, budget_groups=budget), 0.0)
    assert np.array_equal(stats.second_by_group, np.minimum(stats.early_passed, stats.early_failed))
    assert stats.early + stats.late == 20 and run.tokens == int(work.tokens.sum())
    if budget is not None:
        assert run.peak_open_groups <= budget


def test_all_early_gives_min_passes_fails_per_group():
    work = random_work(7, 6, 8, 0.0, 0.3)
    work.land = work.done + 1e4  # every reward lands after every first backward
    _, stats = run_verify_lane(work, FREE, 0.0)
    passes = np.bincount(work.group[work.passed], minlength=6)
    assert stats.early == 48
    assert np.array_equal(stats.second_by_group, np.minimum(passes, 8 - passes))


def test_general_rewards_backpropagate_every_early_trajectory_again():
    work = random_work(11, 4, 4, 3.0, 0.5)
    work.rewards = "general"
    run, stats = run_verify_lane(work, FREE, 0.0)
    _, binary = run_verify_lane(random_work(11, 4, 4, 3.0, 0.5), FREE, 0.0)
    assert stats.early > 0 and stats.second == stats.early
    assert stats.second > binary.second


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), latency=st.sampled_from([0.3, 3.0, 30.0]), p=st.sampled_from([0.1, 0.5]),
       overhead=st.sampled_from([0.0, 0.05]))
@example(seed=272, latency=0.3, p=0.1, overhead=0.05)  # two early backwards cut the rows into two more chunks
def test_never_slower_than_thundersync_by_more_than_its_second_backwards(seed, latency, p, overhead):
    """Slower only by the second backwards and by the chunk overheads of the extra chunks early backwards make."""
    work = random_work(seed, 4, 4, latency, p)
    policy = LanePolicy(min_chunk=1, chunk_overhead_s=overhead)
    run, stats = run_verify_lane(work, policy, 0.0)
    plain = plain_run(work, policy)
    assert run.finish <= plain.finish + stats.second_lane_s + max(0.0, run.overhead_s - plain.overhead_s) + 1e-9
    if overhead == 0.0:
        assert run.finish <= plain.finish + stats.second_lane_s + 1e-9


# ------------------------------------------------------------------ whole runs
def test_zero_latency_verifier_gives_no_gain():
    src = source(latency=const(0.0))
    plain, vo = run(src, verify_overlap=False), run(src)
    assert np.allclose(vo.step_end, plain.step_end, rtol=0, atol=1e-9)
    assert vo.extra["early_backwards"].sum() == 0 and vo.extra["second_backwards"].sum() == 0


def test_slow_verifier_gains_and_counts_what_it_pays():
    src = source(latency=const(30.0), pass_rate=0.2)
    plain, vo = run(src, verify_overlap=False), run(src)
    assert vo.mode == VERIFY_OVERLAP_MODE
    assert vo.step_time_s < plain.step_time_s
    assert np.all(vo.extra["second_backwards"] <= vo.extra["min_class"])
    assert vo.extra["second_backwards"].sum() > 0
    assert vo.compute_tokens > vo.tokens_trained  # the second backwards are extra compute


@pytest.mark.parametrize("latency", [const(0.0), lognormal(2.0, 0.5), const(30.0), scaled(SWE_VERIFIER, 0.1)])
def test_invariants_of_the_other_modes_hold(latency):
    src = source(latency=latency)
    res = run(src)
    assert res.staleness_summary()["max"] == 0  # same barrier as ThunderSync: zero staleness
    expected = sum(int(src.batch(k).seq_tokens.sum()) for k in range(STEPS))
    assert res.tokens_trained == res.tokens_generated == expected
    led = res.ledger
    assert sum(led.learner.values()) == pytest.approx(led.window_s, rel=1e-9)
    assert sum(led.rollout.values()) == pytest.approx(led.slots * led.window_s, rel=1e-9)
    assert all(v >= -1e-9 for v in list(led.learner.values()) + list(led.rollout.values()))
    for k in range(STEPS):
        b = src.batch(k)
        assert res.step_times[k] >= (b.dur_s + b.reward_s).max() + COSTS.optimizer_s + COSTS.weight_sync_s - 1e-9
        assert res.step_times[k] >= res.extra["step_lower_bound_s"][k] - 1e-9


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), p=st.sampled_from([0.1, 0.5]), scale=st.sampled_from([0.3, 3.0]))
def test_never_slower_than_sync_without_chunk_overhead(seed, p, scale):
    src = source(latency=lognormal(6.0 * scale, 0.8), pass_rate=p, seed=seed)
    costs = replace(COSTS, chunk_overhead_s=0.0)
    sync = run(src, costs, verify_overlap=False, mode="sync")
    vo = run(src, costs, min_chunk=1)
    assert np.all(vo.step_times <= sync.step_times + 1e-9)


def test_memory_is_three_buffers_per_open_group_and_the_budget_holds():
    src = source(latency=const(20.0))
    free = run(src, bytes_per_buffer=1e9)
    capped = run(src, budget_groups=1, bytes_per_buffer=1e9)
    assert capped.peak_open_groups <= 1 < free.peak_open_groups
    assert capped.accum_peak_bytes_per_rank == pytest.approx(4e9)  # 3k + 1 buffers
    assert free.accum_peak_bytes_per_rank == pytest.approx((3 * free.peak_open_groups + 1) * 1e9)
    assert capped.step_time_s >= free.step_time_s - 1e-9


def test_same_seed_same_result():
    a, b = run(source(seed=3)), run(source(seed=3))
    assert np.array_equal(a.step_end, b.step_end)


def test_config_errors_state_the_rule():
    src = source()
    with pytest.raises(ValueError, match="ThunderSync GRPO policy"):
        run(src, mode="sync")
    with pytest.raises(ValueError, match="ThunderSync GRPO policy"):
        run(src, granularity="group")
    with pytest.raises(ValueError, match="verify_rewards"):
        run(src, verify_rewards="ternary")
    with pytest.raises(ValueError, match="VerifiedSource"):
        run(SyntheticSource(WORK, ROLL))


# ------------------------------------------------------------------ the verifier model
def test_verified_source_keeps_the_rollouts_and_draws_the_outcomes():
    base = SyntheticSource(WORK, ROLL, seed=1)
    a, b = VerifiedSource(base, VerifierSpec(pass_rate=0.3), seed=1), VerifiedSource(base, VerifierSpec(), seed=1)
    for k in range(3):
        assert np.array_equal(a.batch(k).dur_s, base.batch(k).dur_s)
        assert np.array_equal(a.batch(k).seq_tokens, b.batch(k).seq_tokens)
        assert np.array_equal(a.batch(k).reward_s, b.batch(k).reward_s)  # latency does not depend on the pass rate
    rng = np.random.default_rng(0)
    group = np.repeat(np.arange(2000), 8)
    _, passed = draw_verifier(rng, group, 2000, VerifierSpec(pass_rate=0.3))
    assert passed.mean() == pytest.approx(0.3, abs=0.01)
    _, clustered = draw_verifier(rng, group, 2000, VerifierSpec(pass_rate=0.3, pass_icc=0.5))
    all_same = lambda x: np.mean([(x[group == g].all() or not x[group == g].any()) for g in range(500)])  # noqa: E731
    assert clustered.mean() == pytest.approx(0.3, abs=0.03)
    assert all_same(clustered) > all_same(passed) + 0.2  # hard and easy prompts: whole groups pass or fail


def test_scaled_verifier_keeps_its_shape():
    base = SWE_VERIFIER.with_cap(None)
    assert scaled(base, 3.0).mean() == pytest.approx(3.0 * base.mean(), rel=1e-6)
    assert scaled(SWE_VERIFIER, 0.0).mean() == 0.0
    assert scaled(SWE_VERIFIER, 100.0).quantile(np.array([0.999]))[0] <= SWE_VERIFIER.cap  # the timeout holds
    with pytest.raises(ValueError, match=">= 0"):
        scaled(SWE_VERIFIER, -1.0)
