"""A reference OPD teacher: HF model log-probs of each agent turn, with KV-cache sessions and retries.

Why:
1. Training runs score turns with verl's teacher server (``thundersync_verl.algos.opd.turn_teacher``).
   The tests and benchmarks need a teacher they can run in-process and compare exactly: an HF
   causal LM scoring a turn's causal PREFIX (prompt + earlier turns and observations + turn j).
   The teacher is causal, so this gives the whole trajectory's values up to kernel numerics
   (``benchmarks/teacher_prefix.py`` measures the difference; fp32 < 1e-5).
2. Convention: the value for position p of ``prefix_ids`` is log softmax(logits_{p-1} / T)[x_p],
   the log-prob of token p given tokens < p, which is what verl's teacher server returns
   (``prompt_logprobs``, shifted) and what ``no_padding_2_padding`` slices for the response.
   Position 0 has no conditional log-prob, so an action span starts at 1 or later.
3. Incremental scoring: one KV-cache session per trajectory feeds only the tokens a turn adds
   (its observation and its action), so scoring every turn of a trajectory costs about one
   forward of the whole trajectory instead of one forward per prefix (quadratic in turns).
4. Failures are loud: a call that raises, returns the wrong number of values, non-finite or
   positive log-probs, or exceeds ``timeout_s`` is retried under the package's
   ``TeacherRetryPolicy``, each retry with a FRESH session (a failed call may have half-updated
   its KV cache). After the last attempt ``TeacherScoringError`` names the trajectory and turn,
   and the turn stays in ``pending()``.
5. ``score_turn`` fills an ``OPDTurn``'s teacher log-probs, so replayed trajectories can feed
   the OPD planner (``thundersync_verl.algos.opd.opd_stream``).
The backend is anything with ``score(prefix_ids, action_span)`` (and optionally ``session()``
returning an object with the same ``score``): ``HFTeacherScorer`` runs an HF transformers model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Hashable, Sequence

import torch

from thundersync_verl.algos.opd.turn_teacher import LOG_PROB_TOLERANCE, TeacherRetryPolicy, TeacherScoringError
from thundersync_verl.core import StreamingInputError
from thundersync_verl.core.errors import rule_message

if TYPE_CHECKING:
    from thundersync_verl.algos.opd.opd_stream import OPDTurn

logger = logging.getLogger(__name__)


def check_span(prefix_ids: Sequence[int], action_span: tuple[int, int]) -> tuple[int, int]:
    """``(start, end)`` after checking 1 <= start < end <= len(prefix_ids)."""
    try:
        start, end = (int(action_span[0]), int(action_span[1]))
    except (TypeError, ValueError, IndexError):
        start, end = -1, -1
    if not (1 <= start < end <= len(prefix_ids)):
        raise StreamingInputError(
            rule_message(
                f"action_span must satisfy 1 <= start < end <= len(prefix_ids)={len(prefix_ids)} (got {action_span!r})",
                "the teacher scores token p from the tokens before it, so the first token of the "
                "prefix has no log-prob and a span past the prefix has no tokens",
                "pass (start, end) positions of this turn's action tokens inside prefix_ids, end exclusive",
            )
        )
    return start, end


def _as_ids(prefix_ids: Sequence[int]) -> torch.Tensor:
    ids = torch.as_tensor(list(prefix_ids), dtype=torch.long)  # [L]
    if ids.dim() != 1 or ids.numel() < 2:
        raise StreamingInputError(
            rule_message(
                f"prefix_ids must be a flat list of at least 2 token ids (got shape {tuple(ids.shape)})",
                "a turn's causal prefix holds the prompt and at least one action token",
                "pass prompt + earlier turns + this turn as one list of ints",
            )
        )
    return ids


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


class HFTeacherScorer:
    """Teacher log-probs from an HF causal LM (e.g. the ``hf_cpu`` engine's model), no grad."""

    def __init__(self, model, *, temperature: float = 1.0):
        if not float(temperature) > 0:
            raise StreamingInputError(
                rule_message(
                    f"teacher temperature must be positive (got {temperature!r})",
                    "log-probs are log_softmax(logits / T)",
                    "use 1.0, as verl's teacher does for prompt_logprobs",
                )
            )
        self.model = model.eval()
        self.temperature = float(temperature)

    @classmethod
    def from_engine(cls, engine, *, temperature: float = 1.0) -> "HFTeacherScorer":
        """Score with the model an ``HFGenerationEngine`` (the ``hf_cpu`` rollout) serves."""
        return cls(engine.model, temperature=temperature)

    def _next_token_log_probs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log softmax(logits / T) at the target ids: logits [N, V], targets [N] -> [N] float32."""
        scaled = logits.float() / self.temperature  # [N, V]
        return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [N]

    def score(self, prefix_ids: Sequence[int], action_span: tuple[int, int]) -> torch.Tensor:
        """Teacher log-probs of ``prefix_ids[start:end]`` from one forward of the prefix, [end - start]."""
        start, end = check_span(prefix_ids, action_span)
        ids = _as_ids(prefix_ids).to(_model_device(self.model))  # [L]
        with torch.no_grad():
            logits = self.model(input_ids=ids[:end].unsqueeze(0), use_cache=False).logits[0]  # [end, V]
        return self._next_token_log_probs(logits[start - 1 : end - 1], ids[start:end]).cpu()  # [end - start]

    def session(self) -> "IncrementalTeacherSession":
        """A KV-cache session for the turns of ONE trajectory."""
        return IncrementalTeacherSession(self)


class IncrementalTeacherSession:
    """Scores successive prefixes of one trajectory, feeding each token to the teacher once.

    Keeps the KV cache and the log-prob of every token fed so far; a call's prefix must agree
    with the tokens already fed where they overlap (turns of one trajectory share their history),
    so an earlier turn scored after a later one is answered from the stored log-probs.
    """

    def __init__(self, scorer: HFTeacherScorer):
        self.scorer = scorer
        self.ids: list[int] = []
        self.cache = None
        self.last_logits: torch.Tensor | None = None  # [V] logits at the last fed position
        self.log_probs: list[torch.Tensor] = []  # chunks of log p(x_p | x_<p) for p = 1 .. len(ids)-1

    def _check_extends(self, prefix: list[int]) -> None:
        """The prefix and the tokens fed so far must agree where they overlap (either may be longer)."""
        common = min(len(prefix), len(self.ids))
        if prefix[:common] != self.ids[:common]:
            first = next(i for i, (a, b) in enumerate(zip(prefix, self.ids)) if a != b)
            raise StreamingInputError(
                rule_message(
                    f"this prefix disagrees with the {len(self.ids)} tokens already scored in this "
                    f"session (first difference at position {first})",
                    "a session's KV cache holds the trajectory's earlier tokens; a different history "
                    "would be scored against the wrong context",
                    "use one session per trajectory and pass each turn's full prefix (prompt + all "
                    "earlier turns + this turn), or open a new session",
                )
            )

    def _feed(self, new_ids: torch.Tensor) -> None:
        """Run the teacher on ``new_ids`` [n] after the cached tokens; record their log-probs."""
        model = self.scorer.model
        with torch.no_grad():
            ids = new_ids.to(_model_device(model)).unsqueeze(0)  # [1, n]
            out = model(input_ids=ids, past_key_values=self.cache, use_cache=True)
        logits = out.logits[0]  # [n, V]
        if self.last_logits is not None:
            logits_before = torch.cat([self.last_logits.unsqueeze(0), logits[:-1]], dim=0)  # [n, V]
            targets = new_ids  # [n]
        else:
            logits_before, targets = logits[:-1], new_ids[1:]  # [n - 1, V], [n - 1]
        self.log_probs.append(self.scorer._next_token_log_probs(logits_before, targets.to(logits.device)).cpu())
        self.cache = out.past_key_values
        self.last_logits = logits[-1]
        self.ids.extend(int(t) for t in new_ids.tolist())

    def score(self, prefix_ids: Sequence[int], action_span: tuple[int, int]) -> torch.Tensor:
        """Teacher log-probs of ``prefix_ids[start:end]``, feeding only the tokens not yet fed, [end - start]."""
        start, end = check_span(prefix_ids, action_span)
        prefix = [int(t) for t in _as_ids(prefix_ids)[:end].tolist()]
        self._check_extends(prefix)
        if len(prefix) > len(self.ids):
            self._feed(torch.tensor(prefix[len(self.ids):], dtype=torch.long))
        every = torch.cat(self.log_probs)  # [len(ids) - 1]; entry p - 1 is position p
        return every[start - 1 : end - 1].clone()


@dataclass
class ScoringStats:
    calls: int = 0
    attempts: int = 0
    failures: int = 0
    timeouts: int = 0
    errors: list[str] = field(default_factory=list)


class TurnScorer:
    """Scores agent turns with retries and one incremental session per trajectory.

    ``score_turn`` returns the turn's teacher log-probs or raises ``TeacherScoringError``; a
    failed turn stays in ``pending()`` until a later ``score_turn`` for it succeeds.
    """

    def __init__(self, backend, policy: TeacherRetryPolicy | None = None, *, incremental: bool = True,
                 sleep=time.sleep):
        self.backend = backend
        self.policy = policy or TeacherRetryPolicy()
        self.incremental = bool(incremental) and hasattr(backend, "session")
        self.sleep = sleep
        self.stats = ScoringStats()
        self._sessions: dict[Hashable, object] = {}
        self._pending: dict[tuple[Hashable, int], str] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def pending(self) -> list[tuple[Hashable, int]]:
        """(trajectory, turn) pairs whose scoring failed and has not succeeded since."""
        return sorted(self._pending, key=repr)

    def end_trajectory(self, traj_id: Hashable) -> None:
        """Free the trajectory's KV cache (its turns are all scored)."""
        self._sessions.pop(traj_id, None)

    def _attempt(self, traj_id: Hashable, prefix_ids, action_span) -> torch.Tensor:
        if self.incremental:
            if traj_id not in self._sessions:
                self._sessions[traj_id] = self.backend.session()
            call = self._sessions[traj_id].score
        else:
            call = self.backend.score
        if self.policy.timeout_s is None:
            return call(prefix_ids, action_span)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="teacher")
        future = self._executor.submit(call, prefix_ids, action_span)
        try:
            return future.result(timeout=float(self.policy.timeout_s))
        except concurrent.futures.TimeoutError:
            self._executor.shutdown(wait=False)  # the late call runs on, on a session dropped below
            self._executor = None
            self.stats.timeouts += 1
            raise TimeoutError(f"teacher call exceeded timeout_s={self.policy.timeout_s}") from None

    def score_turn(self, traj_id: Hashable, turn: int, prefix_ids: Sequence[int],
                   action_span: tuple[int, int]) -> torch.Tensor:
        """Teacher log-probs [end - start] of turn ``turn`` of ``traj_id``; raises after the last attempt."""
        start, end = check_span(prefix_ids, action_span)
        self.stats.calls += 1
        last = ""
        for attempt in range(1, int(self.policy.max_attempts) + 1):
            if attempt > 1 and self.policy.backoff_s:
                self.sleep(self.policy.backoff_s * (attempt - 1))
            self.stats.attempts += 1
            try:
                values = _check_values(self._attempt(traj_id, prefix_ids, (start, end)), end - start)
            except StreamingInputError:
                raise  # the caller's input is wrong: retrying cannot help
            except Exception as exc:  # noqa: BLE001 - any teacher failure is retried, then reported
                last = f"{type(exc).__name__}: {exc}"
                self.stats.failures += 1
                self.stats.errors.append(last)
                self._sessions.pop(traj_id, None)  # its cache may be half-updated: start afresh
                logger.warning("teacher attempt %d/%d for %r turn %d failed: %s",
                               attempt, self.policy.max_attempts, traj_id, turn, last)
                continue
            self._pending.pop((traj_id, int(turn)), None)
            return values
        self._pending[(traj_id, int(turn))] = last
        raise TeacherScoringError(
            rule_message(
                f"the teacher failed to score turn {turn} of trajectory {traj_id!r} after "
                f"{self.policy.max_attempts} attempt(s); last error: {last}",
                "OPD trains on every scored turn; a turn without teacher log-probs cannot be "
                "backpropagated and is kept pending, so the batch cannot step without it",
                "fix the teacher backend, raise TeacherRetryPolicy(max_attempts=..., timeout_s=...), "
                "then call score_turn again for this turn, or drop the whole batch",
            )
        )

    async def score_turn_async(self, traj_id: Hashable, turn: int, prefix_ids: Sequence[int],
                               action_span: tuple[int, int]) -> torch.Tensor:
        """``score_turn`` on a worker thread, for asyncio agent loops."""
        return await asyncio.to_thread(self.score_turn, traj_id, turn, prefix_ids, action_span)


def _check_values(values, n: int) -> torch.Tensor:
    """The backend's answer as a float32 [n] tensor, or an error that triggers a retry."""
    out = torch.as_tensor(values, dtype=torch.float32).reshape(-1)  # [n]
    if out.numel() != n:
        raise ValueError(f"teacher returned {out.numel()} log-probs for a span of {n} tokens")
    if not bool(torch.isfinite(out).all()):
        raise ValueError("teacher returned non-finite log-probs")
    if bool((out > LOG_PROB_TOLERANCE).any()):
        raise ValueError(f"teacher returned log-probs above 0 (max {float(out.max()):.3g})")
    return out


def score_turn(scorer: TurnScorer, turn: OPDTurn) -> OPDTurn:
    """``turn`` with the teacher's log-probs of its action tokens, scored on its causal prefix.

    ``scorer`` retries and keeps one KV-cache session per trajectory; its ``TeacherScoringError``
    propagates and the turn is not added anywhere.
    """
    p = len(turn.prompt)
    values = scorer.score_turn(turn.traj_id, turn.turn, turn.prompt + turn.response,
                               (p + turn.action_start, p + len(turn.response)))
    return replace(turn, teacher_log_probs=tuple(float(v) for v in values.tolist()))
