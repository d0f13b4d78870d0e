"""benchmarks/tail_bias.py: the trained-batch figures and the command line (no verl run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thundersync_harness.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bias():
    return load_benchmark("tail_bias")


def test_ks_distance_is_the_largest_cdf_gap(bias):
    assert bias.ks_distance([1, 2, 3], [1, 2, 3]) == 0.0
    assert bias.ks_distance([1, 2], [3, 4]) == 1.0
    assert bias.ks_distance([1, 2, 3, 4], [3, 4, 5, 6]) == pytest.approx(0.5)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_tail_rows_count_trained_trajectories_and_deferrals(bias, tmp_path):
    traj = lambda n, turns: {"response_tokens": n, "turns": [{}] * turns}  # noqa: E731
    step_trace = _write(tmp_path / "step.jsonl", [{"kind": "trajectory", **traj(10, 1)}, {"kind": "trajectory", **traj(30, 3)},
                                                   {"kind": "step"}])
    loop = _write(tmp_path / "loop.jsonl", [traj(10, 1), traj(30, 3), traj(90, 5)])  # one of an aborted group
    per_step = {s: {"timing_s/step": 2.0, "critic/score/mean": 0.5 * s, "thundersync/tail/kept": 2,
                    "thundersync/tail/dropped": 1, "thundersync/tail/queue": s,
                    "thundersync/tail/deferred_kept_share": 0.5 * (s - 1), "thundersync/tail/delay_steps_mean": s - 1,
                    "thundersync/tail/delay_steps_max": s - 1} for s in (1, 2)}
    run = {"per_step": per_step, "loop_trace": loop, "step_trace": step_trace}
    row = bias.summary("thundersync_tail", run)
    assert row["trained"]["n"] == 2 and row["trained"]["response_tokens_mean"] == 20.0
    assert row["trained"]["turns_hist"] == {1: 1, 3: 1}
    assert row["launched"]["n"] == 3  # the aborted group's finished trajectory is launched, not trained
    assert row["deferred_prompt_share"] == 0.25 and row["delay_steps_max"] == 1 and row["queue_at_end"] == 2
    assert row["reward_curve"] == [0.5, 1.0] and row["staleness_max"] == 0.0
    sync = {"per_step": per_step, "loop_trace": loop, "step_trace": tmp_path / "none.jsonl"}
    rows = {"sync": bias.summary("sync", sync), "thundersync_tail": row}
    shift = bias.shifts(rows, {"sync": sync, "thundersync_tail": run})["vs_sync"]
    assert shift["response_tokens_mean_ratio"] == pytest.approx(20 / (130 / 3), abs=1e-4)  # Sync trains all three


@pytest.mark.parametrize("argv,words", [(["--eta", "1"], "eta must be > 1"), (["--modes", "sync,bogus"], "each must be"),
                                        (["--steps", "1"], "at least 2")])
def test_bad_arguments_are_refused_before_any_run(bias, argv, words, capsys):
    with pytest.raises(SystemExit) as err:
        bias.main(argv)
    assert err.value.code == 2 and words in capsys.readouterr().err
