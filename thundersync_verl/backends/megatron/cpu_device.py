"""Megatron-Core's hard-coded CUDA device, answered by the CPU (only on verl's ``cpu`` platform).

Why:
1. megatron-core 0.16 allocates its buffers (DDP grad buffer, pipeline p2p tensors, the global
   memory buffer of the local attention, the optimizer's scalars) with ``device="cuda"`` or
   ``torch.cuda.current_device()``, moves tensors with ``.cuda()`` and checks ``param.type()``
   against ``torch.cuda.*Tensor``: about 240 call sites on the paths verl uses. Patching each is
   not maintainable; one ``TorchFunctionMode`` that maps a CUDA device to the CPU in factory
   calls, ``.to()`` and ``.cuda()`` covers them all.
2. A torch-function mode is thread-local and switched off inside its own handler. So the mode
   is pushed once per thread that enters the Megatron engine (``ensure_active``: Ray runs an
   asyncio actor's calls on its event-loop thread, not the main thread) and the handler
   re-enters it around ``torch.autograd.backward`` (the sequence-parallel backward allocates
   with ``torch.cuda.current_device()`` and would otherwise escape it).
3. ``param.type()`` reports ``torch.cuda.<T>Tensor`` only to Megatron's optimizer modules, which
   refuse any other string; every other caller sees the truth.
4. The few ``torch.cuda`` module functions Megatron calls directly (``current_device``,
   ``synchronize``, and the MoE all-to-all dispatcher's ``current_stream`` / ``stream``) get CPU meanings
   (device 0, which the mode maps to the CPU; a no-op; ``CPU_STREAM``; no stream switch) in the threads
   where the mode is active; elsewhere torch's own functions answer.
5. ``CPU_STREAM`` is a CUDA stream's CPU meaning: CPU work runs in program order, so waiting on a stream,
   recording an event and synchronising it are no-ops. The MoE all-to-all dispatcher creates one side stream
   for its device-to-host copies at construction (``torch.cuda.Stream()``, which a CPU build cannot make):
   ``cpu_patches`` gives it this one instead.
Nothing here is installed unless verl runs on platform ``cpu`` (``cpu_platform_active``: a caller's
``VERL_PLATFORM`` decides, CUDA visibility only when it is unset).
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

from thundersync_verl.backends.cpu.platform import cpu_platform_active

_LOCAL = threading.local()
_SPOOF_TYPE_FOR = ("megatron.core.optimizer",)  # modules that insist on a torch.cuda.*Tensor type string


def _is_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare index names a CUDA device
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


def _on_cpu(device):
    return torch.device("cpu") if _is_cuda(device) else device


def _caller_module(depth: int = 2) -> str:
    frame = sys._getframe(depth)
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class CudaToCpuMode(TorchFunctionMode):
    """Maps every CUDA device in a torch call to the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func in (torch.Tensor.pin_memory, torch.Tensor.record_stream):
            return args[0] if func is torch.Tensor.pin_memory else None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and _caller_module().startswith(_SPOOF_TYPE_FOR):
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.autograd.backward or func is torch.Tensor.backward:
            with self:  # the handler runs with the mode popped: push it again for the backward functions
                return _run_backward(*args, **kwargs)
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


def _run_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None, gradient=None):
    """``torch.autograd.backward`` past its torch-function check (calling it again would re-enter the handler)."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    grads = _tensor_or_tensors_to_tuple(grad_tensors if gradient is None else gradient, len(tensors))
    grads = _make_grads(tensors, grads, is_grads_batched=False)
    keep = create_graph if retain_graph is None else retain_graph
    _engine_run_backward(tensors, grads, keep, create_graph, inputs, allow_unreachable=True, accumulate_grad=True)


def ensure_active() -> None:
    """Push the mode in this thread unless it is already there (idempotent, cheap)."""
    if getattr(_LOCAL, "mode", None) is None:
        mode = CudaToCpuMode()
        mode.__enter__()  # stays for the thread's lifetime: every Megatron call of this thread needs it
        _LOCAL.mode = mode


def ensure_active_if_cpu() -> None:
    """``ensure_active`` on verl's ``cpu`` platform; nothing on any other platform."""
    if cpu_platform_active():
        ensure_active()


def in_cpu_mode(fn):
    """Decorate ``fn`` so it runs with the mode active in the calling thread."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ensure_active()
        return fn(*args, **kwargs)

    wrapper._thundersync_cpu_mode = True
    return wrapper


def is_active() -> bool:
    """True in a thread that entered the Megatron engine (the mode is pushed there)."""
    return getattr(_LOCAL, "mode", None) is not None


class CpuEvent:
    """A CUDA event's CPU meaning (point 5): the work before it is done when it is recorded."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def record(self, stream=None) -> None:
        return None


class CpuStream:
    """A CUDA stream's CPU meaning (point 5): one in-order stream, so waits and events are no-ops."""

    def wait_stream(self, other) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None) -> CpuEvent:
        return event or CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


CPU_STREAM = CpuStream()


def install_cuda_shims() -> list[str]:
    """CPU meanings for the ``torch.cuda`` functions Megatron calls directly; returns what was replaced.

    The shims answer only in a thread where the mode is active (a Megatron engine call); anywhere
    else the original function runs, so code outside Megatron sees torch's own behaviour.
    """
    if not cpu_platform_active():
        return []
    shims = {"current_device": lambda: 0, "synchronize": lambda device=None: None,
             "current_stream": lambda device=None: CPU_STREAM, "stream": lambda stream=None: contextlib.nullcontext()}
    for name, cpu_fn in shims.items():
        original = getattr(torch.cuda, name)
        if getattr(original, "_thundersync_patched", False):
            continue

        def shim(*args, _cpu=cpu_fn, _original=original, **kwargs):
            return _cpu(*args, **kwargs) if is_active() else _original(*args, **kwargs)

        shim._thundersync_patched = True
        shim.__wrapped__ = original
        setattr(torch.cuda, name, shim)
    return sorted(shims)
