"""Stock ``python -m verl.trainer.main_ppo`` with the CPU recipe: a short real run, end to end.

Uses a random tiny model (seconds to build) so the test checks the machinery, not learning:
Ray single controller, FSDP2 learner on gloo, hf_cpu rollout, the tool agent loop with its
subprocess sandbox, the reward loop, and the weight push after every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from thundersync_verl.demo import recipe_dir, run_env
from thundersync_verl.envs.dataset import write_dataset

pytestmark = pytest.mark.slow  # every test launches verl's main_ppo (minutes on 2 cores)


def _run_verl(tmp_path, model_path, mode: str, steps: int = 2):
    train = write_dataset(tmp_path / "train.parquet", 64, seed=0, split="train")
    val = write_dataset(tmp_path / "val.parquet", 8, seed=0, split="test")
    metrics = tmp_path / "metrics.jsonl"
    cmd = [
        sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={recipe_dir()}", "--config-name=grpo",
        f"data.train_files={train}", f"data.val_files={val}", f"actor_rollout_ref.model.path={model_path}",
        f"trainer.total_training_steps={steps}", f"mode={mode}", "data.max_response_length=64",
        "thundersync.env.trace_path=" + str(tmp_path / "trajectories.jsonl"),
    ]
    env = run_env(tmp_path, metrics)
    env["THUNDERSYNC_RAY_TMP"] = str(tmp_path / "ray")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["data"] if "data" in r else r for r in rows]


@pytest.mark.timeout(480)
def test_sync_grpo_runs_two_steps_and_rollout_matches_learner(tmp_path, tiny_random_lm):
    rows = _run_verl(tmp_path, tiny_random_lm, "sync")
    steps = [r for r in rows if "timing_s/step" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["training/rollout_logprob_diff_max"] < 1e-5  # hf_cpu holds the learner's weights
        assert r["training/off_policy/trajectory_staleness/max"] == 0
        for key in ("timing_s/gen", "timing_s/update_actor", "timing_s/update_weights"):
            assert r[key] > 0
    traces = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert len(traces) == 2 * 8 * 4  # every trajectory of both steps was recorded


@pytest.mark.timeout(480)
def test_thundersync_mode_streams_with_zero_staleness(tmp_path, tiny_random_lm):
    rows = _run_verl(tmp_path, tiny_random_lm, "thundersync")
    steps = [r for r in rows if "timing_s/step" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["training/off_policy/trajectory_staleness/max"] == 0  # measured from rollout weight versions
        assert r["training/rollout_logprob_diff_max"] < 1e-5
        assert r["thundersync/chunks"] >= 1
        assert 0.0 < r["thundersync/learner_busy_fraction"] <= 1.0
