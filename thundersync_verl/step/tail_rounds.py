"""The trainer side of tail batching (``thundersync.tail``): each round's prompts, the queue, the aborts.

Why:
1. Each step launches ``ceil(eta x P)`` prompt groups for a batch of ``P = data.train_batch_size``
   (``core/tail_policy.py`` decides which: pinned and queued prompts first, then fresh ones). Fresh prompts
   come from verl's dataloader a whole batch at a time (``draw``); those a round does not take wait in
   ``leftover`` for the next, so none is skipped.
2. The streamed step keeps the first P groups to complete (``step/tail_gate.py``) and reports the others.
   Those still running are aborted through ``envs/abort.py`` (the registry their agent loops ask), and
   every dropped prompt is queued again with its deferral count: a later round runs it as a new group at
   the weights of then, so nothing trained is stale and no prompt is lost or trained twice.
3. What an aborted group left in the TransferQueue (trajectories that landed, its prompt's record, and
   what its agent loops still write before they stop) is cleared by a sweep at every settle: a prompt is
   forgotten once its record says its agent loops have ended.
4. The queue, the leftover prompts and the draw counter are the run's state (``state_dict``, saved with
   the checkpoint): a queued prompt is named by its dataset index (``extra_info.index``), so a resumed run
   reads it from the dataset again (``refetch``).
"""

from __future__ import annotations

import uuid
from typing import Callable

import ray

from thundersync_verl import verl_adapter as va
from thundersync_verl.core.tail_policy import Deferred, TailQueue, launch_size
from thundersync_verl.step.tail_gate import TailRound
from thundersync_verl.step.trajectory_source import partition_records

TERMINAL = ("failure", "finished")  # a prompt record's status once its agent loops have all ended


class TailRounds:
    """One per run (module docstring). ``registry``: the abort registry actor (``envs/abort.start_registry``)."""

    def __init__(self, cfg, p: int, registry=None):
        self.p, self.launch_n = p, launch_size(cfg.eta, p)
        self.queue = TailQueue(cfg.max_deferrals, cfg.rounds)
        self.registry = registry
        self.rows: dict[str, object] = {}  # queued and leftover prompt key -> its one-row batch
        self.index_of: dict[str, object] = {}  # ... -> its dataset index (extra_info.index), for a resume
        self.leftover: list[str] = []  # drawn from the dataloader, not launched yet, in draw order
        self.serial = 0  # prompts drawn so far: a prompt key is "<serial>"
        self.launched: dict[str, Deferred] = {}  # this round: uid -> (prompt key, deferrals, first step)
        self.to_clear: set[str] = set()  # aborted prompt uids whose TransferQueue records are not all gone
        self._step_figures: dict = {}

    # ----- a round ---------------------------------------------------------------------------
    def next_round(self, draw: Callable[[], object], step: int):
        """``(batch, TailRound)``: this round's prompts as one batch (new uids) and what the streamed step needs."""
        plan = self.queue.plan(self.launch_n, self.p)
        while len(self.leftover) < plan.fresh:
            for row in va.batch_rows(draw()):
                key = str(self.serial)
                self.serial += 1
                self.rows[key], self.index_of[key] = row, va.row_dataset_index(row)
                self.leftover.append(key)
        fresh, self.leftover = self.leftover[:plan.fresh], self.leftover[plan.fresh:]
        entries = list(plan.queued) + [Deferred(key, 0, step) for key in fresh]
        uids = [str(uuid.uuid4()) for _ in entries]
        self.launched = dict(zip(uids, entries))
        batch = va.join_rows([self.rows[e.prompt] for e in entries], uids, step)
        self._step_figures = {"launched": len(entries), "pinned": plan.pinned, "queued_taken": len(plan.queued)}
        return batch, TailRound(p=self.p, pinned=uids[:plan.pinned], on_abort=self.abort)

    def abort(self, uids: list[str]) -> None:
        """The streamed step's places are full: these groups' agent loops stop at their next call."""
        self.to_clear.update(uids)
        if self.registry is not None:
            ray.get(self.registry.add.remote(list(uids)))

    def settle(self, kept: dict, dropped: list, step: int, tq=None) -> dict:
        """After the step: queue the dropped prompts again, forget the kept ones, sweep the TransferQueue.
        Returns the step's ``thundersync/tail/*`` metrics."""
        for uid in dropped:
            e = self.launched[uid]
            self.queue.requeue(e.prompt, e.aborted, e.first_step, ran=True)
        self.to_clear.update(dropped)
        trained = [self.launched[uid] for uid in kept]
        for e in trained:
            self.rows.pop(e.prompt, None)
            self.index_of.pop(e.prompt, None)
        self.launched = {}
        cleared = self.sweep(tq) if tq is not None else 0
        delays = [step - e.first_step for e in trained]
        return {f"thundersync/tail/{k}": v for k, v in {
            **self._step_figures, "kept": len(trained), "dropped": len(dropped), "queue": len(self.queue.items),
            "leftover": len(self.leftover), "deferred_kept_share": sum(e.aborted > 0 for e in trained) / max(len(trained), 1),
            "delay_steps_mean": sum(delays) / max(len(delays), 1), "delay_steps_max": max(delays, default=0),
            "tq_keys_cleared": cleared}.items()}

    def sweep(self, tq, partition: str = "train") -> int:
        """Clear every TransferQueue record of an aborted prompt; forget a prompt once its agent loops ended."""
        if not self.to_clear:
            return 0
        records = partition_records(tq.kv_list(partition), partition)
        keys = [k for k in records if k.split("_")[0] in self.to_clear]
        ended = [k for k in keys if "_" not in k and (records[k] or {}).get("status") in TERMINAL]
        if keys:
            tq.kv_clear(keys=keys, partition_id=partition)
        self.to_clear.difference_update(ended)
        if ended and self.registry is not None:
            ray.get(self.registry.discard.remote(ended))
        return len(keys)

    # ----- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        waiting = [e.prompt for e in self.queue.items] + self.leftover
        return {"queue": self.queue.state_dict(), "leftover": list(self.leftover), "serial": self.serial,
                "index_of": {key: self.index_of[key] for key in waiting}}

    def load_state_dict(self, state: dict, refetch: Callable[[list], list]) -> None:
        """Restore the queue and the leftover prompts; their rows are read from the dataset (``refetch``: dataset
        indices -> one-row batches)."""
        self.queue = TailQueue.from_state(state["queue"])
        self.leftover, self.serial = list(state["leftover"]), int(state["serial"])
        self.index_of = dict(state["index_of"])
        keys = [e.prompt for e in self.queue.items] + self.leftover
        self.rows = dict(zip(keys, refetch([self.index_of[k] for k in keys]))) if keys else {}
