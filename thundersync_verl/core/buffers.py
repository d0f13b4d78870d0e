"""Gradient layout and the accumulator's memory manager.

Why:
1. Every accumulator buffer is a full copy of the rank's LOCAL gradient shards (P values):
   with k open groups and 2 buffers each the accumulator holds about (2k+1)·P values. The
   pool allocates buffers under a byte budget and keeps exact accounting (bytes in use,
   open groups, and their peaks) so the cost is measured, not guessed.
2. Budget decisions use RESERVATIONS: a group reserves the most buffers it can ever need
   when its first trajectory is admitted (2 for the affine path, one per distinct reward for
   buckets, one per member for the canonical order). A reward that arrives later can then
   never fail for lack of memory, and a full budget makes new groups wait instead of taking an
   inexact shortcut.
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

from .errors import AccumulatorBudgetError, StreamingConfigError, StreamingInputError, rule_message

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


class BufferPool:
    """Allocates zeroed full-gradient buffers under a byte budget, with exact accounting."""

    def __init__(self, layout: GradLayout, *, storage: str = "device", budget_bytes: int | None = None):
        if storage not in STORAGES:
            raise StreamingConfigError(
                rule_message(
                    f"storage={storage!r} is unknown",
                    "buffers live either next to the parameters or in host memory",
                    f"use one of {list(STORAGES)}",
                )
            )
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
            raise StreamingConfigError(
                rule_message(
                    f"budget_bytes must be a positive int or None (got {budget_bytes!r})",
                    "the budget bounds the memory held by open groups",
                    "pass a byte count, e.g. 8 * layout.buffer_bytes, or None for no limit",
                )
            )
        self.layout = layout
        self.storage = storage
        self.budget_bytes = budget_bytes
        self.pinned = storage == "host" and torch.cuda.is_available()
        self._reserved: dict[Hashable, int] = {}  # owner -> buffers reserved
        self._allocated: dict[Hashable, int] = {}  # owner -> buffers allocated
        self._group_owners: set[Hashable] = set()
        self.bytes_in_use = 0
        self.peak_bytes = 0
        self.peak_open_groups = 0

    # ----- accounting -------------------------------------------------------------------
    @property
    def buffer_bytes(self) -> int:
        return self.layout.buffer_bytes

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values()) * self.buffer_bytes

    @property
    def open_groups(self) -> int:
        return sum(1 for o in self._group_owners if o in self._reserved)

    def reserved_buffers(self, owner: Hashable) -> int:
        return self._reserved.get(owner, 0)

    def fits(self, extra_buffers: int) -> bool:
        """Whether ``extra_buffers`` more reserved buffers stay within the budget."""
        if self.budget_bytes is None:
            return True
        return self.reserved_bytes + extra_buffers * self.buffer_bytes <= self.budget_bytes

    def check_fits(self, owner: Hashable, n_buffers: int) -> None:
        """Raise ``AccumulatorBudgetError`` unless ``n_buffers`` more buffers fit the budget."""
        if not self.fits(n_buffers):
            raise AccumulatorBudgetError(
                rule_message(
                    f"accumulator budget full: {owner!r} needs {n_buffers} buffer(s) of "
                    f"{self.buffer_bytes} bytes, {self.reserved_bytes} of {self.budget_bytes} bytes "
                    "are reserved",
                    "exactness forbids folding a group before its statistics are known, so a new "
                    "group can only start when memory for its buffers is available",
                    "let this trajectory wait until a group closes (follow rank_ready), or raise "
                    "budget_bytes",
                )
            )

    def reserve(self, owner: Hashable, n_buffers: int, *, is_group: bool) -> None:
        """Reserve ``n_buffers`` more buffers for ``owner``; raises if the budget is full."""
        self.check_fits(owner, n_buffers)
        self._reserved[owner] = self._reserved.get(owner, 0) + n_buffers
        if is_group:
            self._group_owners.add(owner)
        self.peak_open_groups = max(self.peak_open_groups, self.open_groups)

    # ----- allocation -------------------------------------------------------------------
    def _device_for(self, i: int) -> torch.device:
        return torch.device("cpu") if self.storage == "host" else self.layout.devices[i]

    def allocate(self, owner: Hashable, *, on_param_device: bool = False) -> list[torch.Tensor]:
        """A zeroed buffer (one tensor per shard) charged to ``owner``'s reservation."""
        if self._allocated.get(owner, 0) >= self._reserved.get(owner, 0):
            raise AccumulatorBudgetError(
                rule_message(
                    f"{owner!r} allocates more buffers than it reserved ({self._reserved.get(owner, 0)})",
                    "reservations are what keep the byte budget exact",
                    "this is an internal accounting fault; report it with the call sequence",
                )
            )
        bufs = []
        for i, shape in enumerate(self.layout.shapes):
            dev = self.layout.devices[i] if on_param_device else self._device_for(i)
            t = torch.zeros(shape, dtype=self.layout.dtype, device=dev)
            if self.pinned and dev.type == "cpu" and not on_param_device:
                t = t.pin_memory()
            bufs.append(t)
        self._allocated[owner] = self._allocated.get(owner, 0) + 1
        self.bytes_in_use += self.buffer_bytes
        self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)
        return bufs

    def release(self, owner: Hashable) -> None:
        """Free every buffer and reservation of ``owner`` (its tensors must be dropped)."""
        self.bytes_in_use -= self._allocated.pop(owner, 0) * self.buffer_bytes
        self._reserved.pop(owner, None)
        self._group_owners.discard(owner)

    def release_all(self) -> None:
        for owner in list(self._reserved) + list(self._allocated):
            self.release(owner)


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
