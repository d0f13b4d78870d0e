"""Tail batching through stock ``main_ppo`` (``thundersync.tail``): more groups launched, the first P trained.

One thundersync run of 3 steps at ``eta=1.5`` (12 groups launched for a batch of 8) with ``max_deferrals=1``
and dedicated rounds, so the rounds are fixed whatever the timing: step 1 launches 12 fresh prompts and
defers 4; step 2 (the 4 queued do not fill a round) launches 12 fresh again and defers 4; step 3 is the 8
deferred prompts alone, pinned. Every step trains exactly 8 groups at staleness 0, and every prompt drawn
from the dataloader is trained once by the end. The checkpoint of step 2 holds the queue, and a run resumed
from it repeats step 3 as the uninterrupted run took it. The policy's arithmetic (which groups are kept, the
normalisers) is tested without Ray in ``tests/step/test_tail_step_on_cpu.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from thundersync_verl.demo import recipe_dir, run_env
from thundersync_verl.envs.dataset import write_dataset

pytestmark = pytest.mark.slow
TAIL = ["mode=thundersync", "thundersync.tail.eta=1.5", "thundersync.tail.max_deferrals=1", "data.max_response_length=64"]
FIGURES = ("launched", "pinned", "queued_taken", "kept", "dropped", "queue", "leftover")


def _run(tmp_path, name: str, model, extra: list[str]) -> list[dict]:
    work = tmp_path / name
    work.mkdir()
    data = tmp_path / "train.parquet"
    if not data.exists():
        write_dataset(data, 64, seed=0, split="train")
    metrics = work / "metrics.jsonl"
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={recipe_dir()}", "--config-name=grpo",
           f"data.train_files={data}", f"data.val_files={data}", f"actor_rollout_ref.model.path={model}",
           "trainer.total_training_steps=3", *TAIL, *extra]
    env = run_env(work, metrics)
    env["THUNDERSYNC_RAY_TMP"] = str(work / "ray")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, cwd=work)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r.get("data", r) for r in rows if "timing_s/step" in r.get("data", r)]


def _tail(row: dict) -> tuple:
    return tuple(int(row[f"thundersync/tail/{k}"]) for k in FIGURES)


@pytest.mark.timeout(900)
def test_tail_batching_trains_p_groups_a_step_defers_the_rest_and_resumes_its_queue(tmp_path, tiny_random_lm):
    ckpt = tmp_path / "ckpt"
    steps = _run(tmp_path, "run", tiny_random_lm, ["trainer.save_freq=2", f"trainer.default_local_dir={ckpt}"])
    assert [_tail(r) for r in steps] == [(12, 0, 0, 8, 4, 4, 4), (12, 0, 0, 8, 4, 8, 0), (8, 8, 8, 8, 0, 0, 0)]
    for r in steps:
        assert r["training/off_policy/trajectory_staleness/max"] == 0  # every kept group at the batch's weights
        assert r["training/rollout_logprob_diff_max"] < 1e-5
    drawn = 3 * 8  # three dataloader batches of 8 (step 1 drew two, step 2 one)
    assert sum(int(r["thundersync/tail/kept"]) for r in steps) == drawn  # every drawn prompt trained, none twice
    assert steps[2]["thundersync/tail/deferred_kept_share"] == 1.0 and steps[2]["thundersync/tail/delay_steps_max"] == 2
    state = json.loads((ckpt / "global_step_2" / "thundersync_state.json").read_text())
    assert len(state["tail"]["queue"]["items"]) == 8 and state["tail"]["leftover"] == []
    resumed = _run(tmp_path, "resumed", tiny_random_lm, [
        "trainer.save_freq=-1", f"trainer.default_local_dir={tmp_path / 'ckpt_resumed'}", "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={ckpt / 'global_step_2'}"])
    assert [_tail(r) for r in resumed] == [_tail(steps[2])]  # the queue came back: step 3 as the uninterrupted run
    assert resumed[0]["thundersync/tail/delay_steps_max"] == 2
