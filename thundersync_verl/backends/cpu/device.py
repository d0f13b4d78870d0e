"""A stand-in for ``torch.cuda`` on machines without an accelerator.

1. verl calls its device module for memory statistics, RNG state, streams and
   synchronisation. On a CPU these have obvious meanings (no device memory, the
   global CPU generator, one implicit stream), so the stand-in answers them
   instead of verl branching on "is there a GPU".
2. Everything else is forwarded to ``torch.cpu``; an attribute neither knows
   raises an AttributeError that says which call needs a CPU meaning.
"""

from __future__ import annotations

import contextlib
import types

import psutil
import torch


class _CpuDeviceModule(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("thundersync_verl.cpu_device")

    # -- device identity ---------------------------------------------------
    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device) -> None:  # one logical device: nothing to select
        return None

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    # -- memory: host memory is the only memory ------------------------------
    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @staticmethod
    def memory_allocated(device=None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def set_per_process_memory_fraction(fraction, device=None) -> None:
        return None

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        return None

    # -- RNG: the global CPU generator ---------------------------------------
    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None) -> None:
        torch.set_rng_state(state)

    # -- streams: one implicit stream -----------------------------------------
    @staticmethod
    def current_stream(device=None):
        return torch.cpu.current_stream()

    @staticmethod
    def stream(stream=None):
        return contextlib.nullcontext()

    Stream = torch.cpu.Stream
    Event = torch.cpu.Event

    def __getattr__(self, name: str):
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        raise AttributeError(
            f"the CPU device module has no '{name}': verl called torch.<device>.{name}, which has no CPU meaning yet. "
            "Add it to thundersync_verl/backends/cpu/device.py (and say what it means on a CPU)."
        )


cpu_device_module = _CpuDeviceModule()
