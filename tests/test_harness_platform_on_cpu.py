"""The harness keeps the caller's platform and picks the dtype from it, not from CUDA visibility.

Why:
1. ``prepare_environment`` used to set ``VERL_PLATFORM=cpu`` unconditionally, so the GPU check's "CUDA"
   equivalence ran on the CPU platform; it now sets ``cpu`` only when the caller set nothing.
2. The Megatron harness picked bf16 from ``torch.cuda.is_available()`` while the platform was forced to the
   CPU; the dtype now follows the platform (bf16 on a GPU platform, fp32 on ``cpu``) on any machine.
3. ``start_ray`` on a GPU platform needs real GPUs: refused up front here (none visible), never a hang.
"""

from __future__ import annotations

import os
import shutil

import pytest

from thundersync_harness import engine_setup
from thundersync_harness.megatron_engine import megatron_config


@pytest.fixture
def clean_env():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("caller, expected", [(None, "cpu"), ("nvidia", "nvidia"), ("cpu", "cpu")])
def test_prepare_environment_keeps_the_callers_platform(clean_env, caller, expected):
    os.environ.pop("VERL_PLATFORM", None)
    if caller:
        os.environ["VERL_PLATFORM"] = caller
    ray_tmp = engine_setup.prepare_environment()
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert os.environ["VERL_PLATFORM"] == expected == engine_setup.harness_platform()


def test_dtype_follows_the_platform(clean_env, tmp_path):
    assert engine_setup.platform_dtype("cpu") == "float32"
    assert engine_setup.platform_dtype("nvidia") == "bfloat16"
    for platform, dtype in (("nvidia", "bfloat16"), ("cpu", "float32")):
        os.environ["VERL_PLATFORM"] = platform  # this machine has no CUDA either way
        config = megatron_config(tmp_path / "model", groups=4, micro=4)
        assert config.actor_rollout_ref.actor.megatron.dtype == dtype


def test_start_ray_refuses_a_gpu_platform_without_the_gpus(clean_env, tmp_path):
    os.environ.update({"VERL_PLATFORM": "nvidia", "RAY_TMPDIR": str(tmp_path)})
    with pytest.raises(RuntimeError, match="needs 1 GPUs"):
        engine_setup.start_ray(1)
