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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

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

    def __init__(self, layout: GradLayout, *, storage: str = "device", budget_bytes: int | None = None):
        check_storage(storage)
        super().__init__(layout.buffer_bytes, budget_bytes)
        self.layout = layout
        self.storage = storage
        self.pinned = storage == "host" and torch.cuda.is_available()

    def allocate(self, owner: Hashable, *, on_param_device: bool = False) -> list[torch.Tensor]:
        """A zeroed buffer (one tensor per shard) charged to ``owner``'s reservation."""
        self.charge(owner)
        host = self.storage == "host" and not on_param_device
        return zero_buffer(self.layout, host=host, pin=self.pinned and not on_param_device)


def _async_ok(dst: torch.Tensor) -> bool:
    """Non-blocking copies are safe only INTO device memory: the consumer runs on the same stream.

    A non-blocking device-to-host copy returns before the data lands, and the CPU would then
    read it too early; those copies stay blocking.
    """
    return dst.device.type != "cpu"


def axpy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor | None], alpha: float) -> None:
    """dst += alpha * src, shard by shard (None entries of ``src`` are zero gradients)."""
    if alpha == 0.0:
        return
    for d, s in zip(dst, src):
        if s is None:
            continue
        s = s.to(device=d.device, dtype=d.dtype, non_blocking=_async_ok(d))
        if alpha == 1.0:
            d.add_(s)
        else:
            d.add_(s, alpha=alpha)


def copy_into_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor | None]) -> None:
    """dst = src, shard by shard (None entries become zeros)."""
    for d, s in zip(dst, src):
        if s is None:
            d.zero_()
        else:
            d.copy_(s, non_blocking=_async_ok(d))
