"""PACE and verl's drop threshold as simulator policies (sim/sim_pace.py) (CPU, no GPU, < 30 s)."""

from __future__ import annotations

import numpy as np
import pytest

from thundersync_verl.core.pace import PaceSettings, rejection_budget
from thundersync_verl.sim.dists import const, lognormal
from thundersync_verl.sim.sim_engine import SimConfig, simulate
from thundersync_verl.sim.hardware import LearnerCosts
from thundersync_verl.sim.sim_pace import PacePolicy
from thundersync_verl.sim.workload import RolloutSpec, SyntheticSource, WorkloadSpec

# long-tailed rollouts, a fast learner and a loose gate: a deep pool of finished groups, staleness up to 3
WORK = WorkloadSpec(groups_per_step=8, group_size=4, turns=lognormal(4, 0.9), max_turns=20, max_context=20_000,
                    prompt_tokens=const(300), gen_tokens=lognormal(80, 0.5), obs_tokens=lognormal(120, 0.8),
                    tool_s=lognormal(0.4, 1.2), reward_s=lognormal(0.5, 0.4))
ROLL = RolloutSpec(slots=64, decode_s_per_token=0.01, prefill_s_per_token=1e-4, teacher_fixed_s=0.2,
                   teacher_s_per_token=1e-4)
COSTS = LearnerCosts(s_per_token=2e-4, chunk_overhead_s=0.05, optimizer_s=0.2, weight_sync_s=0.3)


def run(pace=None, seed=0, steps=16):
    src = SyntheticSource(WORK, ROLL, seed=seed)
    cfg = SimConfig(mode="fully_async", steps=steps, rollout_slots=ROLL.slots, staleness_threshold=3.0,
                    mini_batch=8, pace=pace)
    return simulate(cfg, src, COSTS)


def mean_staleness(res) -> float:
    total = sum(res.staleness.values())
    return sum(k * n for k, n in res.staleness.items()) / total


def test_gain_zero_is_plain_fully_async():
    plain, observed = run(), run(PacePolicy(gain=0.0))
    assert np.array_equal(plain.step_end, observed.step_end)
    assert plain.staleness == observed.staleness
    assert observed.extra["rejected_trajectories"] == 0


def test_pace_rejects_stale_groups_and_lowers_staleness():
    plain, paced = run(), run(PacePolicy(target_pool=2, gain=1.0))
    assert paced.extra["rejected_trajectories"] > 0
    assert 0 < paced.extra["rejected_share"] < 1
    assert mean_staleness(paced) < mean_staleness(plain)
    # every step still trains a full batch: rejected groups were regenerated, not skipped
    assert paced.extra["trained_trajectories"] == plain.extra["trained_trajectories"]


def test_drop_threshold_bounds_trained_staleness():
    dropped = run(PacePolicy(drop_threshold=2))
    assert max(dropped.staleness) <= 1  # span v - born + 1 <= 2
    assert dropped.extra["rejected_trajectories"] > 0


def test_pace_refuses_other_modes():
    src = SyntheticSource(WORK, ROLL, seed=0)
    with pytest.raises(ValueError, match="fully_async policy"):
        simulate(SimConfig(mode="sync", steps=3, pace=PacePolicy()), src, COSTS)


@pytest.mark.parametrize("pool", range(0, 12))
@pytest.mark.parametrize("needed", [0, 1, 2, 5])
@pytest.mark.parametrize("target, gain", [(0, 1.0), (2, 0.5), (3, 2.5), (1, 0.0)])
def test_budget_is_core_paces(pool, needed, target, gain):
    if needed > pool:
        return
    sim = PacePolicy(target_pool=target, gain=gain).budget(pool, needed)
    assert sim == rejection_budget(pool, needed, PaceSettings(target_pool=target, gain=gain))


def test_per_step_counts_add_up_to_the_run():
    """``per_step`` (step = learner version + 1) lets a prediction be read over the steps a measured run counted."""
    paced = run(PacePolicy(target_pool=2, gain=1.0))
    rows = paced.extra["per_step"]
    assert sum(r["rejected"] for r in rows.values()) == paced.extra["rejected_trajectories"] > 0
    assert sum(r["trained"] for r in rows.values()) == paced.extra["trained_trajectories"]
    assert sum(r["staleness_sum"] for r in rows.values()) == sum(k * n for k, n in paced.staleness.items())
    assert [rows[s]["trained"] for s in range(1, 17)] == [32] * 16  # every step trains a full batch
    assert rows[1]["staleness_sum"] == 0  # the first step trains on the weights its rollouts started on
