"""Stock ``python -m verl.trainer.main_ppo`` in ``mode=thundersync`` with verl's KL loss and entropy bonus.

Checks the trainer path end to end on the CPU recipe: verl builds the reference worker group (the
learner has its own pool, so the reference is verl's ``ref`` role), every landed trajectory gets its
reference log-probs through verl's ``_compute_ref_log_prob`` before its backward, and the streaming
learner adds the KL and entropy terms (a chunk without reference log-probs is refused, so a run
that finishes has used them). The update's exactness is ``benchmarks/equivalence.py --kl --entropy``'s job.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from thundersync_verl.demo import recipe_dir, run_env
from thundersync_verl.envs.dataset import write_dataset

pytestmark = pytest.mark.slow  # launches verl's main_ppo (minutes on 2 cores)
ACTOR = "actor_rollout_ref.actor"


@pytest.mark.timeout(600)
def test_thundersync_mode_streams_kl_loss_and_entropy_bonus(tmp_path, tiny_random_lm):
    train = write_dataset(tmp_path / "train.parquet", 64, seed=0, split="train")
    val = write_dataset(tmp_path / "val.parquet", 8, seed=0, split="test")
    metrics = tmp_path / "metrics.jsonl"
    cmd = [
        sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={recipe_dir()}", "--config-name=grpo",
        f"data.train_files={train}", f"data.val_files={val}", f"actor_rollout_ref.model.path={tiny_random_lm}",
        "trainer.total_training_steps=2", "mode=thundersync", "data.max_response_length=64",
        f"{ACTOR}.use_kl_loss=true", f"{ACTOR}.kl_loss_type=low_var_kl", f"{ACTOR}.kl_loss_coef=0.1",
        f"{ACTOR}.entropy_coeff=0.01", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    ]
    env = run_env(tmp_path, metrics)
    env["THUNDERSYNC_RAY_TMP"] = str(tmp_path / "ray")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r.get("data", r) for r in rows if "timing_s/step" in r.get("data", r)]
    assert len(steps) == 2
    for r in steps:
        assert r["training/off_policy/trajectory_staleness/max"] == 0
        assert r["thundersync/chunks"] >= 1
