"""Aborting a prompt group's agent loops: the trainer names the groups, each agent loop stops within a round trip.

Why:
1. Tail batching (``thundersync.tail``) closes a step's batch on its first complete groups; the groups
   still running are aborted so that their rollout slots serve the next round. verl's agent-loop
   worker runs each sample as a task of its own with no handle the trainer can reach, so the abort
   is cooperative: the trainer adds the groups' prompt ids to ``AbortRegistry`` (a named Ray actor).
2. Each agent-loop process follows the registry with one long-poll call at a time (``AbortWatch``: the
   call returns when the aborted set changes), not one actor call per agent-loop call: asking before
   each generate and tool call cost the rollout host about 1 CPU-s a step at 80 trajectories (the
   registry's 0.5 s and as much again in the agent loops), on the core the agent loops and tools share.
3. An agent loop runs each generate and tool call through ``AbortCheck.unless_aborted``: an aborted
   group's loop raises ``GroupAborted`` before its next call, and a call in flight when the abort
   arrives is cancelled at once (the loop does not wait for it; a cancelled sandbox call is killed,
   ``envs/sandbox.py``). So a loop stops within one round trip of the abort, not at its next call.
   verl's client offers no cancel of a generate call on the server; on the CPU engine the loop names its
   group in the call (``ABORT_UID_KEY``, which verl's client passes through to the server) and the server
   follows the registry too (``abort_signal``): the request leaves the engine's batch at the next decode step.
   On vLLM/SGLang the call runs to its end in the engine and its answer is dropped. The abort is an
   optimisation only: whatever an aborted group's loops still land is cleared by the trainer
   (``step/tail_rounds.py`` point 3), never trained.
4. An aborted agent loop raises ``GroupAborted``: verl's worker then tags the prompt ``failure`` and
   puts nothing of it in the batch (no token of an aborted trajectory reaches the learner; the trainer
   clears what had landed and requeues the prompt). verl logs a session error with its traceback for
   every such loop; ``quiet_aborted_sessions`` keeps those records out of the log, as an abort is the
   policy working, not a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from typing import AsyncIterator, Awaitable, TypeVar

REGISTRY_NAME = "thundersync_tail_aborts"
ABORT_UID_KEY = "thundersync_abort_uid"  # generate kwarg: the group a call belongs to (servers that can stop one)
SERVER_SIDE_ABORT = ("hf_cpu",)  # rollout backends whose server stops an aborted group's call (point 3)
WATCH_TIMEOUT_S = 30.0  # a long-poll call returns after this long without a change (and is sent again)
RETRY_S = 0.5  # pause before the watch looks the registry up again after a failed call
logger = logging.getLogger(__name__)
T = TypeVar("T")


class GroupAborted(RuntimeError):
    """This prompt's group was aborted by tail batching: its batch closed without it (it is queued again)."""


class AbortRegistry:
    """The prompt ids aborted and not yet cleared (a named async Ray actor, made by ``start_registry``).

    ``epoch`` counts the changes; ``watch(epoch)`` answers once it differs from the caller's (point 2)."""

    def __init__(self):
        self.uids: set[str] = set()
        self.epoch = 0
        self._changed: asyncio.Event | None = None

    def _bump(self) -> None:
        self.epoch += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def add(self, uids: list[str]) -> None:
        self.uids.update(uids)
        self._bump()

    async def discard(self, uids: list[str]) -> None:
        self.uids.difference_update(uids)
        self._bump()

    async def watch(self, epoch: int, timeout_s: float = WATCH_TIMEOUT_S) -> tuple[int, list[str]]:
        """``(epoch, aborted uids)`` as soon as the epoch is not ``epoch`` (at once if it already is not), or
        after ``timeout_s`` unchanged."""
        if epoch == self.epoch:
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.epoch, sorted(self.uids)


def start_registry():
    """The run's registry actor (get-or-create by name: one per run, whatever restarts the trainer). Its name
    carries the job's id (``backends/mailbox.job_scoped``): jobs sharing a Ray namespace keep their own."""
    import ray

    from thundersync_verl.backends.mailbox import job_scoped

    return ray.remote(num_cpus=0)(AbortRegistry).options(name=job_scoped(REGISTRY_NAME), get_if_exists=True).remote()


class AbortWatch:
    """One agent-loop process's view of the registry (point 2): one per event loop, shared by its agent loops."""

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AbortWatch]" = weakref.WeakKeyDictionary()

    def __init__(self):
        self._registry = None
        self.epoch = -1
        self.uids: frozenset[str] = frozenset()
        self._waiters: dict[str, set[asyncio.Future]] = {}
        self._task: asyncio.Task | None = None
        self._first: asyncio.Future | None = None

    @classmethod
    def current(cls) -> "AbortWatch":
        loop = asyncio.get_running_loop()
        watch = cls._by_loop.get(loop)
        if watch is None:
            watch = cls._by_loop[loop] = cls()
        return watch

    async def ready(self) -> "AbortWatch":
        """The watch with the registry's set read at least once (the first caller reads it; the others wait)."""
        if self._task is not None and not self._task.done():
            return self
        if self._first is None or self._first.done():
            self._first = asyncio.ensure_future(self._read(-1, 0.0))
        try:
            epoch, uids = await asyncio.shield(self._first)  # a failure here reaches the agent loop (no registry)
        except BaseException:
            self._first = None
            raise
        if self._task is None or self._task.done():
            self._update(epoch, uids)
            self._task = asyncio.ensure_future(self._follow())
        return self

    async def _read(self, epoch: int, timeout_s: float):
        if self._registry is None:
            import ray

            from thundersync_verl.backends.mailbox import job_scoped

            self._registry = ray.get_actor(job_scoped(REGISTRY_NAME))
        ref = self._registry.watch.remote(epoch, timeout_s)
        try:
            return await ref
        except asyncio.CancelledError:  # its loop is closing: Ray would keep the loop until the reply (_cancel_poll)
            _cancel_poll(ref)
            raise

    async def _follow(self) -> None:
        try:
            await self._follow_registry()
        finally:  # its loop is closing (asyncio.run cancels what is left): hold nothing of that loop, so the loop
            self._task = self._first = None  # and this watch (``_by_loop``'s value) can be collected
            self._waiters.clear()

    async def _follow_registry(self) -> None:
        failing = False
        while True:
            try:
                epoch, uids = await self._read(self.epoch, WATCH_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the registry restarted with the trainer (or is gone): look it up again
                if not failing:
                    logger.warning("tail batching: the abort registry did not answer (%s); looking it up again "
                                   "every %.1f s", exc, RETRY_S)
                failing, self._registry = True, None
                await asyncio.sleep(RETRY_S)
                continue
            failing = False
            self._update(epoch, uids)

    def _update(self, epoch: int, uids) -> None:
        self.epoch, self.uids = epoch, frozenset(uids)
        for uid in self.uids.intersection(self._waiters):
            for fut in self._waiters.pop(uid):
                if not fut.done():
                    fut.set_result(None)

    def aborted(self, uid: str) -> asyncio.Future:
        """A future done once ``uid`` is seen aborted (call ``forget`` with it when no longer needed)."""
        fut = asyncio.get_running_loop().create_future()
        if uid in self.uids:
            fut.set_result(None)
        else:
            self._waiters.setdefault(uid, set()).add(fut)
        return fut

    def forget(self, uid: str, fut: asyncio.Future) -> None:
        waiting = self._waiters.get(uid)
        if waiting is not None:
            waiting.discard(fut)
            if not waiting:
                del self._waiters[uid]


def _cancel_poll(ref) -> None:
    """Cancel a long poll whose caller was cancelled: Ray keeps the awaiting loop in the call's completion callback
    until the reply comes, which an unchanged registry sends only after ``WATCH_TIMEOUT_S``; cancelled, it comes at
    once, so a closed loop and its watch are collected within a round trip."""
    import ray

    try:
        ray.cancel(ref)
    except Exception as exc:  # noqa: BLE001 - Ray shutting down: nothing left to hold the loop
        logger.debug("abort watch: cancelling the long poll failed: %s", exc)


class AbortCheck:
    """An agent loop's side of the abort (points 2-3); free when tail batching is off."""

    def __init__(self, enabled: bool, rollout_name: str = ""):
        self.enabled = enabled
        self.server_side = enabled and rollout_name in SERVER_SIDE_ABORT

    def server_kwargs(self, uid) -> dict:
        """What the loop adds to its generate call so that the server can stop it (point 3)."""
        return {ABORT_UID_KEY: str(uid)} if self.server_side and uid is not None else {}

    @staticmethod
    def _error(uid) -> GroupAborted:
        return GroupAborted(f"prompt {uid}: aborted by thundersync.tail (its batch closed on the first complete "
                            "groups); the prompt runs again in a later round")

    async def unless_aborted(self, uid, call: Awaitable[T]) -> T:
        """``await call``, unless the group is aborted before or while it runs: then the call is cancelled and
        ``GroupAborted`` raised (point 3)."""
        if not self.enabled or uid is None:
            return await call
        task = None
        try:
            async with abort_signal(uid) as stop:
                if not stop.done():  # not aborted already
                    task = asyncio.ensure_future(call)
                    await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if task is None:
                _close(call)  # never started: the group was aborted already, or the registry did not answer
            elif not task.done():
                task.cancel()  # the abort arrived first (or this loop itself is being cancelled)
        if task is not None and task.done():
            return task.result()  # finished before (or as) the abort arrived: the next call raises
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task  # let the cancelled call clean up (a sandbox call kills its process)
        raise self._error(uid)


@contextlib.asynccontextmanager
async def abort_signal(uid) -> AsyncIterator[asyncio.Future | None]:
    """A server's side (point 3): a future done once the group ``uid`` is aborted; None (never) without a uid."""
    if uid is None:
        yield None
        return
    watch, key = await AbortWatch.current().ready(), str(uid)
    stop = watch.aborted(key)
    try:
        yield stop
    finally:
        watch.forget(key, stop)
        stop.cancel()


def _close(call) -> None:
    if asyncio.iscoroutine(call):
        call.close()  # never awaited: no "coroutine was never awaited" warning


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
