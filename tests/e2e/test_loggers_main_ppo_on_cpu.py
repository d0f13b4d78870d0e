"""A 2-step ``thundersync demo`` logging to tensorboard and wandb (offline): the run files hold the
``thundersync/*`` metrics and the timeline images, and the console keeps verl's step lines. CPU, slow.

The models come from a cold model cache, so the shipped student is what the run trains.
"""

from __future__ import annotations

import tempfile

import pytest

from thundersync_harness.logger_files import tensorboard_run, wandb_history
from thundersync_verl.demo import run_demo

pytestmark = pytest.mark.slow  # launches verl's main_ppo (minutes on 2 cores)
METRICS = ("thundersync/learner_busy_fraction", "thundersync/chunks", "thundersync/reward_to_backward_s/mean")


@pytest.mark.timeout(900)
def test_demo_metrics_and_timelines_reach_tensorboard_and_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("THUNDERSYNC_MODEL_DIR", str(tmp_path / "models"))
    ray_tmp = tempfile.mkdtemp(prefix="tsl_", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    monkeypatch.setenv("THUNDERSYNC_RAY_TMP", ray_tmp)
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tensorboard"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    (tmp_path / "wandb").mkdir()
    result = run_demo(algo="grpo", mode="thundersync", steps=2, work_dir=tmp_path / "demo",
                      results_dir=tmp_path / "results", extra=["trainer.logger=[console,file,tensorboard,wandb]"])
    assert result["steps"] == 2  # verl's console step lines, parsed by the demo

    board = tensorboard_run(tmp_path / "tensorboard")
    for key in METRICS:
        assert [step for step, _ in board["scalars"][key]] == [1, 2], key
    assert 0.0 < board["scalars"]["thundersync/learner_busy_fraction"][0][1] <= 1.0
    assert sorted(step for step, _, _ in board["images"]["thundersync/timeline"]) == [1, 2]
    assert all(w > 100 and h > 100 for _, w, h in board["images"]["thundersync/timeline"])

    rows = wandb_history(tmp_path / "wandb")
    by_step = {row["_step"]: row for row in rows}
    for key in METRICS:
        assert by_step[1][key] == pytest.approx(board["scalars"][key][0][1], rel=1e-6), key  # tensorboard keeps float32
        assert key in by_step[2]
    captions = [c for row in rows for c in row.get("thundersync/timeline/captions", [])]
    assert sorted(captions) == ["step 1", "step 2"]
    media = [p for row in rows for name in row.get("thundersync/timeline/filenames", [])
             for p in (tmp_path / "wandb").rglob(f"offline-run-*/files/{name}")]
    assert len(media) == 2 and all(p.read_bytes().startswith(b"\x89PNG") for p in media)
