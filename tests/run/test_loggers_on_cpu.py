"""The thundersync metrics and timeline images reach verl's loggers: tensorboard and wandb (offline). CPU only.

Each test drives verl's own ``Tracking`` (the object ``trainer.logger`` builds) and reads the run
files back (``thundersync_harness.logger_files``): the values must be in what a user opens.
"""

from __future__ import annotations

import json

import pytest

from thundersync_harness.logger_files import tensorboard_run, wandb_history
from thundersync_verl import verl_adapter as va
from thundersync_verl.run.timeline import DRAW_COST_FILE, TimelineDrawer, TimelineFeed, draw_timeline

TRAJECTORIES = [{"t_submit": 0.0, "t_done": 2.0, "t_reward": 2.5, "turns": [{"gen_s": 1.0, "tool_s": 0.5}]},
                {"t_submit": 0.5, "t_done": 1.5, "t_reward": 1.6, "turns": [{"gen_s": 1.0}]}]
OPS = [{"op": "backward", "t0": 1.7, "t1": 2.0}, {"op": "optimizer", "t0": 2.6, "t1": 2.8}]


@pytest.fixture
def png(tmp_path):
    return draw_timeline(TRAJECTORIES, OPS, 0.0, 3.0, tmp_path / "timeline.png", "step 1")


def test_feed_returns_each_finished_drawing_once_with_its_step(tmp_path):
    drawer = TimelineDrawer()
    for step in (1, 2):
        drawer.submit(TRAJECTORIES, OPS, 0.0, 3.0, tmp_path / f"thundersync_step{step:03d}.png", f"step {step}", step=step)
    drawer.close()
    feed = TimelineFeed(tmp_path)
    drawn = feed.new()
    assert [(step, png.name) for step, png in drawn] == [(1, "thundersync_step001.png"), (2, "thundersync_step002.png")]
    assert all(png.read_bytes().startswith(b"\x89PNG") for _, png in drawn)
    assert feed.new() == []  # each drawing once
    with open(tmp_path / DRAW_COST_FILE, "a") as f:  # a line the drawer is still writing is not read yet
        f.write(json.dumps({"png": "thundersync_step003.png", "step": 3})[:10])
    assert feed.new() == []


def test_drawer_hands_over_to_a_fresh_child_and_every_job_is_drawn(tmp_path, monkeypatch):
    """A child draws at most JOBS_PER_CHILD PNGs (its memory stays that of a fresh process); nothing is lost."""
    from thundersync_verl.run import timeline

    monkeypatch.setattr(timeline, "JOBS_PER_CHILD", 2)
    drawer, children = TimelineDrawer(), set()
    for step in range(1, 6):
        drawer.submit(TRAJECTORIES, OPS, 0.0, 3.0, tmp_path / f"thundersync_step{step:03d}.png", f"step {step}", step=step)
        children.add(drawer._proc.pid)
    drawer.close()
    assert len(children) == 3
    assert sorted(step for step, _ in TimelineFeed(tmp_path).new()) == [1, 2, 3, 4, 5]  # children finish in any order


def test_drawer_child_yields_the_cpu_by_nice_and_by_autogroup(tmp_path):
    """The child is in a session of its own: where the kernel groups sessions, nice alone does not make it yield
    (timeline.py point 5), so its autogroup is niced too."""
    import os
    import time
    from pathlib import Path

    drawer = TimelineDrawer()
    drawer.submit(TRAJECTORIES, OPS, 0.0, 3.0, tmp_path / "thundersync_step001.png", "step 1", step=1)
    pid, deadline, state = drawer._proc.pid, time.time() + 30, {}
    autogroup = Path(f"/proc/{pid}/autogroup")
    while time.time() < deadline:  # the child lowers its priority first thing; read it while it is alive
        state = {"nice": os.getpriority(os.PRIO_PROCESS, pid),
                 "autogroup": autogroup.read_text() if autogroup.exists() else None}
        if state["nice"] == 19 and (state["autogroup"] is None or state["autogroup"].strip().endswith("nice 19")):
            break
        time.sleep(0.01)
    drawer.close()
    assert state["nice"] == 19, state
    if Path("/proc/self/autogroup").exists():
        assert state["autogroup"].strip().endswith("nice 19"), state


def test_feed_of_a_run_without_drawings_is_empty(tmp_path):
    assert TimelineFeed(tmp_path / "timelines").new() == []


def test_tensorboard_run_files_hold_the_metrics_and_the_timeline(tmp_path, monkeypatch, png):
    from PIL import Image
    from verl.utils.tracking import Tracking

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    tracking = Tracking("thundersync", "loggers", default_backend=["tensorboard"])
    tracking.log({"thundersync/learner_busy_fraction": 0.75, "thundersync/bubble_s": 1.5}, step=1)
    assert va.log_images(tracking, "thundersync/timeline", [(1, png), (2, png)]) == ["tensorboard"]
    tracking.finish()
    run = tensorboard_run(tmp_path / "tb")
    assert run["scalars"]["thundersync/learner_busy_fraction"] == [(1, 0.75)]
    assert run["scalars"]["thundersync/bubble_s"] == [(1, 1.5)]
    width, height = Image.open(png).size
    assert run["images"]["thundersync/timeline"] == [(1, width, height), (2, width, height)]


def test_console_only_logging_takes_no_image(tmp_path, png):
    from verl.utils.tracking import Tracking

    tracking = Tracking("thundersync", "loggers", default_backend=["console"])
    assert va.log_images(tracking, "thundersync/timeline", [(1, png)]) == []


@pytest.mark.slow  # starts wandb's service process (seconds to tens of seconds)
def test_wandb_offline_run_file_holds_the_metrics_and_the_timeline(tmp_path, monkeypatch, png):
    from verl.utils.tracking import Tracking

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracking = Tracking("thundersync", "loggers", default_backend=["wandb"])
    tracking.log({"thundersync/learner_busy_fraction": 0.75}, step=1)
    tracking.log({"thundersync/learner_busy_fraction": 0.5}, step=2)
    # the drawings of steps 1 and 2 finished after step 2 was logged: both land at wandb's current step
    assert va.log_images(tracking, "thundersync/timeline", [(1, png), (2, png)]) == ["wandb"]
    tracking.finish()
    rows = {row["_step"]: row for row in wandb_history(tmp_path)}
    assert rows[1]["thundersync/learner_busy_fraction"] == 0.75
    assert rows[2]["thundersync/learner_busy_fraction"] == 0.5
    images = {k.rpartition("/")[2]: v for k, v in rows[2].items() if k.startswith("thundersync/timeline/")}
    assert images["_type"] == "images/separated" and images["captions"] == ["step 1", "step 2"]
    media = [p for name in images["filenames"] for p in tmp_path.rglob(f"offline-run-*/files/{name}")]
    assert len(media) == 2 and all(p.read_bytes() == png.read_bytes() for p in media)
