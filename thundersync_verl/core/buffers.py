"""Gradient layout, buffer allocation, and the two tensor operations of the accumulator.

Why:
1. Every accumulator buffer is a full copy of the rank's LOCAL gradient shards (P values):
   with k open groups and 2 buffers each the accumulator holds about (2k+1)·P values. Which
   buffers may exist is decided without tensors (budget.py); this module makes the tensors.
2. ``BufferPool`` is a ``MemoryBudget`` that also allocates: each buffer it hands out is
   charged to its owner's reservation, for callers that keep their buffers themselves.
3. Buffers live next to the parameters ("device") or in host memory ("host"; pinned when
   CUDA is present so device-to-host copies are asynchronous). The batch accumulator always
   lives next to the parameters: it receives every closed-group trajectory and is written
   back into ``.grad`` at the barrier.
4. ``GradLayout`` pins the shapes, devices and accumulation dtype of the gradient list at
   construction; every incoming list is checked against it so a shape slip is caught at the
   call that made it, not as a silent broadcast.
5. Where a learner's buckets live and what one costs is ``bucket_memory.py``'s one function, which
   ``thundersync plan`` uses too (``BufferPool.for_learner``).
6. Host buckets of an accelerator learner: a bucket is filled device->host and folded host->device
   on a side stream, with events ordering both ends: a device->host copy is complete before the CPU
   reads it, a host->device copy before its add runs on the compute stream and before ``axpy_``
   returns (so the host buffer can be reused or freed). On a CPU the same functions run with the
   stream and events as no-ops.
7. A fold adds ``alpha * bucket`` into the gradient in the promoted dtype and rounds once into the
   gradient's: with bf16 gradients and fp32 buckets (``GradLayout`` promotes the accumulation dtype
   to at least fp32), the bucket is not rounded to bf16 before it is scaled.
8. Where no copy crosses devices (every CPU bucket; device buckets), an axpy or copy over all shards is one
   multi-tensor call (``torch._foreach_*``) rather than a Python loop of per-shard calls: a streamed chunk
   costs a few calls whatever the model's parameter count. On a CPU these run the per-shard ops in C++, so
   the result is the loop's, bit for bit (tested).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from thundersync_verl.core.bucket_memory import bucket_memory
from thundersync_verl.core.budget import MemoryBudget
from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError, rule_message

STORAGES = ("device", "host")


@dataclass(frozen=True)
class GradLayout:
    """Shapes and devices of the local gradient shards, and the accumulation dtype."""

    shapes: tuple[torch.Size, ...]
    devices: tuple[torch.device, ...]
    dtype: torch.dtype

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], accum_dtype: torch.dtype | None = None) -> "GradLayout":
        if len(tensors) == 0:
            raise StreamingConfigError(
                rule_message(
                    "the accumulator needs at least one parameter shard",
                    "it allocates one buffer per shard to hold the batch gradient",
                    "pass the list of local parameter tensors (or their gradient shards)",
                )
            )
        if accum_dtype is None:
            accum_dtype = torch.promote_types(tensors[0].dtype, torch.float32)
            for t in tensors[1:]:
                accum_dtype = torch.promote_types(accum_dtype, t.dtype)
        if not accum_dtype.is_floating_point:
            raise StreamingConfigError(
                rule_message(
                    f"accumulation dtype must be floating point (got {accum_dtype})",
                    "gradients are summed with real coefficients",
                    "pass accum_dtype=torch.float32 (or float64)",
                )
            )
        shapes = tuple(torch.Size(t.shape) for t in tensors)
        devices = tuple(t.device for t in tensors)
        return cls(shapes=shapes, devices=devices, dtype=accum_dtype)

    @property
    def numel(self) -> int:
        total = 0
        for s in self.shapes:
            total += s.numel()
        return total

    @property
    def buffer_bytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def check(self, grads: Sequence[torch.Tensor | None], what: str = "grads") -> None:
        """Raise ``StreamingInputError`` unless ``grads`` matches the layout."""
        if len(grads) != len(self.shapes):
            raise StreamingInputError(
                rule_message(
                    f"{what} has {len(grads)} tensors, the accumulator was built for {len(self.shapes)}",
                    "each tensor is added into the buffer of the parameter shard at the same index",
                    "pass one gradient per parameter shard, in the order given at construction "
                    "(None for a parameter without gradient)",
                )
            )
        for i, (g, shape) in enumerate(zip(grads, self.shapes)):
            if g is None:
                continue
            if torch.Size(g.shape) != shape:
                raise StreamingInputError(
                    rule_message(
                        f"{what}[{i}] has shape {tuple(g.shape)}, expected {tuple(shape)}",
                        "a gradient must match its parameter shard element for element; a "
                        "broadcast would silently corrupt the update",
                        "pass the LOCAL shard (for FSDP2 DTensors: p.grad._local_tensor), in "
                        "the parameter order given at construction",
                    )
                )
            if not g.is_floating_point():
                raise StreamingInputError(
                    rule_message(
                        f"{what}[{i}] has dtype {g.dtype}",
                        "gradients are real-valued",
                        "pass floating point gradient tensors",
                    )
                )


def check_storage(storage: str) -> None:
    """Raise unless ``storage`` names a place where gradient buffers can live."""
    if storage not in STORAGES:
        raise StreamingConfigError(
            rule_message(
                f"storage={storage!r} is unknown",
                "buffers live either next to the parameters or in host memory",
                f"use one of {list(STORAGES)}",
            )
        )


def zero_buffer(layout: GradLayout, *, host: bool, pin: bool) -> list[torch.Tensor]:
    """A zeroed full-gradient buffer: one tensor per shard, in host memory or next to each shard."""
    bufs = []
    for shape, device in zip(layout.shapes, layout.devices):
        t = torch.zeros(shape, dtype=layout.dtype, device=torch.device("cpu") if host else device)
        bufs.append(t.pin_memory() if pin else t)
    return bufs


class BufferPool(MemoryBudget):
    """Allocates zeroed full-gradient buffers under a byte budget, with exact accounting."""

    def __init__(self, layout: GradLayout, *, storage: str = "device", budget_bytes: int | None = None,
                 pinned: bool | None = None):
        check_storage(storage)
        super().__init__(layout.buffer_bytes, budget_bytes)
        self.layout = layout
        self.storage = storage
        self.pinned = storage == "host" and torch.cuda.is_available() if pinned is None else bool(pinned)

    @classmethod
    def for_learner(cls, layout: GradLayout, *, bucket_device: str = "auto", budget_bytes: int | None = None) -> "BufferPool":
        """The pool of a learner's group buckets, placed and priced by ``bucket_memory`` (point 5)."""
        accelerator = any(d.type != "cpu" for d in layout.devices)
        mem = bucket_memory(layout.numel, bucket_device=bucket_device, accelerator=accelerator,
                            elem_bytes=torch.empty((), dtype=layout.dtype).element_size())
        return cls(layout, storage=mem.storage, budget_bytes=budget_bytes, pinned=mem.pinned)

    @property
    def host_peak_bytes(self) -> int:
        """Peak bytes of this pool held in host memory (0 when buckets sit next to the parameters)."""
        return self.peak_bytes if self.storage == "host" else 0

    def allocate(self, owner: Hashable, *, on_param_device: bool = False) -> list[torch.Tensor]:
        """A zeroed buffer (one tensor per shard) charged to ``owner``'s reservation."""
        self.charge(owner)
        host = self.storage == "host" and not on_param_device
        return zero_buffer(self.layout, host=host, pin=self.pinned and not on_param_device)


class _Side:
    """The copy stream of host<->accelerator transfers (point 6); on a CPU every call is a no-op, so the
    host path runs the same code with or without an accelerator."""

    def __init__(self, device: torch.device | None):
        self.stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None

    @contextlib.contextmanager
    def copying(self):
        """Work issued inside runs on the side stream, after everything queued so far on the compute stream."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # the gradient is written first
        with torch.cuda.stream(self.stream):
            yield

    def event(self):
        """An event marking the copies issued so far on the side stream (None on a CPU)."""
        return None if self.stream is None else self.stream.record_event()


def _synchronize(event) -> None:
    if event is not None:
        event.synchronize()


def _accelerator(tensors) -> torch.device | None:
    return next((t.device for t in tensors if t is not None and t.device.type != "cpu"), None)


def _into_host_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor | None], alpha: float, accumulate: bool) -> None:
    """Host ``dst`` (+)= alpha * ``src``: each shard is copied device->host on the side stream into pinned
    staging (or straight into ``dst`` for a plain copy) and read by the CPU only after its event completed;
    shard i+1's copy runs while the CPU adds shard i. ``src`` stays alive until then (we return after)."""
    if all(s is None or s.device.type == "cpu" for s in src):
        _local_axpy_(dst, src, alpha, accumulate)
        return
    side = _Side(_accelerator(src))
    pending = None
    for d, s in zip(dst, src):
        if s is None:
            if not accumulate:
                d.zero_()
            continue
        if s.device.type == "cpu":
            staged = s
        elif not accumulate and s.dtype == d.dtype:
            staged = None
            with side.copying():
                d.copy_(s, non_blocking=True)  # d is pinned: an asynchronous device->host copy
        else:
            with side.copying():
                staged = torch.empty(s.shape, dtype=s.dtype, pin_memory=True)
                staged.copy_(s, non_blocking=True)
        _finish_host(pending, alpha, accumulate)
        pending = (d, staged, side.event())
    _finish_host(pending, alpha, accumulate)
    _synchronize(side.event())  # every direct copy into dst has landed


def _finish_host(pending, alpha: float, accumulate: bool) -> None:
    if pending is None:
        return
    d, staged, event = pending
    _synchronize(event)  # the device->host copy is complete before the CPU reads it
    if staged is None:
        return
    if not accumulate:
        d.copy_(staged)
        if alpha != 1.0:
            d.mul_(alpha)
    else:
        d.add_(staged, alpha=alpha)  # in the promoted dtype, one rounding into d (point 7)


def _local_axpy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor | None], alpha: float, accumulate: bool) -> None:
    """``dst`` (+)= alpha * ``src`` where every shard of ``src`` sits on its ``dst`` shard's device: one
    multi-tensor call each (point 8) instead of a Python loop of per-shard adds."""
    ds = [d for d, s in zip(dst, src) if s is not None]
    ss = [s for s in src if s is not None]
    if not accumulate:
        zeros = [d for d, s in zip(dst, src) if s is None]
        if zeros:
            torch._foreach_zero_(zeros)
        if ds:
            torch._foreach_copy_(ds, ss)
            if alpha != 1.0:
                torch._foreach_mul_(ds, alpha)
    elif ds:
        torch._foreach_add_(ds, ss, alpha=alpha)


def _into_device_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor | None], alpha: float) -> None:
    """Accelerator ``dst`` += alpha * ``src``: host shards travel host->device on the side stream; the compute
    stream waits for each copy's event before its add; on return every copy has completed, so the host
    buffers may be reused or freed."""
    staging = any(s is not None and s.device.type == "cpu" for s in src)
    if not staging and all(s is None or s.device == d.device for d, s in zip(dst, src)):
        _local_axpy_(dst, src, alpha, accumulate=True)
        return
    side = _Side(_accelerator(dst) if staging else None)  # device buckets: no side stream, no copy
    for d, s in zip(dst, src):
        if s is None:
            continue
        if side.stream is not None and s.device.type == "cpu":
            with side.copying():
                s = s.to(d.device, non_blocking=True)
            compute = torch.cuda.current_stream(d.device)
            compute.wait_event(side.event())
            s.record_stream(compute)  # allocated on the side stream, consumed on the compute stream
        s = s.to(device=d.device)  # the add promotes and rounds once into d (point 7)
        d.add_(s) if alpha == 1.0 else d.add_(s, alpha=alpha)
    _synchronize(side.event())


def axpy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor | None], alpha: float) -> None:
    """dst += alpha * src, shard by shard (None entries of ``src`` are zero gradients)."""
    if alpha == 0.0:
        return
    if dst and dst[0].device.type == "cpu":
        _into_host_(dst, src, alpha, accumulate=True)
    else:
        _into_device_(dst, src, alpha)


def copy_into_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor | None]) -> None:
    """dst = src, shard by shard (None entries become zeros)."""
    if dst and dst[0].device.type == "cpu":
        _into_host_(dst, src, 1.0, accumulate=False)
        return
    for d, s in zip(dst, src):
        if s is None:
            d.zero_()
        else:
            d.copy_(s, non_blocking=s.device.type == "cpu" and s.is_pinned())  # same stream: the reader waits
