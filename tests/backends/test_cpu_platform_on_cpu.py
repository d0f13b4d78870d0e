"""Platform ``cpu`` and the plugin: what verl sees after ``import verl`` in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from thundersync_verl.verl_adapter.patches import normalise_backend

PROBE = r"""
import json, torch
import verl
from verl.plugin.platform import PlatformRegistry, get_platform
from verl.utils.device import get_device_name, get_nccl_backend, get_resource_name, get_torch_device
from verl.workers.engine.base import EngineRegistry
import verl.workers.engine  # noqa: F401  (triggers the post-import engine registration)
from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.workers.rollout.base import get_rollout_class
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
import verl.utils.debug.metrics  # noqa: F401  (triggers the metric patch)
from thundersync_verl.verl_adapter.patches import APPLIED
dev = get_torch_device()
print(json.dumps({
    "platforms": list(PlatformRegistry.registered_names()),
    "device": get_device_name(), "backend": get_nccl_backend(), "resource": get_resource_name(),
    "engine": EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__,
    "replica": RolloutReplicaRegistry.get("hf_cpu").__name__,
    "adapter": get_rollout_class("hf_cpu").__name__,
    "agent_loops": sorted(_agent_loop_registry),
    "patches": APPLIED,
    "mem": dev.mem_get_info()[1] > 0, "rng": tuple(dev.get_rng_state().shape),
}))
"""


def _probe(env_extra: dict) -> dict:
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a fresh interpreter imports verl and every registration (tens of seconds)
def test_import_verl_registers_everything_on_a_cpu_machine():
    info = _probe({"VERL_PLATFORM": ""})  # auto-detection, no override
    assert "cpu" in info["platforms"]
    assert (info["device"], info["backend"], info["resource"]) == ("cpu", "gloo", "GPU")
    assert info["engine"] == "FSDPEngineWithLMHead"
    assert info["replica"] == "HFCpuReplica" and info["adapter"] == "HFCpuServerAdapter"
    assert "thundersync_tool_agent" in info["agent_loops"]
    assert {"gloo_backend_string", "fsdp_engines_on_cpu", "logprob_diff_metric"} <= set(info["patches"])
    assert info["mem"] and len(info["rng"]) == 1


def test_backend_string_is_collapsed_only_when_unambiguous():
    assert normalise_backend("cpu:gloo,cpu:gloo") == "gloo"
    assert normalise_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert normalise_backend("gloo") == "gloo"
    assert normalise_backend(None) is None


@pytest.mark.slow  # a fresh interpreter imports verl and starts a gloo process group
def test_gloo_process_group_initialises_with_verls_backend_string(tmp_path):
    code = (
        "import verl, os, torch.distributed as dist\n"
        "from verl.utils.distributed import initialize_global_process_group_ray\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1', MASTER_PORT='29533')\n"
        "initialize_global_process_group_ray()\n"
        "print(dist.get_backend())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, "VERL_PLATFORM": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "gloo"


def test_unknown_rollout_name_is_a_clear_error():
    import verl  # noqa: F401
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    with pytest.raises(ValueError, match="Unknown rollout mode: hf_gpu.*hf_cpu"):
        RolloutReplicaRegistry.get("hf_gpu")
