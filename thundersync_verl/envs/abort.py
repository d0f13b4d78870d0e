"""Aborting a prompt group's agent loops: the trainer names the groups, each agent loop stops at its next turn.

Why:
1. Tail batching (``thundersync.tail``) closes a step's batch on its first complete groups; the groups
   still running are aborted so that their rollout slots serve the next round. verl's agent-loop
   worker runs each sample as a task of its own with no handle the trainer can reach, so the abort
   is cooperative: the trainer adds the groups' prompt ids to ``AbortRegistry`` (a named Ray actor),
   and an agent loop asks it before each generate call and each tool call (``AbortCheck``), one actor
   call each, only in runs with tail batching on.
2. An aborted agent loop raises ``GroupAborted``: verl's worker then tags the prompt ``failure`` and
   puts nothing of it in the batch (no token of an aborted trajectory reaches the learner; the trainer
   clears what had landed and requeues the prompt). verl logs a session error with its traceback for
   every such loop; ``quiet_aborted_sessions`` keeps those records out of the log, as an abort is the
   policy working, not a failure.
3. A generate call already on the server finishes first (the CPU backends cannot cut one short); the
   loop stops before its next call.
"""

from __future__ import annotations

import logging

REGISTRY_NAME = "thundersync_tail_aborts"


class GroupAborted(RuntimeError):
    """This prompt's group was aborted by tail batching: its batch closed without it (it is queued again)."""


class AbortRegistry:
    """The prompt ids aborted and not yet cleared (a named Ray actor, made by ``start_registry``)."""

    def __init__(self):
        self.uids: set[str] = set()

    def add(self, uids: list[str]) -> None:
        self.uids.update(uids)

    def discard(self, uids: list[str]) -> None:
        self.uids.difference_update(uids)

    def is_aborted(self, uid: str) -> bool:
        return uid in self.uids


def start_registry():
    """The run's registry actor (get-or-create by name: one per run, whatever restarts the trainer)."""
    import ray

    return ray.remote(num_cpus=0)(AbortRegistry).options(name=REGISTRY_NAME, get_if_exists=True).remote()


class AbortCheck:
    """An agent loop's question before each call (module docstring, point 1); free when tail batching is off."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._registry = None

    async def raise_if_aborted(self, uid) -> None:
        if not self.enabled or uid is None:
            return
        if self._registry is None:
            import ray

            self._registry = ray.get_actor(REGISTRY_NAME)
        if await self._registry.is_aborted.remote(str(uid)):
            raise GroupAborted(f"prompt {uid}: aborted by thundersync.tail (its batch closed on the first complete "
                               "groups); the prompt runs again in a later round")


class _DropAborted(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, GroupAborted)


def quiet_aborted_sessions(logger_names: list[str]) -> None:
    """Keep verl's per-session error records of aborted agent loops out of the log (point 2)."""
    for name in logger_names:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropAborted) for f in log.filters):
            log.addFilter(_DropAborted())
