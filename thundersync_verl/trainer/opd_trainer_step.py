"""OPD in the ThunderSync trainer: each agent turn, scored by the teacher at its boundary, streamed.

Why:
1. verl's agent-loop worker puts a trajectory into the TransferQueue when it ENDS, and verl's own
   teacher call scores the whole trajectory then. Here each turn is scored earlier: the agent loop
   (``envs/agent_loop.py``) hands every finished turn to ``AgentTurnTeacher``, which scores the
   turn's causal prefix with verl's teacher client while the next tool call runs, and puts the
   scored turn into the TransferQueue partition ``opd_turns`` (key ``{trajectory key}_t{j}``).
   ``OPDStreamStep`` polls that partition next to the trajectory partition and backpropagates each
   turn as soon as it lands (``OPDTurnPlanner`` chunks, ``stream_token_backward``), while its
   trajectory is still running. One optimizer step per batch, as in the GRPO path.
2. verl hands agent loops the rollout client only. In OPD runs the ThunderSync trainer's rollout
   client carries verl's teacher clients (``MultiTeacherModelManager``) as ``opd_teacher_clients``:
   the servers verl's AgentLoopWorker calls, asked what verl asks (``prompt_logprobs=0``: the
   log-prob of each sampled token at temperature 1).
3. Nothing is dropped silently. A trajectory row says how many turns its agent loop published; the
   planner's barrier refuses to step while one is missing, and a turn still missing once every
   trajectory has landed fails the step at once (its agent loop publishes turns BEFORE it returns).
   A teacher call that raises, times out or returns bad values is retried (``thundersync.opd``);
   after the last attempt the agent loop publishes a failure record, the trainer raises
   ``TeacherScoringError`` naming the turn, and no optimizer step is taken. Turns of other
   trajectories (validation runs) are ignored and cleared with the batch's own.
4. A trajectory whose agent loop published no turns (another agent loop) is split into turns when
   it lands, with the teacher log-probs verl stored with it: the same update, without the overlap.
5. Costs: a turn is one teacher forward of its whole prefix (separate requests share no KV cache on
   ``hf_cpu``; vLLM's prefix cache removes most of it), so K turns cost up to (K+1)/2 times one
   forward of the trajectory; verl's own whole-trajectory teacher call still runs, and its scores
   check the per-turn ones (``thundersync/opd/teacher_prefix_gap_max``). On the learner a turn row
   recomputes its prefix (``opd_stream.py`` point 3).
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

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingConfigError, StreamingInputError, StreamingStateError
from thundersync_verl.core.errors import rule_message
from thundersync_verl.trainer.opd_stream import OPDTurn, OPDTurnPlanner, opd_planner_from_verl_config, turns_of_trajectory
from thundersync_verl.trainer.stream_exec import fetch_rows
from thundersync_verl.trainer.teacher_scoring import LOG_PROB_TOLERANCE, TeacherRetryPolicy, TeacherScoringError
from thundersync_verl.trainer.trajectory_source import TrajectoryNeverArrived, TrajectorySource

logger = logging.getLogger(__name__)
TURN_PARTITION = "opd_turns"  # TransferQueue partition of scored turns
TEACHER_CLIENTS_ATTR = "opd_teacher_clients"  # on the rollout client handed to agent loops
TURN_COUNT_KEY = "opd_turns"  # a trajectory's extra_fields: how many turns its agent loop published
TEACHER_SAMPLING = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False}


def trajectory_key(uid: Any, session_id: Any) -> str:
    """verl's TransferQueue key of a single-output agent loop's trajectory: ``{uid}_{session}_0``."""
    return f"{uid}_{session_id}_0"


def turn_key(traj_key: str, turn: int) -> str:
    return f"{traj_key}_t{int(turn)}"


# ----- config ---------------------------------------------------------------------------------
def opd_enabled(config) -> bool:
    dist = config.get("distillation") if hasattr(config, "get") else None
    return bool(dist is not None and dist.get("enabled", False))


def retry_policy_from_config(config) -> TeacherRetryPolicy:
    """``thundersync.opd.teacher_{max_attempts,timeout_s,backoff_s}`` as a retry policy (validated)."""
    opd = (config.get("thundersync", {}) or {}).get("opd", {}) or {}
    timeout = opd.get("teacher_timeout_s", 120)
    return TeacherRetryPolicy(max_attempts=int(opd.get("teacher_max_attempts", 3)),
                              timeout_s=None if timeout is None else float(timeout),
                              backoff_s=float(opd.get("teacher_backoff_s", 0.5)))


def validate_opd_config(config, *, max_chunk_size: int = 8) -> OPDTurnPlanner:
    """The turn planner for this config; refuses what per-turn streaming cannot do, naming the key."""
    planner = opd_planner_from_verl_config(config, max_chunk_size=max_chunk_size)
    teachers = list(config.distillation.get("teacher_models", {}) or {})
    if len(teachers) != 1:
        raise StreamingConfigError(rule_message(
            f"thundersync OPD streams turns of ONE teacher (distillation.teacher_models has {teachers})",
            "a turn is scored at its boundary by the single teacher client; multi-teacher routing by "
            "distillation.teacher_key is not implemented for per-turn scoring",
            "keep only distillation.teacher_models.teacher_model, or train multi-teacher OPD with mode=sync"))
    retry_policy_from_config(config)
    return planner


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
        """Score turn ``turn`` (its action is ``response_ids[action_start:]``) and put it into the TransferQueue."""
        prefix = list(prompt_ids) + list(response_ids)
        key = turn_key(traj_key, turn)
        try:
            values, attempts = await self.score(traj_key, turn, prefix, len(prompt_ids) + action_start)
        except TeacherScoringError as exc:
            await self.put(key, None, {"status": "failure", "traj": traj_key, "turn": int(turn), "error": str(exc)})
            raise
        fields = {"prefix_ids": torch.tensor(prefix, dtype=torch.long),  # [P + end]
                  "teacher_log_probs": torch.tensor(values, dtype=torch.float32)}  # [end - action_start]
        if rollout_log_probs is not None and len(rollout_log_probs) == len(values):
            fields["rollout_log_probs"] = torch.tensor(list(rollout_log_probs), dtype=torch.float32)  # [end - action_start]
        await self.put(key, fields, {"status": "success", "traj": traj_key, "turn": int(turn),
                                     "prompt_len": len(prompt_ids), "action_start": int(action_start),
                                     "attempts": attempts, "t_scored": time.time(),
                                     "rollout_lp": "rollout_log_probs" in fields})


async def _tq_put(key: str, fields: dict | None, tag: dict) -> None:
    import transfer_queue as tq

    await tq.async_kv_put(key=key, partition_id=TURN_PARTITION, fields=fields, tag=tag)


# ----- trainer side ---------------------------------------------------------------------------
class TurnSource:
    """Scored turns of this batch's trajectories, as they land in the ``opd_turns`` partition."""

    def __init__(self, kv_list: Callable, kv_batch_get: Callable, traj_ids: set[str]):
        self.kv_list, self.kv_batch_get = kv_list, kv_batch_get
        self.traj_ids = set(traj_ids)
        self.seen: dict[str, dict] = {}
        self.foreign: set[str] = set()  # e.g. validation turns: cleared with the batch's own

    def poll(self) -> list[tuple[OPDTurn, dict]]:
        listing = self.kv_list(TURN_PARTITION) or {}
        listing = listing.get(TURN_PARTITION, listing) if isinstance(listing, dict) else {}
        new = []
        for key, tag in listing.items():
            status = (tag or {}).get("status")
            if key in self.seen or key in self.foreign or status not in ("success", "failure"):
                continue  # a key is listed before its tag and fields are written: seen at a later poll
            if tag.get("traj") not in self.traj_ids:
                self.foreign.add(key)
            elif status == "failure":
                raise TeacherScoringError(str(tag.get("error")) + "\n  (the optimizer step of this batch was NOT taken)")
            else:
                new.append((key, tag))
        if not new:
            return []
        with_lp = all(tag.get("rollout_lp", False) for _, tag in new)
        data = self.kv_batch_get(keys=[k for k, _ in new], partition_id=TURN_PARTITION,
                                 select_fields=["prefix_ids", "teacher_log_probs"] + (["rollout_log_probs"] if with_lp else []))
        out = []
        for i, (key, tag) in enumerate(new):
            prefix, p = data["prefix_ids"][i].tolist(), int(tag["prompt_len"])
            turn = OPDTurn(tag["traj"], int(tag["turn"]), prefix[:p], prefix[p:], int(tag["action_start"]),
                           data["teacher_log_probs"][i].tolist(),
                           data["rollout_log_probs"][i].tolist() if with_lp else ())
            self.seen[key] = tag
            out.append((turn, tag))
        return out

    def keys(self) -> list[str]:
        return sorted(set(self.seen) | self.foreign)


def _check_against_trajectory(turn: OPDTurn, row: dict) -> None:
    """A streamed turn must be a prefix of its landed trajectory, its action tokens scored (mask 1)."""
    end = len(turn.response)
    ok = (list(turn.prompt) == row["prompt"] and list(turn.response) == row["response"][:end]
          and all(row["mask"][turn.action_start:end]))
    if not ok:
        raise StreamingInputError(rule_message(
            f"turn {turn.turn} of {turn.traj_id} disagrees with its landed trajectory (prompt, response prefix "
            "or response mask)",
            "the turn's gradient must be the gradient of exactly these trajectory tokens",
            "publish each turn with the trajectory's own prompt ids and response ids up to the turn's end"))


@dataclass
class _StepBook:
    """What one streamed OPD step has seen, keyed by trajectory and (trajectory, turn)."""

    expected: dict = field(default_factory=dict)  # trajectory -> turns its agent loop published
    turns: dict = field(default_factory=dict)  # trajectory -> {turn index: OPDTurn}
    landed_at: dict = field(default_factory=dict)  # trajectory -> time its row reached the driver
    seen_at: dict = field(default_factory=dict)  # (trajectory, turn) -> time the turn reached the driver
    backward_at: dict = field(default_factory=dict)  # (trajectory, turn) -> start of its backward
    from_trajectory_end: int = 0  # turns split from a landed trajectory (point 4)
    kl_sum: float = 0.0  # learner_forward=fused: log pi - log p_teacher over scored tokens, from the backwards
    kl_tokens: float = 0.0
    lp_gap: float = float("-inf")  # fused: max |log p_rollout - log p_learner| measured by the turn backwards

    def missing(self) -> list[str]:
        return [f"{traj}: {len(self.turns.get(traj, {}))}/{n} turns" for traj, n in self.expected.items()
                if len(self.turns.get(traj, {})) != n]


class OPDStreamStep:
    """The OPD branch of ``ThunderSyncTrainer._step_once`` (module docstring)."""

    def __init__(self, trainer, planner: OPDTurnPlanner, *, api=None, poll_s: float = 0.01):
        """``api``: verl's trainer pieces (``verl_adapter.trainer_api()``, the default)."""
        self.trainer, self.planner, self.poll_s = trainer, planner, poll_s
        self._api = api

    @property
    def api(self):
        if self._api is None:
            self._api = va.trainer_api()
        return self._api

    def run(self, metrics: dict, timing_raw: dict):
        t, api = self.trainer, self.api
        n = int(t.config.actor_rollout_ref.rollout.n)
        traj_ids = [trajectory_key(uid, s) for uid in t._batch_uids for s in range(n)]
        trajs = TrajectorySource(api.tq.kv_list, t._batch_uids, n, timeout_s=t.trajectory_timeout_s)
        self.turns = TurnSource(api.tq.kv_list, api.tq.kv_batch_get, set(traj_ids))
        self.book = _StepBook()
        self.planner.begin_batch(traj_ids)
        t.actor_rollout_wg.stream_begin_batch({"loss_agg_mode": self.planner.loss_agg_mode})
        self.pipe = t.op_pipeline(self._op_done)
        t._rows, t._forward_metrics, keys, tags = {}, {}, [], []
        with api.marked_timer("stream", timing_raw, color="red"):
            try:
                self._stream(trajs, keys, tags)
                timing_raw["gen"] = max(trajs.arrival_time.values()) - t.recorder.t_step_start
                self.pipe.drain()
                final = self.planner.finalize()
                t0 = time.time()
                out = t.actor_rollout_wg.finalize_step(final.scale)
                t.recorder.learner_op("optimizer", t0, time.time())
            finally:
                if self.turns.keys():
                    api.tq.kv_clear(keys=self.turns.keys(), partition_id=TURN_PARTITION)
        metrics.update(t._forward_metrics)
        metrics.update(t.recorder.finish_step(out, {}))
        metrics.update(self._opd_metrics(keys))
        if math.isfinite(self.book.lp_gap):  # learner_forward=fused: the turn backwards' own check
            metrics["training/rollout_logprob_diff_max"] = self.book.lp_gap
        return t._compute_advantage(api.KVBatchMeta(partition_id="train", keys=keys, tags=tags), {})

    def _stream(self, trajs: TrajectorySource, keys: list, tags: list) -> None:
        """Turns and trajectories as they land; every ready turn chunk runs at once."""
        t_start = self.trainer.recorder.t_step_start
        while True:
            all_landed = trajs.done  # read BEFORE polling turns: a trajectory's turns precede it
            new_turns = self.turns.poll()
            for turn, tag in new_turns:
                self._add(turn, seen_at=time.time())
            arrived = [] if all_landed else trajs.poll()
            if arrived:
                self._admit(arrived, keys, tags)
            ops = self.planner.next_ops()
            for op in ops:
                self.pipe.submit(op, self.trainer._rows)
            self.pipe.collect()
            if all_landed:
                self._check_complete()
                return
            if not (new_turns or arrived or ops):
                if time.time() - t_start > trajs.timeout_s:
                    raise TrajectoryNeverArrived(
                        f"{trajs.expected - len(trajs.seen)} trajectories of this batch did not arrive within "
                        f"{trajs.timeout_s:.0f}s. The optimizer step was NOT taken. Raise thundersync.trajectory_timeout_s "
                        "if your tools or teacher are that slow, or check the rollout and teacher servers.")
                time.sleep(self.poll_s)

    def _add(self, turn: OPDTurn, *, seen_at: float) -> None:
        row = self.trainer._rows.get(turn.traj_id)
        if row is not None:
            _check_against_trajectory(turn, row)
        self.planner.add_turn(turn)
        self.book.turns.setdefault(turn.traj_id, {})[turn.turn] = turn
        self.book.seen_at[(turn.traj_id, turn.turn)] = seen_at

    def _admit(self, arrived: list, keys: list, tags: list) -> None:
        """Landed trajectories: announce their turn counts, split those that published none, forward at θ_k."""
        t, t_seen = self.trainer, time.time()
        rows = fetch_rows(self.api.tq, [k for k, _ in arrived])
        t._rows.update(rows)
        for key, tag in arrived:
            row = rows[key]
            for turn in self.book.turns.get(key, {}).values():
                _check_against_trajectory(turn, row)
            count = row["extra"].get(TURN_COUNT_KEY)
            if count is None:  # another agent loop: split at the end (point 4)
                count = self._split_landed(key, row, t_seen)
            self.book.expected[key] = int(count)
            self.book.landed_at[key] = t_seen
            self.planner.end_trajectory(key, int(count))
            t.recorder.trajectory(key, row["extra"], row["reward"], t_reward=t_seen)
            keys.append(key)
            tags.append(tag)
        if t.learner_forward == "fused":  # the turn backwards measure the reverse KL at θ_k themselves
            t._old_log_probs_from_rollout([k for k, _ in arrived])
        else:
            t._forward_at_theta_k([k for k, _ in arrived], [g for _, g in arrived])

    def _split_landed(self, key: str, row: dict, t_seen: float) -> int:
        teacher = self._teacher_response_rows([key], {key: row})[key]
        turns = turns_of_trajectory(key, row["prompt"], row["response"], row["mask"], teacher)
        for turn in turns:
            self._add(turn, seen_at=t_seen)
        self.book.from_trajectory_end += len(turns)
        return len(turns)

    def _teacher_response_rows(self, keys: list[str], rows: dict) -> dict[str, list[float]]:
        """verl's whole-trajectory teacher log-probs, aligned with each response ([R] per key)."""
        data = self.api.tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["teacher_logprobs"])
        out = {}
        for i, key in enumerate(keys):
            seq = data["teacher_logprobs"][i].reshape(len(rows[key]["prompt"]) + len(rows[key]["response"]), -1)  # [S, K]
            p = len(rows[key]["prompt"])
            out[key] = seq[p - 1 : p - 1 + len(rows[key]["response"]), 0].tolist()  # row s: log p(token s+1)
        return out

    def _op_done(self, op, stats: dict, t0: float, t1: float) -> None:
        t = self.trainer
        self.book.kl_sum += stats.get("kl_sum", 0.0)
        self.book.kl_tokens += stats.get("kl_tokens", 0.0)
        if "lp_gap" in stats:
            self.book.lp_gap = max(self.book.lp_gap, stats["lp_gap"])
        for item in op.items:  # (trajectory, turn) of every turn in the chunk, merged rows included
            self.book.backward_at[item] = t0
        items = [(str(turn.traj_id).split("_")[0], turn.traj_id) for turn in op.turns]
        tokens = sum(len(turn.prompt) + len(turn.response) for turn in op.turns)
        t.recorder.learner_op("backward", t0, t1, items=items, tokens=tokens)

    def _check_complete(self) -> None:
        missing = self.book.missing()
        if missing:
            raise StreamingStateError(rule_message(
                f"scored turns are missing although every trajectory has landed ({'; '.join(missing[:5])})",
                "an agent loop publishes its turns before it returns, so a turn missing now was dropped; "
                "stepping without it would train on part of the trajectory",
                "check the agent loop and the TransferQueue partition 'opd_turns'; the optimizer step was NOT taken"))

    def _opd_metrics(self, keys: list[str]) -> dict[str, float]:
        """Reverse KL at the batch's weights, teacher prefix-vs-whole gap, streaming timing."""
        book, rows = self.book, self.trainer._rows
        fused = self.trainer.learner_forward == "fused"
        data = None if fused else self.api.tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["old_log_probs"])
        whole = self._teacher_response_rows(keys, rows)
        kl, gap, n_tok = 0.0, 0.0, 0
        for i, key in enumerate(keys):
            student = None if fused else data["old_log_probs"][i].tolist()  # [R] log pi at θ_k (learner forward)
            for turn in book.turns.get(key, {}).values():
                for j, r in enumerate(range(turn.action_start, len(turn.response))):
                    if student is not None:
                        kl += student[r] - turn.teacher_log_probs[j]
                    gap = max(gap, abs(turn.teacher_log_probs[j] - whole[key][r]))
                    n_tok += 1
        if fused:  # each turn's backward measured its own tokens at θ_k: the same sum
            kl, n_tok = book.kl_sum, int(book.kl_tokens)
        early = [at < book.landed_at[traj] for (traj, _), at in book.backward_at.items()]
        delay = [at - book.seen_at[k] for k, at in book.backward_at.items()]
        retries = sum(int(tag.get("attempts", 1)) - 1 for tag in self.turns.seen.values())
        return {
            "thundersync/opd/turns": len(book.backward_at),
            "thundersync/opd/turns_from_trajectory_end": book.from_trajectory_end,
            "thundersync/opd/turns_backpropagated_before_trajectory_end": sum(early) / max(len(early), 1),
            "thundersync/opd/turn_to_backward_s/mean": sum(delay) / max(len(delay), 1),
            "thundersync/opd/reverse_kl": kl / max(n_tok, 1),
            "thundersync/opd/teacher_prefix_gap_max": gap,
            "thundersync/opd/teacher_retries": retries,
            "thundersync/opd/whole_teacher_call_reused": sum(
                bool((rows[k]["extra"].get("thundersync_events") or {}).get("teacher_reused")) for k in keys) / max(len(keys), 1),
        }
