"""The byte budget of the gradient buffers, kept without touching a tensor.

Why:
1. Every buffer is a full copy of the rank's LOCAL gradient shards, so memory is counted in
   buffers of one fixed size. The decisions (may this group start, must it wait) need only
   those counts, never the tensors: a planner that holds no gradient takes the same decisions
   as the learner that does.
2. Decisions use RESERVATIONS: an owner (the batch, a group, a trajectory whose reward is
   unknown) reserves the most buffers it can ever need before its first buffer exists. A
   reward that arrives later can then never fail for lack of memory, and a full budget makes
   new groups wait instead of taking an inexact shortcut. Charging a buffer beyond its owner's
   reservation is an accounting fault and raises.
3. Accounting is exact (bytes in use, reserved bytes, open groups, and their peaks), so the
   memory cost is measured, not guessed.
"""

from __future__ import annotations

from typing import Hashable

from thundersync_verl.core.errors import AccumulatorBudgetError, StreamingConfigError, rule_message


class MemoryBudget:
    """Reservations and charged buffers per owner, under an optional byte budget."""

    def __init__(self, buffer_bytes: int, budget_bytes: int | None = None):
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
            raise StreamingConfigError(
                rule_message(
                    f"budget_bytes must be a positive int or None (got {budget_bytes!r})",
                    "the budget bounds the memory held by open groups",
                    "pass a byte count, e.g. 8 * layout.buffer_bytes, or None for no limit",
                )
            )
        self.buffer_bytes = int(buffer_bytes)
        self.budget_bytes = budget_bytes
        self._reserved: dict[Hashable, int] = {}  # owner -> buffers reserved
        self._charged: dict[Hashable, int] = {}  # owner -> buffers that exist
        self._group_owners: set[Hashable] = set()
        self.bytes_in_use = 0
        self.peak_bytes = 0
        self.peak_open_groups = 0

    # ----- accounting -------------------------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values()) * self.buffer_bytes

    @property
    def open_groups(self) -> int:
        return sum(1 for o in self._group_owners if o in self._reserved)

    def reserved_buffers(self, owner: Hashable) -> int:
        return self._reserved.get(owner, 0)

    def reset_peaks(self) -> None:
        """Restart the peaks from the current usage (e.g. per batch)."""
        self.peak_bytes = self.bytes_in_use
        self.peak_open_groups = self.open_groups

    # ----- reservations -----------------------------------------------------------------
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

    # ----- buffers ----------------------------------------------------------------------
    def charge(self, owner: Hashable) -> None:
        """Count one more buffer of ``owner`` against its reservation."""
        if self._charged.get(owner, 0) >= self._reserved.get(owner, 0):
            raise AccumulatorBudgetError(
                rule_message(
                    f"{owner!r} allocates more buffers than it reserved ({self._reserved.get(owner, 0)})",
                    "reservations are what keep the byte budget exact",
                    "this is an internal accounting fault; report it with the call sequence",
                )
            )
        self._charged[owner] = self._charged.get(owner, 0) + 1
        self.bytes_in_use += self.buffer_bytes
        self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)

    def release(self, owner: Hashable) -> None:
        """Forget every buffer and reservation of ``owner`` (its tensors must be dropped)."""
        self.bytes_in_use -= self._charged.pop(owner, 0) * self.buffer_bytes
        self._reserved.pop(owner, None)
        self._group_owners.discard(owner)

    def release_all(self) -> None:
        for owner in list(self._reserved) + list(self._charged):
            self.release(owner)
