"""The gradient tensors of one streamed batch: the batch gradient and keyed buffers.

Why:
1. The ledger (ledger.py) decides which buffers exist and what each one is for; this class
   only holds the tensors behind those keys and does the arithmetic on them (axpy and copy),
   so every tensor the accumulator owns is reachable from one place and memory can be
   checked by walking it.
2. Buffers are keyed by (owner, name) exactly as the ledger records them: dropping an owner
   here mirrors releasing it there. A buffer is created only after the ledger has charged it
   to its owner's reservation (folding.py does both, in that order).
3. The batch gradient lives next to the parameters (it is written into ``.grad`` at the
   barrier); the other buffers live where ``storage`` says ("device", or pinned "host").
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from thundersync_verl.core.buffers import GradLayout, axpy_, check_storage, copy_into_, zero_buffer
from thundersync_verl.core.errors import StreamingStateError, rule_message

Buffer = list[torch.Tensor]


class GradientBuffers:
    """The batch gradient plus named full-gradient buffers per owner."""

    def __init__(self, layout: GradLayout, *, storage: str = "device"):
        check_storage(storage)
        self.layout = layout
        self.storage = storage
        self.pinned = storage == "host" and torch.cuda.is_available()
        self._batch: Buffer | None = None
        self._held: dict[Hashable, dict[Hashable, Buffer]] = {}

    # ----- the batch gradient ---------------------------------------------------------------
    @property
    def batch(self) -> Buffer | None:
        """The accumulated (not yet normalised) batch gradient, None between batches."""
        return self._batch

    def open_batch(self) -> None:
        self._batch = zero_buffer(self.layout, host=False, pin=False)
        self._held = {}

    def close_batch(self) -> None:
        self._batch, self._held = None, {}

    def add_to_batch(self, grads: Sequence[torch.Tensor | None], alpha: float) -> None:
        """batch += alpha * grads."""
        axpy_(self._open_batch(), grads, alpha)

    def fold(self, owner: Hashable, name: Hashable, coef: float) -> None:
        """batch += coef * buffer (owner, name)."""
        axpy_(self._open_batch(), self.held(owner)[name], coef)

    def _open_batch(self) -> Buffer:
        if self._batch is None:
            raise StreamingStateError(
                rule_message(
                    "the batch gradient is not allocated",
                    "gradients are added only between begin_batch and the barrier",
                    "call begin_batch first",
                )
            )
        return self._batch

    # ----- keyed buffers --------------------------------------------------------------------
    def allocate(self, owner: Hashable, name: Hashable) -> None:
        """A zeroed buffer under (owner, name); the ledger has charged it already."""
        held = self._held.setdefault(owner, {})
        assert name not in held, (owner, name)
        held[name] = zero_buffer(self.layout, host=self.storage == "host", pin=self.pinned)

    def add(self, owner: Hashable, name: Hashable, grads: Sequence[torch.Tensor | None], alpha: float) -> None:
        """buffer (owner, name) += alpha * grads."""
        axpy_(self._held[owner][name], grads, alpha)

    def copy_in(self, owner: Hashable, name: Hashable, grads: Sequence[torch.Tensor | None]) -> None:
        """buffer (owner, name) = grads."""
        copy_into_(self._held[owner][name], grads)

    def held(self, owner: Hashable) -> dict[Hashable, Buffer]:
        """``owner``'s buffers by name, in creation order."""
        return dict(self._held.get(owner, {}))

    def drop(self, owner: Hashable) -> None:
        self._held.pop(owner, None)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held: the batch gradient's shards, then each buffer's."""
        out = list(self._batch or [])
        for bufs in self._held.values():
            for buf in bufs.values():
                out += buf
        return out
