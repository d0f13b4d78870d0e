"""Tail batching in the streamed step: the batch closes on its first P complete groups.

Why:
1. The trainer launches more prompt groups than the batch needs (``thundersync.tail``); the batch is
   the pinned groups and the first free groups to complete, P in all (``core/tail_policy.py``). A
   group's fate is known only when its last trajectory lands, so this gate holds a group's landed
   trajectories until then: a kept group is handed to the planner whole (every row goes straight into
   the batch gradient, no bucket), a dropped one is never seen by the planner or the learner. Training
   nothing of a group before it is kept costs the overlap of its early rows, and buys exactness by
   construction: the update is verl's update of exactly the kept groups.
2. The planner's groups are the batch's P places, ``"00000000"``..., filled in completion order; each
   handed-on trajectory is named ``"<place>_<member>"`` (``alias``), members by sample index, as the
   deterministic gate names them. The planner's group sizes, its token count and its sequence count
   (the deferred normalisers) are therefore those of the P kept groups: the same sums as verl's update
   of that batch.
3. Once the free places are full, ``on_abort`` is called once with the free groups still running (the
   trainer aborts them and queues their prompts); groups that complete after that are dropped too and
   reported by ``dropped``. The step ends when every kept group has been handed on (``empty``), whatever
   the aborted groups still do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from thundersync_verl.core.tail_policy import TailBatch


@dataclass
class TailRound:
    """What a tail-batched step needs from the trainer: the batch's size in groups, the launched prompts that must
    be kept (pinned), and what to do with the free groups still running once the batch's places are full."""

    p: int
    pinned: list = field(default_factory=list)
    on_abort: Callable[[list[str]], None] | None = None


class TailGate:
    """Landed trajectories of kept groups, handed on whole as their group completes (module docstring)."""

    def __init__(self, uids: list[str], n_per_prompt: int, p: int, pinned: list[str] = (),
                 on_abort: Callable[[list[str]], None] | None = None):
        self.n = n_per_prompt
        self.batch = TailBatch(uids, pinned, p)
        self.on_abort = on_abort
        self.aborted: list[str] = []  # free groups still running when the places filled (reported once)
        self._abort_reported = False
        self._landed: dict[str, dict[str, tuple[str, dict]]] = {uid: {} for uid in uids}
        self._order: list[tuple[str, dict]] = []
        self._cursor = 0
        self.alias: dict[str, str] = {}
        self.places: dict[str, str] = {}  # kept uid -> its place ("00000003")

    @property
    def empty(self) -> bool:
        """Every kept group completed and handed on: the batch is whole."""
        return self.batch.closed and self._cursor >= len(self._order)

    @property
    def dropped(self) -> list[str]:
        """Launched groups that are not in the batch: aborted while running, or completed too late."""
        return self.batch.to_abort()

    def add(self, landed: list[tuple[str, dict]]) -> None:
        for key, tag in landed:
            uid, session = key.split("_")[:2]
            members = self._landed.get(uid)
            if members is None or session in members or not 0 <= int(session) < self.n:
                raise ValueError(f"trajectory {key}: not an expected sample of this batch, or landed twice")
            members[session] = (key, tag)
            if len(members) == self.n and self.batch.complete(uid):
                self._hand_on(uid)
        if self.batch.full and not self._abort_reported:
            self._abort_reported = True
            self.aborted = [uid for uid in self.batch.to_abort() if len(self._landed[uid]) < self.n]
            if self.on_abort is not None and self.aborted:
                self.on_abort(list(self.aborted))

    def _hand_on(self, uid: str) -> None:
        place = f"{len(self.places):08d}"
        self.places[uid] = place
        members = self._landed[uid]
        for rank, session in enumerate(sorted(members, key=int)):
            key, tag = members[session]
            self.alias[key] = f"{place}_{rank:04d}"
            self._order.append((key, tag))

    def take(self) -> list[tuple[str, dict]]:
        """Every trajectory of the kept groups not handed on yet."""
        out, self._cursor = self._order[self._cursor:], len(self._order)
        return out
