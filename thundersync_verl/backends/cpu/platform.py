"""verl platform ``cpu``: run verl's own trainer, FSDP2 engine and Ray pools on a CPU.

1. verl resolves its device, communication backend, Ray resource and device
   module through ``verl.plugin.platform``. Registering one more platform is the
   seam verl offers for new hardware, so the CPU is added the same way.
2. Auto-detection probes platforms in registration order; ``cpu`` registers
   last and only claims the machine when no accelerator answered, so on a GPU
   node nothing changes. ``VERL_PLATFORM=cpu`` forces it.
3. Ray schedules verl's learner and rollout processes by the ``GPU`` resource.
   On a CPU machine the recipe declares logical slots (``ray_init.num_gpus``):
   one slot = one learner or rollout process, nothing more.
4. A platform the caller set (``VERL_PLATFORM``) is never overridden: ``requested_platform`` is the one rule
   the demo, the test harness and ``ci/gpu_check.py`` use to name the platform a run gets (its VERL_PLATFORM,
   ``cpu`` when unset), and ``cpu_platform_active`` the rule the plugin and the Megatron CPU patches use.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Any, Mapping, Optional

import torch

from thundersync_verl.backends.cpu.device import cpu_device_module

PLATFORM_NAME = "cpu"


def requested_platform(env: Mapping[str, str] | None = None) -> str:
    """The verl platform a run launched with ``env`` (default: this process's) gets: its ``VERL_PLATFORM``,
    lower-cased, or ``cpu`` when unset (the demo and the harness run on the CPU unless told otherwise)."""
    env = os.environ if env is None else env
    return env.get("VERL_PLATFORM", "").strip().lower() or PLATFORM_NAME


def cpu_platform_active() -> bool:
    """True when verl in this process runs on platform ``cpu``: ``VERL_PLATFORM`` when set (``cpu`` forces it,
    any other name refuses it, CUDA visible or not), else verl's auto-detection (no CUDA device visible)."""
    forced = os.environ.get("VERL_PLATFORM", "").strip().lower()
    if forced:
        return forced == PLATFORM_NAME
    return not torch.cuda.is_available()


def _platform_base():
    from verl.plugin.platform import PlatformBase

    return PlatformBase


def make_platform_class():
    """Build the PlatformBase subclass (deferred so this module imports without verl)."""
    base = _platform_base()

    class PlatformCPU(base):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: cpu_device_module)

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            # Only claim the machine when no accelerator is visible to torch.
            return not torch.cuda.is_available()

        def current_device(self) -> str:
            # verl uses this as a device spec (`.to(get_device_id())`); "cpu" is the one that works
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: Optional[int] = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"  # logical process slots declared by ray.init(num_gpus=N)

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {"num_gpus": num_gpus}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> ModuleType | None:
            return None

    PlatformCPU.__name__ = PlatformCPU.__qualname__ = "PlatformCPU"
    return PlatformCPU


def register_cpu_platform() -> None:
    """Register platform ``cpu`` with verl (idempotent)."""
    from verl.plugin.platform import PlatformRegistry

    if PlatformRegistry.get(PLATFORM_NAME) is None:
        PlatformRegistry.register(PLATFORM_NAME)(make_platform_class())
