"""Rollout and learner on shared cores (processor sharing): the co-simulation's invariants (CPU, < 20 s)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from thundersync_verl.sim.dists import const, lognormal
from thundersync_verl.sim.sim_engine import SimConfig, simulate
from thundersync_verl.sim.hardware import LearnerCosts, SharedCores
from thundersync_verl.sim.workload import RolloutSpec, SyntheticSource, WorkloadSpec

WORK = WorkloadSpec(groups_per_step=4, group_size=4, turns=lognormal(4, 0.7), max_turns=20, max_context=20_000,
                    prompt_tokens=const(200), gen_tokens=lognormal(60, 0.5), obs_tokens=lognormal(80, 0.8),
                    tool_s=lognormal(0.3, 0.8), reward_s=lognormal(0.8, 0.4))
ROLL = RolloutSpec(slots=16, decode_s_per_token=0.01, prefill_s_per_token=1e-4, teacher_fixed_s=0.2,
                   teacher_s_per_token=1e-4)
COSTS = LearnerCosts(s_per_token=2e-3, chunk_overhead_s=0.05, optimizer_s=0.3, weight_sync_s=0.4, step_overhead_s=0.1,
                     step_gap_s=0.2)
OFF = SharedCores(1.0 + 1e-12, 1.0 + 1e-12)  # takes the shared-cores code path, no slowdown to speak of
STEPS = 6


def run(mode, algo="grpo", shared=None, slots=16, costs=COSTS, work=WORK, **kw):
    cfg = SimConfig(mode=mode, algo=algo, steps=STEPS, rollout_slots=slots, shared_cores=shared, **kw)
    return simulate(cfg, SyntheticSource(work, ROLL, seed=1), costs)


def test_processor_sharing_factors_from_cores_and_threads():
    assert SharedCores.from_threads(2, 1, 1) == SharedCores(1.0, 1.0)  # both fit: nobody slows down
    both = SharedCores.from_threads(2, 1, 2)  # 3 threads on 2 cores, each thread gets 2/3 of a core
    assert both.rollout_slowdown == pytest.approx(1.5) and both.learner_slowdown == pytest.approx(1.5)
    over = SharedCores.from_threads(2, 1, 4)  # the learner alone already oversubscribes the cores
    assert over.rollout_slowdown == pytest.approx(2.5) and over.learner_slowdown == pytest.approx(1.25)
    assert not SharedCores().active and both.active
    with pytest.raises(ValueError, match="never makes anything faster"):
        SharedCores(0.9, 1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        SharedCores.from_threads(0, 1, 1)


CASES = [("sync", "grpo", {}), ("thundersync", "grpo", {}), ("thundersync", "grpo", {"granularity": "group"}),
         ("thundersync", "grpo", {"budget_groups": 1, "max_chunk": 2}), ("thundersync", "grpo", {"min_chunk": 3}),
         ("async", "grpo", {}), ("fully_async", "grpo", {}), ("sync", "opd", {}), ("thundersync", "opd", {}),
         ("fully_async", "opd", {})]


@pytest.mark.parametrize("slots", [16, 5])
@pytest.mark.parametrize("mode,algo,kw", CASES)
def test_shared_path_without_slowdown_equals_the_engine(mode, algo, kw, slots):
    plain = run(mode, algo, None, slots, **kw)
    shared = run(mode, algo, OFF, slots, **kw)
    assert np.allclose(shared.step_end, plain.step_end, rtol=1e-9, atol=1e-9)
    assert shared.tokens_trained == plain.tokens_trained
    assert shared.peak_open_groups == plain.peak_open_groups
    assert sum(shared.ledger.learner.values()) == pytest.approx(shared.ledger.window_s, rel=1e-9)


def test_opd_forward_units_on_the_shared_path():
    costs = replace(COSTS, forward_s_per_token=5e-4, forward_overhead_s=0.03)
    plain = run("thundersync", "opd", None, costs=costs)
    assert plain.step_time_s > run("thundersync", "opd", None).step_time_s  # the forwards cost time
    assert np.allclose(run("thundersync", "opd", OFF, costs=costs).step_end, plain.step_end, rtol=1e-9)


def test_sync_never_overlaps_so_sharing_does_not_change_it():
    base = run("sync")
    for s in (1.5, 3.0):
        assert run("sync", shared=SharedCores(s, s)).step_time_s == pytest.approx(base.step_time_s, rel=1e-9)


@pytest.mark.parametrize("mode,algo", [("thundersync", "grpo"), ("async", "grpo"), ("fully_async", "grpo"),
                                       ("thundersync", "opd"), ("fully_async", "opd")])
def test_overlapping_modes_slow_down_as_the_cores_get_more_contended(mode, algo):
    times = [run(mode, algo, SharedCores(s, s)).step_time_s for s in (1.0 + 1e-12, 1.3, 2.0, 3.0)]
    assert all(b >= a - 1e-9 for a, b in zip(times, times[1:]))
    assert times[-1] > times[0]
    res = run(mode, algo, SharedCores(2.0, 1.5))
    led = res.ledger
    assert sum(led.learner.values()) == pytest.approx(led.window_s, rel=1e-9)
    assert res.tokens_trained == res.tokens_generated


def test_a_slower_learner_costs_at_most_its_own_extra_work():
    """Only the learner slows (x2): ThunderSync's step grows by at most the learner's work per step."""
    base = run("thundersync")
    learner_only = run("thundersync", shared=SharedCores(1.0, 2.0))
    rollout_only = run("thundersync", shared=SharedCores(2.0, 1.0))
    assert learner_only.step_time_s >= base.step_time_s and rollout_only.step_time_s >= base.step_time_s
    compute = base.ledger.learner["compute"] + base.ledger.learner["chunk_overhead"]
    n = len(base.step_end) - base.warmup_steps
    assert learner_only.step_time_s - base.step_time_s <= compute / n + 1e-9


def test_shared_cores_need_per_turn_rollouts():
    agg = replace(WORK, detail="aggregate")
    with pytest.raises(ValueError, match="per-turn rollouts"):
        run("thundersync", shared=SharedCores(2.0, 2.0), work=agg)
    with pytest.raises(ValueError, match="per-turn rollouts"):
        run("fully_async", shared=SharedCores(2.0, 2.0), work=agg)
