"""OPD in the ThunderSync trainer: scored agent turns streamed as they land (the trainer side).

Why:
1. The agent loop scores each finished turn with the teacher while the next tool call runs and puts
   it into the TransferQueue partition ``opd_turns`` (``algos/opd/turn_teacher.py``, the rollout side).
   ``OPDArrivals`` is OPD's part of the one streamed step (``streamed_step.StreamedStep``): ``TurnSource``
   polls that partition next to the trajectory partition, and each turn is backpropagated as soon as it
   lands (``OPDTurnPlanner`` chunks, ``stream_token_backward``), while its trajectory is still running.
   One optimizer step per batch, as in the GRPO path.
2. Nothing is dropped silently. A trajectory row says how many turns its agent loop published; the
   planner's barrier refuses to step while one is missing, and a turn still missing once every
   trajectory has landed fails the step (its agent loop publishes turns BEFORE it returns). A teacher
   failure after the configured retries arrives as a failure record: ``TeacherScoringError`` names the
   turn and no optimizer step is taken. Turns of other trajectories (validation runs) are ignored and
   cleared with the batch's own.
3. A trajectory whose agent loop published no turns (another agent loop) is split into turns when
   it lands, with the teacher log-probs verl stored with it: the same update, without the overlap.
4. Costs: a turn is one teacher forward of its whole prefix (separate requests share no KV cache on
   ``hf_cpu``; vLLM's prefix cache removes most of it); verl's whole-trajectory teacher scores check
   the per-turn ones (``thundersync/opd/teacher_prefix_gap_max``). On the learner a turn row
   recomputes its prefix (``opd_stream.py`` point 3).
5. ``OPDAlgorithm`` is OPD as the trainer's algorithm (``step/contracts.TrainerAlgorithm``, chosen by
   ``step/algorithm.choose_algorithm`` with ``distillation.enabled``): the agent loops get verl's teacher clients to
   score each turn, the run's planner is the turn planner, and the rules per-turn streaming needs (one teacher, no
   batch order, one optimizer step per batch, no KL loss or entropy bonus; the distillation settings of
   ``opd_config.py``) refuse a config before any work.
6. verl's ``use_task_rewards: true`` (its shipped default): the planner is ``opd_task.OPDTaskPlanner``; scored turns
   go to its turn planner as above, and each landed trajectory ALSO arrives in its GRPO planner with its reward and
   its mask-1 token count (group = the trajectory key's uid, as ``GRPOArrivals``), whose backward chunks and folds
   the step runs like GRPO's (``stream_exec``: rows from the landed trajectories).
7. ``thundersync.opd.teacher_calls: trajectory``: the agent loops get no teacher clients, so verl's agent-loop worker
   asks the teacher once per whole trajectory when its loop ends, as in Sync, and every trajectory lands unscored
   turn by turn and is split as in point 3. With ``granularity: trajectory`` this is OPD streamed like GRPO: each
   trajectory backpropagated once, as it lands, with Sync's teacher and learner work. Per-turn scoring hides the
   teacher's latency behind the tools, at one whole-prefix teacher call per turn.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from thundersync_verl.algos.opd.turn_teacher import (
    TURN_COUNT_KEY,
    TURN_PARTITION,
    TeacherScoringError,
    attach_teacher_clients,
    retry_policy_from_config,
    trajectory_key,
)
from thundersync_verl.core import StreamingConfigError, StreamingInputError, StreamingStateError
from thundersync_verl.core.errors import rule_message
from thundersync_verl.algos.opd.opd_config import opd_loss_from_verl_config
from thundersync_verl.algos.opd.opd_stream import (OPDTurn, OPDTurnPlanner, TurnBackwardOp, opd_planner_from_verl_config,
                                                   turns_of_trajectory)
from thundersync_verl.algos.opd.opd_task import OPDTaskPlanner
from thundersync_verl.step.contracts import AlgorithmDefaults, TrainerAlgorithmDefaults
from thundersync_verl.step.grpo_algorithm import steps_per_batch
from thundersync_verl.step.stream_exec import row_lists
from thundersync_verl.step.stream_plan import settings_from_verl_config

logger = logging.getLogger(__name__)


# ----- config ---------------------------------------------------------------------------------
def opd_enabled(config) -> bool:
    dist = config.get("distillation") if hasattr(config, "get") else None
    return bool(dist is not None and dist.get("enabled", False))


def validate_opd_config(config, *, max_chunk_size: int = 8) -> OPDTurnPlanner | OPDTaskPlanner:
    """The run's planner (the turn planner; with ``use_task_rewards`` the task planner around it, point 6); refuses
    what per-turn streaming cannot do, naming the key."""
    if opd_loss_from_verl_config(config).use_task_rewards:
        planner = OPDTaskPlanner.from_verl_config(config, max_chunk_size=max_chunk_size)
    else:
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


class OPDAlgorithm(TrainerAlgorithmDefaults):
    """OPD in the trainer (point 5): teacher-scored turns streamed by the turn planner."""

    name = "opd"
    record_algo = "opd"

    def validate_settings(self, config, ts) -> None:
        settings_from_verl_config(config)  # ppo_epochs, mini-batches, loss, estimator, IS/KL terms

    def validate(self, config, ts) -> None:
        validate_opd_config(config, max_chunk_size=ts.chunk_size)  # opd_config's settings, one teacher
        if ts.deterministic:
            raise StreamingConfigError(rule_message(
                "thundersync.deterministic=true orders whole trajectories; OPD streams scored turns",
                "turns of different trajectories interleave with the tool calls' timing, which no batch order fixes",
                "set thundersync.deterministic=false for OPD"))
        k, epochs = steps_per_batch(config)
        if k * epochs != 1:
            raise StreamingConfigError(rule_message(
                f"OPD turn streaming takes one optimizer step per batch (got {k} mini-batches x {epochs} epochs)",
                "its turns are backpropagated as they are scored, at the batch's weights",
                "set actor_rollout_ref.actor.ppo_mini_batch_size=data.train_batch_size and ppo_epochs=1"))
        actor = config.actor_rollout_ref.actor
        terms = [t for t, on in (("use_kl_loss=false", actor.get("use_kl_loss", False)),
                                 ("entropy_coeff=0", float(actor.get("entropy_coeff", 0.0) or 0.0) != 0.0)) if on]
        if terms:
            raise StreamingConfigError(rule_message(
                "OPD turn streaming has no KL loss or entropy bonus term",
                "a turn chunk's loss is the distillation policy gradient; the configured terms would be silently dropped",
                "set " + ", ".join(f"actor_rollout_ref.actor.{t}" for t in terms)))
        rc = config.algorithm.get("rollout_correction", None)
        if rc is not None and rc.get("rollout_is") is not None:
            raise StreamingConfigError(rule_message(
                f"OPD turn streaming carries no rollout IS weights (algorithm.rollout_correction.rollout_is="
                f"{rc.get('rollout_is')!r})",
                "a turn chunk's loss is the distillation policy gradient; the weights would be silently dropped",
                "set algorithm.rollout_correction.rollout_is=null, or run OPD with mode=sync"))

    def llm_client(self, client, trainer):
        if trainer.ts.opd.teacher_calls == "trajectory":  # point 7: verl's agent-loop worker scores whole trajectories
            return client
        return attach_teacher_clients(client, trainer.get_teacher_client())  # the agent loops score each turn

    def planner(self, config, ts, bucket_bytes: Callable[[], int]) -> OPDTurnPlanner | OPDTaskPlanner:
        return validate_opd_config(config, max_chunk_size=ts.chunk_size)

    def arrivals(self, trainer) -> "OPDArrivals":
        return OPDArrivals(trainer.planner)


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
        prefixes, teacher = row_lists(data["prefix_ids"]), row_lists(data["teacher_log_probs"])  # one pass per field
        rollout = row_lists(data["rollout_log_probs"]) if with_lp else None
        out = []
        for i, (key, tag) in enumerate(new):
            prefix, p = prefixes[i], int(tag["prompt_len"])
            turn = OPDTurn(tag["traj"], int(tag["turn"]), prefix[:p], prefix[p:], int(tag["action_start"]),
                           teacher[i], rollout[i] if with_lp else ())
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
    rows: int = 0  # learner rows the turns ran in (fewer than turns where ready turns merged: opd_stream point 7)

    def missing(self) -> list[str]:
        return [f"{traj}: {len(self.turns.get(traj, {}))}/{n} turns" for traj, n in self.expected.items()
                if len(self.turns.get(traj, {})) != n]


class OPDArrivals(AlgorithmDefaults):
    """OPD in ``streamed_step.StreamedStep``: scored turns and finished trajectories (module docstring).

    One per batch: ``begin`` opens the batch's turn source and ``close`` clears its turns.
    """

    def __init__(self, planner: OPDTurnPlanner | OPDTaskPlanner):
        self.planner = planner
        self.task = isinstance(planner, OPDTaskPlanner)  # point 6
        self.book = _StepBook()
        self.turns: TurnSource | None = None
        self.tq = None

    def begin(self, ctx) -> TurnSource:
        self.tq = ctx.tq
        traj_ids = [trajectory_key(uid, s) for uid in ctx.uids for s in range(ctx.n)]
        self.turns = TurnSource(ctx.tq.kv_list, ctx.tq.kv_batch_get, set(traj_ids))
        if self.task:  # point 6: groups as GRPOArrivals declares them (the key's uid)
            self.planner.begin_batch(traj_ids, {str(uid): ctx.n for uid in ctx.uids})
        else:
            self.planner.begin_batch(traj_ids)
        return self.turns

    def close(self) -> None:
        if self.turns is not None and self.turns.keys():
            self.tq.kv_clear(keys=self.turns.keys(), partition_id=TURN_PARTITION)

    def admit_turn(self, turn: OPDTurn, tag: dict, state, t_seen: float) -> None:
        row = state.rows.get(turn.traj_id)
        if row is not None:
            _check_against_trajectory(turn, row)
        self.planner.add_turn(turn)
        self.book.turns.setdefault(turn.traj_id, {})[turn.turn] = turn
        self.book.seen_at[(turn.traj_id, turn.turn)] = t_seen

    def admit_trajectory(self, key: str, row: dict, state, t_seen: float) -> None:
        """A landed trajectory announces its turn count; one whose loop published none is split (point 4)."""
        for turn in self.book.turns.get(key, {}).values():
            _check_against_trajectory(turn, row)
        count = row["extra"].get(TURN_COUNT_KEY)
        if count is None:
            teacher = self._teacher_response_rows([key], {key: row})[key]
            turns = turns_of_trajectory(key, row["prompt"], row["response"], row["mask"], teacher, row.get("rollout_lp"))
            for turn in turns:
                self.admit_turn(turn, {}, state, t_seen)
            self.book.from_trajectory_end += len(turns)
            count = len(turns)
        self.book.expected[key] = int(count)
        self.book.landed_at[key] = t_seen
        self.planner.end_trajectory(key, int(count))
        if self.task:  # point 6: its task term, with the reward verl's reward loop gave it
            self.planner.arrive(key.split("_")[0], key, row["reward"], row["num_tokens"])

    def describe_op(self, op, state, t0: float) -> tuple[str, list, int]:
        if not isinstance(op, TurnBackwardOp):  # a task-term chunk or fold (point 6), as GRPOArrivals describes it
            from thundersync_verl.step.stream_exec import op_kind

            items = tuple(getattr(op, "items", ()))
            return op_kind(op).name, items, sum(len(state.rows[k]["prompt"]) + len(state.rows[k]["response"])
                                                for _, k in items)
        for item in op.items:  # (trajectory, turn) of every turn in the chunk, merged rows included
            self.book.backward_at[item] = t0
        self.book.rows += len(op.turns)
        items = [(str(turn.traj_id).split("_")[0], turn.traj_id) for turn in op.turns]
        return "backward", items, sum(len(turn.prompt) + len(turn.response) for turn in op.turns)

    def check_complete(self, state) -> None:
        missing = self.book.missing()
        if missing:
            raise StreamingStateError(rule_message(
                f"scored turns are missing although every trajectory has landed ({'; '.join(missing[:5])})",
                "an agent loop publishes its turns before it returns, so a turn missing now was dropped; "
                "stepping without it would train on part of the trajectory",
                "check the agent loop and the TransferQueue partition 'opd_turns'; the optimizer step was NOT taken"))

    def _teacher_response_rows(self, keys: list[str], rows: dict) -> dict[str, list[float]]:
        """verl's whole-trajectory teacher log-probs, aligned with each response ([R] per key)."""
        data = self.tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["teacher_logprobs"])
        out = {}
        for i, key in enumerate(keys):
            seq = data["teacher_logprobs"][i].reshape(len(rows[key]["prompt"]) + len(rows[key]["response"]), -1)  # [S, K]
            p = len(rows[key]["prompt"])
            out[key] = seq[p - 1 : p - 1 + len(rows[key]["response"]), 0].tolist()  # row s: log p(token s+1)
        return out

    def metrics(self, state, ctx) -> dict[str, float]:
        """Reverse KL at the batch's weights, teacher prefix-vs-whole gap, streaming timing."""
        book, rows, keys = self.book, state.rows, state.keys
        whole = self._teacher_response_rows(keys, rows)
        if ctx.fused_forward:  # each turn's backward measured its own tokens at θ_k
            kl, n_tok = state.kl_sum, int(state.kl_tokens)
            student = {}
        else:  # verl's forward at θ_k stored log pi per response token ([R] per key)
            data = self.tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["old_log_probs"])
            student = {key: data["old_log_probs"][i].tolist() for i, key in enumerate(keys)}
            kl, n_tok = 0.0, 0
        gap = 0.0
        for key in keys:
            for turn in book.turns.get(key, {}).values():
                for j, r in enumerate(range(turn.action_start, len(turn.response))):
                    if key in student:
                        kl += student[key][r] - turn.teacher_log_probs[j]
                        n_tok += 1
                    gap = max(gap, abs(turn.teacher_log_probs[j] - whole[key][r]))
        early = [at < book.landed_at[traj] for (traj, _), at in book.backward_at.items()]
        delay = [at - book.seen_at[k] for k, at in book.backward_at.items()]
        retries = sum(int(tag.get("attempts", 1)) - 1 for tag in self.turns.seen.values())
        return {
            "thundersync/opd/turns": len(book.backward_at),
            "thundersync/opd/turns_from_trajectory_end": book.from_trajectory_end,
            "thundersync/opd/rows": book.rows,
            "thundersync/opd/turns_backpropagated_before_trajectory_end": sum(early) / max(len(early), 1),
            "thundersync/opd/turn_to_backward_s/mean": sum(delay) / max(len(delay), 1),
            "thundersync/opd/reverse_kl": kl / max(n_tok, 1),
            "thundersync/opd/teacher_prefix_gap_max": gap,
            "thundersync/opd/teacher_retries": retries,
            "thundersync/opd/teacher_calls": round(sum(1.0 / max(int(tag.get("turns_per_call", 1)), 1)  # turn_teacher
                                                       for tag in self.turns.seen.values())),  # point 4: shared calls
            "thundersync/opd/whole_teacher_call_reused": sum(
                bool((rows[k]["extra"].get("thundersync_events") or {}).get("teacher_reused")) for k in keys) / max(len(keys), 1),
        }
