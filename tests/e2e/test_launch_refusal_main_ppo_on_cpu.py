"""Stock ``python -m verl.trainer.main_ppo`` refuses a bad ``thundersync.*`` value on the driver, before Ray.

The launch is a real one (the CPU recipe, the tiny model, the tiny dataset, the ``hf_cpu`` rollout): without the
check (``launch_check.py``, ``verl_adapter.patches`` patch 9) this run starts Ray, the learner and the rollout, and the
value is refused inside an agent-loop worker, wrapped in a Ray traceback. The assertions read the output only:
the one rule / why / fix error, and no sign of ``ray.init`` (verl prints ``ray init kwargs`` right before it) or
of a Ray worker.
"""

from __future__ import annotations

import pytest

from thundersync_harness.main_ppo_runs import launch

pytestmark = pytest.mark.slow  # launches verl's main_ppo (a refused launch takes seconds; an accepted one, minutes)


@pytest.mark.timeout(600)
def test_a_bad_thundersync_value_in_sync_mode_fails_on_the_driver_before_ray(tmp_path, tiny_random_lm):
    out = launch(tmp_path, tiny_random_lm, "sync", ["thundersync.chunk_size=0"], timeout=540)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-4000:]
    assert "StreamingConfigError: thundersync.chunk_size must be an integer >= 1, got 0" in text, text[-4000:]
    assert "\n  fix: set thundersync.chunk_size to an integer >= 1, e.g. thundersync.chunk_size=8" in text, text[-4000:]
    assert text.count("StreamingConfigError") == 1, text[-4000:]  # one error, not a chain of them
    for sign_of_ray in ("ray init kwargs", "RayTaskError", "ray::", "Started a local Ray instance", "(pid="):
        assert sign_of_ray not in text, f"{sign_of_ray!r} in the output: Ray started\n{text[-4000:]}"
