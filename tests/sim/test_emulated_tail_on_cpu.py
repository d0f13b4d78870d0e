"""benchmarks/emulated_tail.py: the tail mode's settings, its figures and the simulator's prediction (CPU, no Ray)."""

from __future__ import annotations

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
