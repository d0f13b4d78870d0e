"""The rollout hosts' CPU bound (sim/host.py) in the barrier schedules and the tail policy (CPU, seconds)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from test_sim_tail_on_cpu import COSTS, ROLL, WORK, tail_run
from thundersync_verl.sim.events import place_rollouts, reward_times
from thundersync_verl.sim.host import HostCpu, bound_round, stretch, turn_starts
from thundersync_verl.sim.sim_engine import SimConfig, simulate
from thundersync_verl.sim.workload import SyntheticSource


def _batch():
    return SyntheticSource(WORK, ROLL, seed=3).batch(0)


def test_the_constant_is_cpu_per_turn_and_the_bound_is_its_turns_over_the_cores():
    host = HostCpu.fit(cpu_s_per_step=8.0, turns_per_step=200, cores=2)
    assert host.cpu_s_per_turn == pytest.approx(0.04)
    assert host.stretch_factor(turns=100, span_s=4.0) == 1.0  # 2 CPU-s on 2 cores fit in 4 s
    assert host.stretch_factor(turns=400, span_s=4.0) == pytest.approx(2.0)  # 8 s of work for 2 cores in 4 s
    for bad in ({"cpu_s_per_turn": -1.0}, {"cpu_s_per_turn": 0.1, "cores": 0}):
        with pytest.raises(ValueError, match="CPU-seconds per turn must be >= 0 and the host cores > 0"):
            HostCpu(**bad)
    with pytest.raises(ValueError, match="no turns"):
        HostCpu.fit(8.0, 0, 1)


def test_turns_start_back_to_back_from_their_trajectory_start():
    batch = _batch()
    place = place_rollouts(batch.dur_s, 5.0, 8)  # fewer slots than trajectories: later starts
    starts = turn_starts(batch, place)
    first = batch.turn_ptr[:-1]
    np.testing.assert_allclose(starts[first], place.start)  # each trajectory's first turn at its start
    ends = starts + batch.turn_gen_s + batch.turn_tool_s  # each turn ends where the next starts
    np.testing.assert_allclose(ends[batch.turn_ptr[1:] - 1], place.done)


def test_a_round_the_host_keeps_up_with_is_unchanged_and_a_busier_one_is_stretched_uniformly():
    batch = _batch()
    place = place_rollouts(batch.dur_s, 0.0, 8)
    end = float(reward_times(batch, place, "grpo").max())
    same = bound_round(HostCpu(0.0), batch, place, 0.0, end, 8)
    assert same[0] is batch and same[1] is place and same[2] == 1.0
    turns = int(batch.n_turns.sum())
    host = HostCpu(cpu_s_per_turn=3 * end / turns)  # three times the round's span of CPU work on one core
    wide, wide_place, factor = bound_round(host, batch, place, 0.0, end, 8)
    assert factor == pytest.approx(3.0)
    np.testing.assert_allclose(wide.dur_s, 3 * batch.dur_s)
    np.testing.assert_allclose(wide.reward_s, 3 * batch.reward_s)
    np.testing.assert_allclose(wide_place.start, 3 * place.start)  # the slots' schedule scaled, order kept
    assert float(reward_times(wide, wide_place, "grpo").max()) == pytest.approx(3 * end)
    assert stretch(batch, 1.0).dur_s.tolist() == batch.dur_s.tolist()


def test_the_barrier_step_is_at_least_its_turns_on_the_host_and_a_free_host_changes_nothing():
    src = SyntheticSource(WORK, ROLL, seed=5)
    cfg = SimConfig("thundersync", steps=4, rollout_slots=ROLL.slots)
    plain = simulate(cfg, src, COSTS)
    free = simulate(replace(cfg, host=HostCpu(0.0)), src, COSTS)
    np.testing.assert_array_equal(free.step_times, plain.step_times)
    per_turn = 0.05
    bound = simulate(replace(cfg, host=HostCpu(per_turn)), src, COSTS)
    for k, (t_plain, t_host) in enumerate(zip(plain.step_times, bound.step_times)):
        turns = int(src.batch(k).n_turns.sum())
        assert t_host >= per_turn * turns  # the rollout phase alone lasts the host's CPU work
        assert t_host >= t_plain - 1e-9


def test_the_tail_policy_keeps_the_same_groups_later_when_the_host_bounds_its_rounds():
    plain, _ = tail_run(1.5, 2, "dedicated")
    bound, _ = tail_run(1.5, 2, "dedicated", host=HostCpu(0.05))
    for a, b in zip(plain.extra["tail_log"], bound.extra["tail_log"]):
        assert a["trained"].tolist() == b["trained"].tolist()  # a uniform stretch keeps who completes first
    assert np.all(np.asarray(bound.step_times) >= np.asarray(plain.step_times) - 1e-9)
    ratio = np.asarray(bound.step_times) / np.asarray(plain.step_times)
    queued = np.asarray([e["queued_round"] for e in plain.extra["tail_log"]])
    assert queued.any() and (~queued).any() and ratio.max() > 1.1
    assert ratio[queued].mean() > ratio[~queued].mean()  # the rounds of queued long prompts run the most turns


@pytest.mark.parametrize("mode,extra", [("async", {}), ("fully_async", {}),
                                        ("thundersync", {"verify_overlap": True})])
def test_schedules_without_the_bound_refuse_it(mode, extra):
    cfg = SimConfig(mode, steps=4, host=HostCpu(0.01), **extra)
    with pytest.raises(ValueError, match="host CPU bound"):
        simulate(cfg, SyntheticSource(WORK, ROLL, seed=5), COSTS)
