"""benchmarks/emulated_tail.py: the tail mode's settings, its figures and the simulator's prediction (CPU, no Ray)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from synthetic_runs import records
from thundersync_harness.benchmarks import load_benchmark
from thundersync_verl.sim.trace import write_trace


@pytest.fixture(scope="module")
def tail():
    return load_benchmark("emulated_tail")


def test_the_recording_holds_every_prompt_a_tail_run_draws(tail):
    assert tail.recording_steps(8, ["thundersync"]) == 10  # two ahead for the async modes
    assert tail.recording_steps(8, ["thundersync", tail.TAIL_MODE]) == 13  # ceil(10 x 1.25)
    assert "thundersync.tail.eta=1.25" in tail.overrides()
    assert any(o.endswith("replay.repeat=true") for o in tail.overrides())


def test_tail_figures_total_the_per_step_metrics(tail):
    steps = {1: {"thundersync/tail/launched": 20, "thundersync/tail/kept": 16, "thundersync/tail/dropped": 4,
                 "thundersync/tail/deferred_kept_share": 0.0},
             2: {"thundersync/tail/launched": 20, "thundersync/tail/kept": 16, "thundersync/tail/dropped": 4,
                 "thundersync/tail/deferred_kept_share": 0.25}}
    out = tail.tail_figures({"per_step": steps})
    assert (out["launched_groups"], out["aborted_groups"], out["trained_groups"]) == (40, 8, 32)
    assert out["deferred_prompt_share"] == pytest.approx(4 / 32)


def test_the_prediction_comes_from_the_plain_run_alone_and_is_one_at_eta_one(tail, tmp_path, monkeypatch):
    path = tmp_path / "grpo_thundersync.jsonl"
    write_trace(path, records("thundersync", steps=6))
    wide = tail.predict_speedup(path)
    assert wide["tail_speedup_vs_thundersync"] > 0 and wide["deferred_prompt_share"] is not None
    monkeypatch.setattr(tail, "TAIL_ETA", 1.0)
    assert tail.predict_speedup(path)["tail_speedup_vs_thundersync"] == pytest.approx(1.0)
    rows = {"thundersync": {"step_time_s": 12.0}, tail.TAIL_MODE: {"step_time_s": 10.0}}
    runs = {"thundersync": {"run_dir": tmp_path}, tail.TAIL_MODE: {"per_step": {1: {}}}}
    out = tail.headline(rows, runs)
    assert out["tail_speedup_vs_thundersync"] == 1.2
    assert out["prediction_rel_err"] == pytest.approx(out["tail_speedup_predicted"] / 1.2 - 1, abs=1e-4)


def test_the_host_bound_prediction_fits_cpu_per_turn_on_the_plain_run_and_keeps_the_slot_model_beside_it(tail, tmp_path):
    path = tmp_path / "grpo_thundersync.jsonl"
    recs = records("thundersync", steps=6)
    write_trace(path, recs)
    by_version: dict = {}
    for r in recs:
        if r["kind"] == "trajectory":
            by_version[r["policy_version"]] = by_version.get(r["policy_version"], 0) + len(r["turns"])
    window = sorted(by_version)[1:-1]
    turns = sum(by_version[v] for v in window) / len(window)
    host = tail.host_model(path, {"rollout_side": 6.0}, cores=2)
    assert host.cpu_s_per_turn == pytest.approx(6.0 / turns) and host.cores == 2
    assert tail.host_model(path, None, 1) is None and tail.host_model(path, {"rollout_side": 6.0}, 0) is None
    free, busy = tail.predict_speedup(path), tail.predict_speedup(path, replace(host, cpu_s_per_turn=1.0))
    assert busy["host_cpu_s_per_turn"] == 1.0 and "host_cpu_s_per_turn" not in free
    assert busy["plain_step_s"] > free["plain_step_s"]  # a host that slow bounds every round
    rows = {"thundersync": {"step_time_s": 12.0, "host_cpu_s_per_step": {"rollout_side": 6.0}},
            tail.TAIL_MODE: {"step_time_s": 10.0}}
    runs = {"thundersync": {"run_dir": tmp_path, "pin": {"rollout_side_cpus": [0, 1]}},
            tail.TAIL_MODE: {"per_step": {1: {}}}}
    out = tail.headline(rows, runs)
    assert out["prediction_host_bound"] and out["sim_prediction"]["host_cores"] == 2
    assert out["sim_prediction_slots_only"] == free
    assert out["plain_prediction_rel_err"] == pytest.approx(out["sim_prediction"]["plain_step_s"] / 12.0 - 1, abs=1e-4)
