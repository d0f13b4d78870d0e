"""The agent-loop side of per-turn OPD: each finished turn scored by the teacher and published.

Why:
1. verl's agent-loop worker puts a trajectory into the TransferQueue when it ENDS. For OPD in
   thundersync mode each turn is scored earlier: an agent loop hands every finished turn to
   ``AgentTurnTeacher``, which scores the turn's causal prefix with verl's teacher client while the
   next tool call runs and puts the scored turn into the TransferQueue partition ``opd_turns``
   (key ``{trajectory key}_t{j}``). The trainer side (``algos/opd/opd_trainer_step.py``) streams them.
2. verl hands agent loops the rollout client only. In OPD runs the ThunderSync trainer's rollout
   client carries verl's teacher clients as ``opd_teacher_clients`` (``attach_teacher_clients``):
   the servers verl's AgentLoopWorker calls, asked what verl asks (``prompt_logprobs=0``).
3. A teacher call that raises, times out or returns bad values is retried (``TeacherRetryPolicy``
   from ``thundersync.opd``); after the last attempt a failure record is published, so the trainer
   fails the step naming the turn instead of waiting for it. This module lives outside ``trainer/``:
   agent loops (``envs/``) import it, and nothing here imports the trainer.
4. One teacher call in flight per trajectory. A turn's call asks for log-probs over its whole prefix, and a
   serving engine recomputes the whole prefix for such a request (vLLM skips its prefix cache when prompt
   log-probs are asked for), so scoring every turn costs ~K/2 times the trajectory's tokens. A turn that
   finishes while its trajectory's previous call is in flight (the teacher is behind) waits for it; every
   turn waiting then shares ONE call on the latest prefix, each published with its own slice. A teacher
   that keeps up sees one call per turn; one that falls behind gets fewer, longer calls. A failed call fails
   each turn it carried, as a failure record of its own.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from thundersync_verl.run import faults
from thundersync_verl.core import StreamingConfigError, StreamingInputError, StreamingStateError
from thundersync_verl.core.errors import rule_message

logger = logging.getLogger(__name__)
TURN_PARTITION = "opd_turns"  # TransferQueue partition of scored turns
TEACHER_CLIENTS_ATTR = "opd_teacher_clients"  # on the rollout client handed to agent loops
TURN_COUNT_KEY = "opd_turns"  # a trajectory's extra_fields: how many turns its agent loop published
TEACHER_SAMPLING = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False}
LOG_PROB_TOLERANCE = 1e-4  # a log-prob above this is not a log-prob: the backend is broken


class TeacherScoringError(StreamingStateError):
    """The teacher could not score a turn after every configured attempt."""


@dataclass(frozen=True)
class TeacherRetryPolicy:
    """How hard to try before a turn's scoring is reported as failed."""

    max_attempts: int = 3
    timeout_s: float | None = None  # per attempt; None waits for ever (no worker thread)
    backoff_s: float = 0.0  # sleep before attempt k+1: backoff_s * k

    def __post_init__(self):
        bad_timeout = self.timeout_s is not None and not float(self.timeout_s) > 0
        if int(self.max_attempts) < 1 or bad_timeout or float(self.backoff_s) < 0:
            raise StreamingInputError(
                rule_message(
                    f"teacher retry policy needs max_attempts >= 1, timeout_s > 0 or None, backoff_s >= 0 "
                    f"(got {self.max_attempts!r}, {self.timeout_s!r}, {self.backoff_s!r})",
                    "zero attempts would drop every turn; a zero timeout would fail every call",
                    "use e.g. TeacherRetryPolicy(max_attempts=3, timeout_s=30.0)",
                )
            )


def trajectory_key(uid: Any, session_id: Any) -> str:
    """verl's TransferQueue key of a single-output agent loop's trajectory: ``{uid}_{session}_0``."""
    return f"{uid}_{session_id}_0"


def turn_key(traj_key: str, turn: int) -> str:
    return f"{traj_key}_t{int(turn)}"


def retry_policy_from_config(config) -> TeacherRetryPolicy:
    """``thundersync.opd.teacher_{max_attempts,timeout_s,backoff_s}`` as a retry policy (checked in config.py)."""
    from thundersync_verl.config import ThunderSyncConfig  # imports verl: only when a run's config is read

    opd = ThunderSyncConfig.from_verl(config).opd
    return TeacherRetryPolicy(max_attempts=opd.teacher_max_attempts, timeout_s=opd.teacher_timeout_s,
                              backoff_s=opd.teacher_backoff_s)


# ----- agent-loop side ------------------------------------------------------------------------
def attach_teacher_clients(rollout_client, teacher_clients: dict | None):
    """The rollout client, carrying the teacher clients to the agent loops (point 2)."""
    setattr(rollout_client, TEACHER_CLIENTS_ATTR, dict(teacher_clients or {}))
    return rollout_client


def teacher_values(rows: list, start: int, end: int) -> list[float]:
    """Log-probs of prefix tokens [start, end) from verl's teacher reply for that prefix.

    ``rows`` has one row per prefix token; row p holds log p(token p+1 | tokens <= p) first.
    Raises ``ValueError`` (retried) when the reply is not a usable answer.
    """
    if len(rows) != end:
        raise ValueError(f"teacher returned {len(rows)} prompt log-prob rows for a prefix of {end} tokens")
    values = [float(rows[p - 1][0]) for p in range(start, end)]
    if not all(math.isfinite(v) and v <= LOG_PROB_TOLERANCE for v in values):
        raise ValueError(f"teacher returned non-finite or positive log-probs (max {max(values):.3g})")
    return values


class AgentTurnTeacher:
    """Scores one agent turn with verl's teacher client (retries) and publishes it (point 1)."""

    def __init__(self, teacher_client, policy: TeacherRetryPolicy, *, put: Callable | None = None,
                 sleep=asyncio.sleep):
        self.client = teacher_client
        self.policy = policy
        self.put = put or _tq_put
        self.sleep = sleep
        self.replies: dict[str, tuple] = {}  # trajectory -> (prefix, ids rows, log-prob rows) of its latest scored turn
        self._lanes: dict[str, _Lane] = {}  # trajectory -> its turns waiting for the teacher (point 4)

    def whole_trajectory_reply(self, traj_key: str, sequence: list[int]) -> dict | None:
        """verl's ``teacher_ids`` / ``teacher_logprobs`` for ``sequence`` if a scored turn's prefix equals it.

        The last turn's prefix is the whole trajectory when the loop ended on an action (not on a tool
        observation or a truncation); then verl's own whole-trajectory call would ask the same question.
        verl only asks for top-k rows with distillation top-k losses, which OPD turn streaming refuses.
        """
        prefix, ids, rows = self.replies.pop(traj_key, (None, None, None))
        if prefix != list(sequence) or ids is None:
            return None
        return {"teacher_ids": torch.tensor(ids, dtype=torch.int32), "teacher_logprobs": torch.tensor(rows)}

    def forget(self, traj_key: str) -> None:
        """Drop a trajectory's kept reply: its agent loop failed, so no whole-trajectory question will come."""
        self.replies.pop(traj_key, None)

    @classmethod
    def for_agent_loop(cls, config, rollout_client) -> "AgentTurnTeacher | None":
        """None unless the rollout client carries teacher clients (thundersync OPD runs)."""
        clients = getattr(rollout_client, TEACHER_CLIENTS_ATTR, None)
        if not clients:
            return None
        if len(clients) != 1:
            raise StreamingConfigError(rule_message(
                f"per-turn OPD scoring needs exactly one teacher client (got {sorted(clients)})",
                "each turn is scored by the single teacher at its boundary",
                "configure one teacher in distillation.teacher_models"))
        return cls(next(iter(clients.values())), retry_policy_from_config(config))

    async def _ask(self, prefix: list[int]) -> list:
        if faults.ACTIVE and faults.teacher_hangs():  # $THUNDERSYNC_FAULTS: the teacher never answers
            await asyncio.sleep(faults.HANG_S)
        out = await self.client.generate(request_id=uuid.uuid4().hex, prompt_ids=prefix, sampling_params=dict(TEACHER_SAMPLING))
        fields = getattr(out, "extra_fields", None) or {}
        rows = fields.get("prompt_logprobs")
        if rows is None:
            raise ValueError("the teacher's reply has no prompt_logprobs: its rollout backend does not serve them")
        return rows, fields.get("prompt_ids")

    async def score(self, traj_key: str, turn: int, prefix: list[int], start: int) -> tuple[list[float], int]:
        """Teacher log-probs of ``prefix[start:]`` and the attempts used; raises after the last attempt."""
        policy, last = self.policy, ""
        for attempt in range(1, int(policy.max_attempts) + 1):
            if attempt > 1 and policy.backoff_s:
                await self.sleep(policy.backoff_s * (attempt - 1))
            try:
                rows, ids = await asyncio.wait_for(self._ask(list(prefix)), policy.timeout_s)
                values = teacher_values(rows, start, len(prefix))
                if len(prefix) >= len(self.replies.get(traj_key, ((),))[0]):  # keep the longest (latest) turn's reply
                    self.replies[traj_key] = (list(prefix), ids, rows)
                return values, attempt
            except asyncio.TimeoutError:
                last = f"no reply within teacher_timeout_s={policy.timeout_s}"
            except Exception as exc:  # noqa: BLE001 - any teacher failure is retried, then reported
                last = f"{type(exc).__name__}: {exc}"
            logger.warning("teacher attempt %d/%d for turn %d of %s failed: %s", attempt, policy.max_attempts,
                           turn, traj_key, last)
        raise TeacherScoringError(rule_message(
            f"the teacher failed to score turn {turn} of trajectory {traj_key} after {policy.max_attempts} "
            f"attempt(s); last error: {last}",
            "OPD trains on every turn; a turn without teacher log-probs cannot be backpropagated, so the "
            "batch cannot step without it",
            "check the teacher server (distillation.teacher_models), or raise thundersync.opd.teacher_max_attempts "
            "/ teacher_timeout_s"))

    async def score_and_publish(self, traj_key: str, turn: int, prompt_ids: list[int], response_ids: list[int],
                                action_start: int, rollout_log_probs: list[float] | None = None) -> None:
        """Score turn ``turn`` (its action is ``response_ids[action_start:]``) and put it into the TransferQueue.

        A trajectory has at most one teacher call in flight (point 4): a turn that finishes meanwhile waits, and
        every turn waiting when the call returns is scored by ONE call on the latest turn's prefix."""
        lane = self._lanes.setdefault(traj_key, _Lane())
        mine = _PendingTurn(int(turn), list(prompt_ids), list(response_ids), int(action_start), rollout_log_probs)
        lane.pending.append(mine)
        try:
            async with lane.lock:
                if not mine.done:
                    taken, lane.pending = lane.pending, []
                    try:
                        await self._score_together(traj_key, taken)
                    finally:  # cancelled mid-call (its agent loop was): the other turns it carried wait again
                        lane.pending[:0] = [t for t in taken if not t.done and t is not mine]
        finally:  # a cancelled turn is not published (nor carried by a later call)
            if not mine.done and mine in lane.pending:
                lane.pending.remove(mine)
            if not lane.pending and not lane.lock.locked():
                self._lanes.pop(traj_key, None)
        if mine.error is not None:
            raise mine.error

    async def _score_together(self, traj_key: str, turns: list["_PendingTurn"]) -> None:
        """One teacher call on the latest turn's prefix for ``turns`` (its earlier turns' prefixes are prefixes of
        it: a causal teacher gives each token the log-prob its own turn's prefix would); each turn published."""
        turns = sorted(turns, key=lambda t: t.turn)
        latest = turns[-1]
        prefix = latest.prompt_ids + latest.response_ids
        for t in turns[:-1]:
            if t.prompt_ids + t.response_ids != prefix[: len(t.prompt_ids) + len(t.response_ids)]:
                await self._score_together(traj_key, [t])  # not one history (never from one agent loop): alone
                turns = [u for u in turns if u is not t]
        start = len(latest.prompt_ids) + min(t.action_start for t in turns)
        try:
            values, attempts = await self.score(traj_key, latest.turn, prefix, start)
        except TeacherScoringError as exc:
            for t in turns:
                await self.put(turn_key(traj_key, t.turn), None, {"status": "failure", "traj": traj_key,
                                                                  "turn": t.turn, "error": str(exc)})
                t.done, t.error = True, exc
            return
        for t in turns:
            lo = len(t.prompt_ids) + t.action_start - start
            await self._publish(traj_key, t, values[lo : lo + len(t.response_ids) - t.action_start], attempts, len(turns))
            t.done = True

    async def _publish(self, traj_key: str, t: "_PendingTurn", values: list[float], attempts: int, shared: int) -> None:
        fields = {"prefix_ids": torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long),  # [P + end]
                  "teacher_log_probs": torch.tensor(values, dtype=torch.float32)}  # [end - action_start]
        if t.rollout_log_probs is not None and len(t.rollout_log_probs) == len(values):
            fields["rollout_log_probs"] = torch.tensor(list(t.rollout_log_probs), dtype=torch.float32)  # [end - action_start]
        await self.put(turn_key(traj_key, t.turn), fields, {
            "status": "success", "traj": traj_key, "turn": t.turn, "prompt_len": len(t.prompt_ids),
            "action_start": t.action_start, "attempts": attempts, "t_scored": time.time(),
            "rollout_lp": "rollout_log_probs" in fields, "turns_per_call": shared})


@dataclass
class _PendingTurn:
    """A finished turn waiting for its trajectory's teacher call (``AgentTurnTeacher.score_and_publish``)."""

    turn: int
    prompt_ids: list[int]
    response_ids: list[int]
    action_start: int
    rollout_log_probs: list[float] | None
    done: bool = False
    error: Exception | None = None


@dataclass
class _Lane:
    """One trajectory's turns waiting for the teacher, and the lock that keeps one call in flight."""

    pending: list = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


async def _tq_put(key: str, fields: dict | None, tag: dict) -> None:
    import transfer_queue as tq

    await tq.async_kv_put(key=key, partition_id=TURN_PARTITION, fields=fields, tag=tag)


