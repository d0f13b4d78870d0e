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
   channel through verl's public surface.
"""

from __future__ import annotations

import time
from typing import Callable


class TrajectoryNeverArrived(RuntimeError):
    pass


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

    @property
    def done(self) -> bool:
        return len(self.seen) >= self.expected

    def _snapshot(self) -> dict:
        listing = self.kv_list(self.partition) or {}
        return listing.get(self.partition, listing) if isinstance(listing, dict) else {}

    def poll(self) -> list[tuple[str, dict]]:
        """New finished trajectories of this batch (possibly none)."""
        new = []
        for key, tag in self._snapshot().items():
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
        return new
