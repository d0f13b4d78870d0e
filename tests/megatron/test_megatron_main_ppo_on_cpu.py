"""Stock ``python -m verl.trainer.main_ppo`` with ``model_engine=megatron mode=thundersync`` on the CPU.

The CPU recipe (``recipes/cpu_tiny/grpo.yaml``) with verl's Megatron actor swapped in from the command
line: the streaming learner on Megatron (distributed optimizer; verl's weight export needs the param
buffer it allocates), weights exported through mbridge to the hf_cpu rollout after every step, zero
staleness. A random tiny model: the test checks the machinery, not learning. One main_ppo launch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from thundersync_harness.main_ppo_runs import MEGATRON_OVERRIDES
from thundersync_harness.megatron_engine import build_megatron_model
from thundersync_verl.demo import recipe_dir, run_env
from thundersync_verl.envs.dataset import write_dataset

pytestmark = pytest.mark.slow  # launches verl's main_ppo (minutes on 2 cores)

ACTOR = "actor_rollout_ref.actor"


def _run_two_steps(tmp_path, extra: list[str]) -> list[dict]:
    """main_ppo mode=thundersync on Megatron for two steps; every step's metrics."""
    model, _, _ = build_megatron_model(tmp_path / "model")
    train = write_dataset(tmp_path / "train.parquet", 64, seed=0, split="train")
    val = write_dataset(tmp_path / "val.parquet", 8, seed=0, split="test")
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={recipe_dir()}", "--config-name=grpo",
           f"data.train_files={train}", f"data.val_files={val}", f"actor_rollout_ref.model.path={model}",
           "trainer.total_training_steps=2", "mode=thundersync", "data.max_response_length=64",
           "thundersync.env.trace_path=" + str(tmp_path / "trajectories.jsonl"), *MEGATRON_OVERRIDES, *extra]
    env = run_env(tmp_path, metrics)
    env["THUNDERSYNC_RAY_TMP"] = str(tmp_path / "ray")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=840, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r.get("data", r) for r in rows if "timing_s/step" in r.get("data", r)]
    assert len(steps) == 2
    return steps


@pytest.mark.timeout(900)
def test_thundersync_mode_on_megatron_streams_two_steps_with_zero_staleness(tmp_path):
    steps = _run_two_steps(tmp_path, [])
    for r in steps:
        assert r["training/off_policy/trajectory_staleness/max"] == 0
        assert r["training/rollout_logprob_diff_max"] < 1e-5  # the rollout holds the Megatron learner's weights
        assert r["thundersync/chunks"] >= 1
        assert r["thundersync/accumulator_bytes_peak"] > 0  # buckets held while groups were open


@pytest.mark.timeout(900)
def test_thundersync_mode_on_megatron_streams_kl_loss_and_entropy_bonus(tmp_path):
    """verl builds the Megatron reference group (role ref); every landed trajectory gets its reference log-probs
    before its backward (a KL chunk without them is refused, so a finished run used them). Exactness of the
    update: ``benchmarks/equivalence.py --engine megatron --kl --entropy`` and ``test_megatron_kl_entropy_on_cpu``."""
    steps = _run_two_steps(tmp_path, [f"{ACTOR}.use_kl_loss=true", f"{ACTOR}.kl_loss_type=low_var_kl",
                                      f"{ACTOR}.kl_loss_coef=0.1", f"{ACTOR}.entropy_coeff=0.01",
                                      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"])
    for r in steps:
        assert r["training/off_policy/trajectory_staleness/max"] == 0
        assert r["thundersync/chunks"] >= 1
