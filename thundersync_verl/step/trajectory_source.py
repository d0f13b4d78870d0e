"""Finished trajectories of the current batch, as they land in verl's TransferQueue.

1. verl's agent-loop workers put every trajectory into the TransferQueue the moment its
   reward is computed (key ``{uid}_{session}_{i}``, tag status ``success``), before its group
   is complete. This source reports exactly those, once each, in arrival order.
2. A prompt whose agent loop failed is tagged ``failure``: that trajectory's reward will
   never come, so the source raises (naming the prompt) instead of waiting forever; a
   trajectory that does not land within ``timeout_s`` raises too. Either way the caller has
   not stepped the optimizer: nothing is half-applied.
3. The source only polls (one ``kv_list`` call, a controller RPC); waiting, its interval and the
   timeout belong to the one streamed step (``streamed_step.py``): the agent loop exposes no push
   channel through verl's public surface. A listing returns the whole partition, so its cost grows with
   the batch: the source times each one (``last_listing_s``) for the step to space them by, and skips the
   keys it has seen before looking at anything else.
4. ``BatchOrderGate`` (``thundersync.deterministic``): a streamed step sums its gradients in the order
   trajectories land, and floating-point addition is not associative, so two runs on the same
   trajectories (a run and its resumed continuation) differ in the last bits. The gate hands landed
   trajectories on in the batch's own order (prompt as the dataloader gave it, then sample index) and
   in blocks of exactly ``block`` (the last one may be shorter), so every chunk, bucket and fold, and
   so every sum, is the same whatever the timing. The price is overlap: a trajectory that lands early
   waits for those before it.
5. ``ArrivalSource`` is what one streamed step polls: the trajectories and, for OPD, the scored turns, with the
   gate (deterministic order, or the tail gate) in between.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable


class TrajectoryNeverArrived(RuntimeError):
    pass


def partition_records(listing, partition: str) -> dict:
    """A TransferQueue ``kv_list`` answer as {key: tag} of one partition (it answers {partition: {...}} or {...})."""
    listing = listing or {}
    return listing.get(partition, listing) if isinstance(listing, dict) else {}


class TrajectorySource:
    def __init__(self, kv_list: Callable[[str], dict], uids: list[str], n_per_prompt: int, *, partition: str = "train",
                 timeout_s: float = 600.0):
        self.kv_list = kv_list
        self.uids = set(uids)
        self.expected = len(uids) * n_per_prompt
        self.partition = partition
        self.timeout_s = timeout_s
        self.seen: dict[str, dict] = {}
        self.arrival_time: dict[str, float] = {}
        self.listings = 0  # kv_list calls made (each one a controller RPC)
        self.last_listing_s = 0.0  # wall seconds of the last listing (the RPC and reading it), for the step's pause
        self.listing_s = 0.0  # ... of every listing so far (the driver's polling cost per step)

    @property
    def done(self) -> bool:
        return len(self.seen) >= self.expected

    def _snapshot(self) -> dict:
        self.listings += 1
        return partition_records(self.kv_list(self.partition), self.partition)

    def poll(self) -> list[tuple[str, dict]]:
        """New finished trajectories of this batch (possibly none)."""
        t0 = time.time()
        new = []
        for key, tag in self._snapshot().items():
            if key in self.seen:
                continue
            uid = key.split("_")[0]
            if uid not in self.uids:
                continue
            status = tag.get("status")
            if tag.get("is_prompt", False):
                if status == "failure":
                    raise TrajectoryNeverArrived(
                        f"prompt {uid}: its agent loop failed, so its trajectories and rewards will never arrive. "
                        "The optimizer step of this batch was NOT taken. See the AgentLoopWorker log for the cause "
                        "(a crashing tool or verifier is scored 0 by the task; this is a failure of the loop itself)."
                    )
                continue
            if status == "success" and key not in self.seen:
                self.seen[key] = tag
                self.arrival_time[key] = time.time()
                new.append((key, tag))
        self.last_listing_s = time.time() - t0
        self.listing_s += self.last_listing_s
        return new


class BatchOrderGate:
    """Landed trajectories, handed on in batch order and whole blocks (module docstring, point 4).

    The order is the batch's prompts as the dataloader gave them; within a prompt's group, the
    members sorted by ``content`` (key -> a sortable value, e.g. the tokens) when given, else by
    sample index. Content, because which sample index receives which of a group's answers depends on
    the order the n identical first requests were served, and the step must not. ``alias`` names each
    handed-on trajectory by its place in that order: the planner ranks groups and members by their
    ids, and verl's prompt ids are random, so the planner is given these names instead.
    """

    def __init__(self, uids: list[str], n_per_prompt: int, block: int,
                 content: Callable[[list[str]], dict[str, Any]] | None = None):
        if block < 1:
            raise ValueError(f"BatchOrderGate: block must be >= 1, got {block}")
        self.uids, self.n, self.block, self.content = list(uids), n_per_prompt, block, content
        self._unseen = {(uid, str(s)) for uid in uids for s in range(n_per_prompt)}
        self._landed: dict[str, dict[str, tuple[str, dict]]] = {uid: {} for uid in uids}  # uid -> session -> (key, tag)
        self._order: list[tuple[str, dict]] = []  # complete groups, in batch order, members sorted
        self._groups_ordered = 0
        self._cursor = 0  # entries of ``_order`` handed on
        self.alias: dict[str, str] = {}  # trajectory key -> its place in the order, "<group>_<member>" (zero-padded)

    @property
    def empty(self) -> bool:
        return self._groups_ordered == len(self.uids) and self._cursor >= len(self._order)

    def add(self, landed: list[tuple[str, dict]]) -> None:
        for key, tag in landed:
            uid, session = key.split("_")[:2]
            if (uid, session) not in self._unseen:
                raise ValueError(f"trajectory {key}: not an expected sample of this batch, or landed twice")
            self._unseen.discard((uid, session))
            self._landed[uid][session] = (key, tag)

    def take(self) -> list[tuple[str, dict]]:
        """The next block if every trajectory of it has landed (at the batch's end, what is left), else []."""
        while self._groups_ordered < len(self.uids) and len(self._landed[self.uids[self._groups_ordered]]) == self.n:
            members = self._landed.pop(self.uids[self._groups_ordered])
            entries = [members[s] for s in sorted(members, key=int)]
            if self.content is not None:
                value = self.content([k for k, _ in entries])
                entries.sort(key=lambda e: value[e[0]])  # stable: equal content keeps sample order
            for rank, (key, _) in enumerate(entries):
                self.alias[key] = f"{self._groups_ordered:08d}_{rank:04d}"
            self._order += entries
            self._groups_ordered += 1
        end = min(self._cursor + self.block, len(self._order))
        if self._cursor == end or (end - self._cursor < self.block and self._groups_ordered < len(self.uids)):
            return []
        block, self._cursor = self._order[self._cursor:end], end
        return block


@dataclass
class Arrivals:
    trajectories: list = field(default_factory=list)  # (key, tag)
    turns: list = field(default_factory=list)  # (OPDTurn, tag), OPD only

    def __bool__(self) -> bool:
        return bool(self.trajectories or self.turns)


class ArrivalSource:
    """The batch's trajectories and, for OPD, its scored turns, as they land (one poll, one timeout).

    ``done`` turns true once a poll STARTS with every trajectory landed: an agent loop publishes a
    trajectory's turns before the trajectory, so that poll still collects the last turns. With a
    ``gate`` (GRPO, ``thundersync.deterministic``) landed trajectories are handed on only when
    ``release`` is true and their block is whole; ``done`` then also waits for the gate to empty.
    """

    def __init__(self, trajectories: TrajectorySource, turns=None, gate: BatchOrderGate | None = None):
        self.trajectories, self.turns, self.gate = trajectories, turns, gate
        self.done = False

    def poll(self, release: bool = True) -> Arrivals:
        landed_before = self.trajectories.done
        turns = self.turns.poll() if self.turns is not None else []
        trajs = [] if landed_before else self.trajectories.poll()
        if self.gate is not None:
            self.gate.add(trajs)
            trajs = self.gate.take() if release else []
            landed_before = landed_before and self.gate.empty
        # a gate decides the end: the order gate empties once every trajectory landed, the tail gate once the kept
        # groups did (tail_gate.py point 3)
        self.done = landed_before if self.turns is not None else (
            self.trajectories.done if self.gate is None else self.gate.empty)
        return Arrivals(trajs, turns)

    def never_arrived(self) -> TrajectoryNeverArrived:
        src = self.trajectories
        missing = sorted(src.uids - {k.split("_")[0] for k in src.seen})
        return TrajectoryNeverArrived(
            f"{src.expected - len(src.seen)} trajectories of this batch did not arrive within {src.timeout_s:.0f}s "
            f"(prompts still open: {missing[:5]}). The optimizer step was NOT taken. Raise "
            "thundersync.trajectory_timeout_s if your tools or teacher are that slow, or check the rollout servers.")
