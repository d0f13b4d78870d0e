"""The machine probe: a fixed training step of an HF model, timed in a process of its own on one core (CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from thundersync_harness.machine_probe import TIMED, run_probe
from thundersync_harness.tiny_lm import tiny_qwen2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe_model")
    tiny_qwen2().save_pretrained(path)
    return path


def test_the_probe_times_a_fixed_step_on_the_last_core(model_dir):
    out = run_probe(model_dir)
    assert out["cpus"] == [sorted(os.sched_getaffinity(0))[-1]]
    assert len(out["times_s"]) == TIMED and all(t > 0 for t in out["times_s"])
    assert min(out["times_s"]) <= out["probe_s"] <= max(out["times_s"])


def test_a_folder_without_a_model_is_a_usage_error_not_a_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "thundersync_harness.machine_probe", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "no config.json" in done.stderr and "Traceback" not in done.stderr
    with pytest.raises(RuntimeError, match="machine probe failed"):
        run_probe(tmp_path)
