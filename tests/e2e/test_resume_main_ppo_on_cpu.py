"""Checkpoint and resume in thundersync mode through stock ``main_ppo`` on replayed trajectories. CPU only, slow.

A ThunderSync run saves after every step; a second run resumes from its step-1 checkpoint (verl's
``trainer.resume_mode=resume_path``). Replaying one recording gives both runs the same trajectories,
and ``thundersync.deterministic=true`` makes each step's sums independent of arrival timing.
Checked: the resumed learner's weights are the saved ones bit for bit (the replay server keeps every
weight push), ThunderSync's own state was saved at a step boundary and restored, the dataloader resumed
at step 2's prompts (same rewards), and step 2's weights equal the uninterrupted run's bit for bit.
The resumed run is asked for 3 steps with its ``thundersync.stop_file`` already present: it must stop
after step 2 with a checkpoint of step 2 written by the stop (``trainer.save_freq=3`` would not write one).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from thundersync_harness import main_ppo_runs as runs
from thundersync_verl.run.resume import STATE_FILE

pytestmark = pytest.mark.slow  # two main_ppo launches and the shared recording (minutes on 2 cores)


@pytest.mark.timeout(2400)
def test_resumed_run_restores_the_checkpoint_bitwise_and_continues(tmp_path, tmp_path_factory, tiny_random_lm):
    rec = runs.shared_recording(tmp_path_factory, tiny_random_lm, steps=2)
    ckpt_a = tmp_path / "ckpt_a"
    ordered = ["thundersync.deterministic=true"]
    rows_a, w_a = runs.replayed(tmp_path, tiny_random_lm, rec, "a", "thundersync",
                                ["trainer.save_freq=1", f"trainer.default_local_dir={ckpt_a}", *ordered], steps=2)
    saved = json.loads((ckpt_a / "global_step_1" / STATE_FILE).read_text())
    assert saved["boundary"]["open_batches"] == 0 and saved["steps_streamed"] == 1

    ckpt_b = tmp_path / "ckpt_b"
    shutil.copytree(ckpt_a / "global_step_1", ckpt_b / "global_step_1")
    stop = tmp_path / "STOP"
    stop.touch()
    rows_b, w_b = runs.replayed(tmp_path, tiny_random_lm, rec, "b", "thundersync",
                                ["trainer.save_freq=3", f"trainer.default_local_dir={ckpt_b}", *ordered,
                                 "trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt_b / 'global_step_1'}",
                                 f"thundersync.stop_file={stop}"],
                                steps=3)
    assert len(rows_a) == 2 and len(rows_b) == 1  # the resumed run trains step 2 only, then the stop file ends it
    stopped = json.loads((ckpt_b / "global_step_2" / STATE_FILE).read_text())
    assert stopped["boundary"]["open_batches"] == 0 and stopped["global_step"] == 2

    a1, a2, b1, b2 = runs.pushed(w_a, 1), runs.pushed(w_a, 2), runs.pushed(w_b, 1), runs.pushed(w_b, 2)
    assert sorted(a1) == sorted(b1) and all(torch.equal(a1[k], b1[k]) for k in a1)  # the restored weights, bit for bit
    assert runs.distance(a2, a1) > 0
    assert all(torch.equal(a2[k], b2[k]) for k in a2), runs.distance(b2, a2)  # step 2 resumed: bit for bit
    assert rows_b[0]["critic/score/mean"] == rows_a[1]["critic/score/mean"]  # the dataloader resumed at step 2
    assert rows_b[0]["thundersync/resumes"] == 1 and rows_b[0]["thundersync/steps_skipped_nonfinite"] == 0
    assert rows_b[0]["training/off_policy/trajectory_staleness/max"] == 0
