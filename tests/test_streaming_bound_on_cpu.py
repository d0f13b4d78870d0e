"""benchmarks/emulated_rollout.py ``streaming_bound``: the shortest streamed step a Sync run's own timings allow (no Ray)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its sibling ``modes``
    try:
        spec = importlib.util.spec_from_file_location("emulated_rollout_bench", ROOT / "benchmarks" / "emulated_rollout.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def sync_run(tmp_path: Path, steps: dict[int, tuple[list[float], float, float]]) -> dict:
    """Sync's step s trains on version s-1: ``{s: (agent loop end times from the first submit, gen s, update s)}``."""
    lines, per_step = [], {1: {"timing_s/gen": 9.0, "timing_s/update_actor": 9.0}}  # step 1 (warm-up) is left out
    for step, (done, gen, update) in steps.items():
        t0 = 1000.0 * step
        lines += [{"policy_version": step - 1, "t_submit": t0, "t_done": t0 + d} for d in done]
        per_step[step] = {"timing_s/gen": gen, "timing_s/update_actor": update}
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return {"per_step": per_step, "traj_path": path}


def test_rewards_that_land_together_leave_nothing_to_overlap(bench, tmp_path):
    run = sync_run(tmp_path, {2: ([2.0] * 4, 2.5, 4.0)})  # every reward at gen's end: the whole update after it
    assert bench.streaming_bound(run) == pytest.approx(2.5 + 4.0)


def test_spread_rewards_hide_the_update_behind_the_rollout_up_to_the_last_row(bench, tmp_path):
    # rewards land at 1, 2, 3, 4 s (gen's end is the last one: no verifier shift), 0.5 s of update per row
    run = sync_run(tmp_path, {2: ([1.0, 2.0, 3.0, 4.0], 4.0, 2.0)})
    assert bench.streaming_bound(run) == pytest.approx(4.5)
    # a slower learner: the first row's start plus the whole update (1 + 4 x 1.5) beats the last landing
    slow = sync_run(tmp_path, {2: ([1.0, 2.0, 3.0, 4.0], 4.0, 6.0)})
    assert bench.streaming_bound(slow) == pytest.approx(7.0)


def test_the_verifier_shift_and_the_median_over_steps(bench, tmp_path):
    # the agent loops end at 1 and 2 s, gen ends at 2.5 s: both rewards land 0.5 s later
    run = sync_run(tmp_path, {2: ([1.0, 2.0], 2.5, 0.2), 3: ([1.0, 1.0], 1.0, 4.0), 4: ([0.5, 3.0], 3.0, 1.0)})
    assert bench.streaming_bound(run) == pytest.approx(3.5)  # median of 2.6, 5.0, 3.5
    assert bench.streaming_bound({"per_step": {1: {}}, "traj_path": run["traj_path"]}) is None
