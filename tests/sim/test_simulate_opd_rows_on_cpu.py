"""benchmarks/simulate_opd_rows.py: the product's OPD row settings on the calibrated paper setting (seconds)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from thundersync_harness.benchmarks import load_benchmark
from thundersync_verl.sim.presets import paper_setting
from thundersync_verl.sim.workload import SyntheticSource


@pytest.fixture(scope="module")
def study():
    return load_benchmark("simulate_opd_rows").run(steps=30, seed=0)


def test_recomputed_turn_rows_cost_the_learner_more_and_lose_to_one_row_per_trajectory(study):
    for teacher in ("cached", "prefix"):
        rows = study[teacher]
        assert rows["turn_kept_graph"]["learner_work_over_sync"] == pytest.approx(1.0, abs=0.01)
        assert rows["trajectory"]["learner_work_over_sync"] == pytest.approx(1.0, abs=0.01)
        assert rows["turn_recompute"]["learner_work_over_sync"] > 1.2  # merged rows: far below one prefix a turn
        # simulated step times of one synthetic workload (no clock is read)
        assert rows["turn_kept_graph"]["step_s"] <= rows["trajectory"]["step_s"] < rows["turn_recompute"]["step_s"] \
            < rows["sync"]["step_s"]
    assert study["teacher_work_over_whole"] > 10  # ~30 turns a trajectory: a prefix per turn is many trajectories


def test_the_prefix_teacher_charges_whole_prefixes(study):
    setting = paper_setting()
    cached = SyntheticSource(setting.workload, setting.rollout, seed=0).batch(0)
    prefix = SyntheticSource(setting.workload, replace(setting.rollout, teacher_prefix=True), seed=0).batch(0)
    r = setting.rollout
    assert (cached.turn_hi == prefix.turn_hi).all()  # the same draws
    assert prefix.turn_score_s == pytest.approx(r.teacher_fixed_s + r.teacher_s_per_token * prefix.turn_hi)
    assert (prefix.turn_score_s >= cached.turn_score_s).all() and (prefix.last_score_s > cached.last_score_s).all()


def test_a_short_horizon_changes_the_order_of_nothing():
    rows = load_benchmark("simulate_opd_rows").run(steps=30, seed=0, teachers=("prefix",), turns_median=3)["prefix"]
    assert rows["trajectory"]["step_s"] < rows["turn_recompute"]["step_s"] < rows["sync"]["step_s"]
    assert rows["turn_recompute"]["learner_work_over_sync"] > 1.2
