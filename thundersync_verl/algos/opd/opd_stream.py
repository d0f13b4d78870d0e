"""On-policy distillation (OPD) streamed turn by turn: the driver-side planner and client.

Why:
1. OPD's per-token advantage A_t = -(log pi_student(a_t) - log p_teacher(a_t)) is detached and
   has no group statistic: once the teacher has scored a turn (``algos/opd/turn_teacher.py``), every
   coefficient of that turn is fixed. With one optimizer step per batch the PPO ratio is 1 and
   verl's vanilla clip is inactive, so the batch gradient is
       g = c_batch * sum_{turns j} grad( -sum_{t in j} A_t log pi(a_t) )
   and each completed agent turn can be backpropagated while the next tool call runs. Turns
   of one trajectory and of many trajectories may arrive and run in any order.
2. Recompute-the-prefix: turn j's chunk row is the trajectory prefix up to the end of turn j
   (prompt + earlier turns + observations + turn j), with ``ts_token_coef`` 1 on turn j's action
   tokens and 0 elsewhere. Later turns attend to earlier turns' keys and values, and the prefix
   is recomputed WITH grad, so every path from turn j's loss to the weights is in the graph:
   exact. The normaliser (token-mean: 1 / scored tokens of the whole batch; seq-mean modes:
   1 / trajectories) is deferred and applied once by ``finalize_step``. seq-mean-token-mean is
   refused: its weight 1/|o_i| needs the trajectory's final length.
3. Cost (measured, fp32, 2 shared CPU cores): a turn row is a forward+backward of its whole
   prefix, so a trajectory of K turns costs ~(K+1)/2 times its tokens when the prompt is short,
   up to K times when the prompt dominates. ``benchmarks/teacher_prefix.py`` (embedded task, 48
   trajectories of 2-5 turns, 69-197 tokens, tiny student, 4 rows per call): 2.60x the tokens
   and 2.57x the time of backpropagating the whole trajectories. On verl's FSDP2 engine through
   Ray (``benchmarks/equivalence.py --algo opd --quick``, ~50 turns a step in 16-18 chunks): the
   streamed step's calls take 0.5-1.4 s (DP 1-2) vs 0.15-0.4 s for ``update_actor``, per-call overhead
   dominating at this model size. The extra work runs while tool calls are in flight: it pays
   where the learner would otherwise wait for the last trajectory.
4. The linear-cost alternative (keep earlier turns' graph, or detached K/V proxies whose
   adjoints are accumulated and propagated when the trajectory closes) is NOT built: verl's
   engine runs forward and backward inside one ``forward_backward_batch`` per micro-batch and
   FSDP2 reshards parameters after each backward, so a graph cannot outlive the call; K/V
   proxies need a model-level forward that takes per-layer K/V with requires_grad and returns
   their gradients, i.e. replacing verl's forward path for every supported architecture, and
   they still hold every earlier turn's activations (or recompute them at close). Recompute
   keeps the stock engine, is exact, and costs at most K times the tokens (measured above).
5. ``granularity="trajectory"`` (``thundersync.opd.granularity``) keeps the per-turn teacher scoring
   (it still overlaps the tools) but backpropagates a trajectory as ONE row once it has ended and
   all its turns are scored (``TrajectoryRow``): the same gradient (tested), one forward+backward of
   the trajectory instead of ~(K+1)/2, started later. Which is faster depends on whether the learner
   has idle time to spend on prefix recompute (separate learner devices) or shares the rollout's
   compute (this project's 2-core CPU); ``benchmarks/modes.py --algo opd --opd-granularity`` measures it.
6. The distillation term is verl's, as configured (``opd_config.OPDLoss``): any single-sample estimator (k1/kl, abs,
   k2/mse, k3/low_var_kl) as the policy gradient above (A_t = -estimator) or backpropagated directly as a supervised
   loss (verl's ``use_policy_gradient: false``, its shipped default with k3): either way a token's term depends on that
   token's log-probs only, so turns stream the same; the op carries the setting to the chunk (``stream_loss.py``
   point 9). verl's ``use_task_rewards: true`` adds the task-reward policy term: ``opd_task.OPDTaskPlanner``.
7. Turns of one trajectory that are ready at the same plan (the learner was busy while the next tool call and
   turn ran) share one row, ``merge_ready_turns``: the later turn's prefix with every ready turn's action tokens
   scored, the same gradient as their separate rows (point 5's argument) for one forward+backward instead of
   one per turn. With ``thundersync.coalesce`` the driver plans only into the learner's free slots, just in time
   (``streamed_step``; never early for a full chunk), so turns that land while the learner is busy wait for the
   next plan: a learner that keeps
   up sees one turn per row; one that falls behind recomputes fewer prefixes, the further behind the fewer
   (towards one row per trajectory).
Flow (see ``OPDTurnPlanner``): begin_batch(traj_ids) -> add_turn(OPDTurn) as each turn is scored
-> next_ops() -> OPDStreamClient.run(ops) -> end_trajectory(id, n_turns) -> finalize() -> barrier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Sequence

from thundersync_verl.core import StreamingConfigError, StreamingStateError, batch_scale
from thundersync_verl.core.errors import fail
from thundersync_verl.core.normalizers import check_loss_agg_mode
from thundersync_verl.core.objectives import check_opd_turn_mode
from thundersync_verl.step.chunk_layout import build_token_chunk
from thundersync_verl.step.stream_plan import FinalizeOp
from thundersync_verl.step.contracts import PlannerDefaults
from thundersync_verl.core.config_validation import config_value as _get
from thundersync_verl.algos.opd.opd_config import KEY as LOSS_KEY, OPDLoss, opd_loss_from_verl_config

GRANULARITIES = ("turn", "trajectory")


@dataclass(frozen=True)
class OPDTurn:
    """One scored agent turn, as a chunk row: the prefix up to its end, its action tokens last.

    ``response`` holds every response token up to the end of this turn (earlier turns and their
    observations included); the action tokens are ``response[action_start:]`` and
    ``teacher_log_probs`` has one value per action token.
    """

    traj_id: Hashable
    turn: int
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    action_start: int
    teacher_log_probs: tuple[float, ...]
    rollout_log_probs: tuple[float, ...] = ()  # optional: the rollout's log-probs of the action tokens

    def __post_init__(self):  # lists are accepted and stored as tuples: turns compare and hash by value
        for name in ("prompt", "response", "teacher_log_probs", "rollout_log_probs"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def num_tokens(self) -> int:
        return len(self.response) - self.action_start

    def token_coefs(self) -> list[float]:
        """1 on this turn's action tokens, 0 on the prefix before them, [len(response)]."""
        return [0.0] * self.action_start + [1.0] * self.num_tokens

    def teacher_row(self) -> list[float]:
        """Teacher log-probs aligned with ``response``, 0 off the action tokens, [len(response)]."""
        return [0.0] * self.action_start + [float(x) for x in self.teacher_log_probs]

    def rollout_row(self) -> list[float] | None:
        """Rollout log-probs aligned with ``response`` (0 off the action tokens), or None if not carried."""
        if len(self.rollout_log_probs) != self.num_tokens:
            return None
        return [0.0] * self.action_start + [float(x) for x in self.rollout_log_probs]


@dataclass(frozen=True)
class TrajectoryRow:
    """All turns of one finished trajectory as ONE chunk row (``granularity="trajectory"``).

    The row is the last turn's prefix (the whole trajectory up to its last action) with every
    turn's action tokens scored: in a causal model each token's log-prob is the one its own
    turn's prefix row would give, so the row's gradient is the sum of the turn rows' gradients,
    for one forward+backward of the trajectory instead of one per turn.
    """

    parts: tuple[OPDTurn, ...]  # by turn index

    @property
    def traj_id(self) -> Hashable:
        return self.parts[0].traj_id

    @property
    def turn(self) -> int:
        return self.parts[-1].turn

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.parts[-1].prompt

    @property
    def response(self) -> tuple[int, ...]:
        return self.parts[-1].response

    @property
    def items(self) -> tuple[tuple[Hashable, int], ...]:
        return tuple((t.traj_id, t.turn) for t in self.parts)

    def token_coefs(self) -> list[float]:
        coefs = [0.0] * len(self.response)
        for t in self.parts:
            coefs[t.action_start : len(t.response)] = [1.0] * t.num_tokens
        return coefs

    def teacher_row(self) -> list[float]:
        row = [0.0] * len(self.response)
        for t in self.parts:
            row[t.action_start : len(t.response)] = [float(x) for x in t.teacher_log_probs]
        return row

    def rollout_row(self) -> list[float] | None:
        if any(len(t.rollout_log_probs) != t.num_tokens for t in self.parts):
            return None
        row = [0.0] * len(self.response)
        for t in self.parts:
            row[t.action_start : len(t.response)] = [float(x) for x in t.rollout_log_probs]
        return row


@dataclass(frozen=True)
class TurnBackwardOp:
    """Backpropagate ``turns`` (turn rows, or whole-trajectory rows) in one per-token chunk, with ``loss``'s term."""

    turns: tuple[OPDTurn | TrajectoryRow, ...]
    opd_clamp: float | None = None  # verl's loss_max_clamp on |log pi - log p_teacher|
    loss: OPDLoss = OPDLoss()  # the distillation term (opd_config.py): estimator, form, coefficient

    @property
    def items(self) -> tuple[tuple[Hashable, int], ...]:
        return tuple(i for t in self.turns for i in getattr(t, "items", ((t.traj_id, t.turn),)))



def _check_turn(turn: OPDTurn) -> None:
    if not isinstance(turn.turn, int) or turn.turn < 0 or not turn.prompt:
        fail(f"turn index must be an int >= 0 and the prompt non-empty (got turn={turn.turn!r}, "
              f"{len(turn.prompt)} prompt tokens)", "turns are matched to their trajectory by index; "
              "verl's layout locates a response by its prompt", "number turns 0, 1, 2, ... per trajectory")
    if not (0 <= turn.action_start < len(turn.response)):
        fail(f"action_start must satisfy 0 <= action_start < len(response)={len(turn.response)} "
              f"(got {turn.action_start})", "a turn row ends with at least one action token to score",
              "pass the turn's prefix up to the end of its action, and where its action starts")
    values = [float(x) for x in turn.teacher_log_probs]
    if len(values) != turn.num_tokens or not all(math.isfinite(v) for v in values):
        fail(f"turn {turn.turn} of {turn.traj_id!r} needs {turn.num_tokens} finite teacher log-probs "
              f"(got {len(values)})", "each action token's advantage needs the teacher's log-prob of it",
              "score the turn with the teacher (algos/opd/turn_teacher.py) and add it with those log-probs")


def _check_pair(a: OPDTurn, b: OPDTurn) -> None:
    """Turns a (earlier) and b (later) of one trajectory must share their history."""
    ok = a.prompt == b.prompt and b.response[: len(a.response)] == a.response and b.action_start >= len(a.response)
    if not ok:
        fail(f"turns {a.turn} and {b.turn} of trajectory {a.traj_id!r} are inconsistent: the later turn's "
              "prefix must extend the earlier turn's, and its action must start after the earlier turn ends",
              "turns of one trajectory are prefixes of one sequence; otherwise a token would be scored twice "
              "or against a different history", "pass each turn's prefix from the same trajectory record")


class OPDTurnPlanner(PlannerDefaults):
    """Bookkeeping of one batch of OPD turns: validation, chunking, the deferred normaliser."""

    def __init__(self, *, loss_agg_mode: str = "token-mean", loss_scale_factor: float | None = None,
                 opd_clamp: float | None = None, max_chunk_size: int = 8, granularity: str = "turn",
                 loss: OPDLoss | None = None):
        check_loss_agg_mode(loss_agg_mode, loss_scale_factor)
        if granularity not in GRANULARITIES:
            fail(f"thundersync.opd.granularity must be one of {GRANULARITIES}, got {granularity!r}",
                  "turn: each turn's prefix row runs when the teacher has scored it (earliest start, prefix recompute); "
                  "trajectory: one row per trajectory when its last turn is scored (one forward+backward per trajectory)",
                  "set thundersync.opd.granularity=turn or trajectory", StreamingConfigError)
        self.granularity = granularity
        check_opd_turn_mode(loss_agg_mode)
        if int(max_chunk_size) < 1 or (opd_clamp is not None and not float(opd_clamp) > 0):
            fail(f"max_chunk_size must be >= 1 and opd_clamp positive or None (got {max_chunk_size!r}, {opd_clamp!r})",
                  "a chunk holds at least one turn; a clamp bounds |log pi - log p_teacher|",
                  "use e.g. max_chunk_size=8 and verl's distillation_loss.loss_max_clamp", StreamingConfigError)
        self.loss_agg_mode = loss_agg_mode
        self.loss_scale_factor = loss_scale_factor
        if loss is not None and opd_clamp is not None and loss.clamp != float(opd_clamp):
            fail(f"opd_clamp={opd_clamp!r} disagrees with loss.clamp={loss.clamp!r}", "the clamp is part of the "
                 "distillation term (verl's loss_max_clamp)", "pass the clamp in OPDLoss only", StreamingConfigError)
        self.loss = loss or OPDLoss(clamp=None if opd_clamp is None else float(opd_clamp))
        self.opd_clamp = self.loss.clamp
        self.max_chunk_size = int(max_chunk_size)
        self._trajs: dict[Hashable, dict[int, OPDTurn]] | None = None

    def begin_batch(self, traj_ids: Iterable[Hashable]) -> None:
        """Start a batch of these trajectories (all sampled at the current weights)."""
        ids = list(traj_ids)
        if not ids or len(set(ids)) != len(ids):
            fail(f"a batch needs distinct trajectory ids, at least one (got {len(ids)}, {len(set(ids))} distinct)",
                  "every turn is attributed to exactly one trajectory of the batch", "pass each trajectory id once")
        self._trajs = {t: {} for t in ids}
        self._ended: dict[Hashable, int] = {}
        self._ready: list[OPDTurn] = []
        self.num_tokens = 0

    def _batch(self) -> dict:
        if self._trajs is None:
            fail("no OPD batch open", "turns belong to one batch sampled at one set of weights",
                  "call begin_batch(traj_ids) first (and again after every finalize)", StreamingStateError)
        return self._trajs

    def add_turn(self, turn: OPDTurn) -> None:
        """A turn scored by the teacher: it is ready to be backpropagated."""
        trajs = self._batch()
        _check_turn(turn)
        if turn.traj_id not in trajs:
            fail(f"trajectory {turn.traj_id!r} is not in this batch", "its weights may differ from the batch's",
                  "list every trajectory in begin_batch")
        known = trajs[turn.traj_id]
        ended = self._ended.get(turn.traj_id)
        if turn.turn in known or (ended is not None and turn.turn >= ended):
            fail(f"turn {turn.turn} of {turn.traj_id!r} was already added or is past its end ({ended} turns)",
                  "a turn added twice would be counted twice in the batch gradient", "add each turn once")
        for other in known.values():
            _check_pair(*sorted((other, turn), key=lambda t: t.turn))
        known[turn.turn] = turn
        self.num_tokens += turn.num_tokens
        if self.granularity == "turn":
            self._ready.append(turn)
        else:
            self._release_if_complete(turn.traj_id)

    def _release_if_complete(self, traj_id: Hashable) -> None:
        """``granularity="trajectory"``: the trajectory's row is ready once it ended with every turn scored."""
        n, known = self._ended.get(traj_id), self._trajs[traj_id]
        if n is not None and n > 0 and len(known) == n:
            self._ready.append(TrajectoryRow(tuple(known[j] for j in range(n))))

    def end_trajectory(self, traj_id: Hashable, num_turns: int) -> None:
        """The trajectory finished with ``num_turns`` turns (some may still be on their way)."""
        trajs = self._batch()
        if traj_id not in trajs or traj_id in self._ended or not isinstance(num_turns, int) or num_turns < 0:
            fail(f"end_trajectory({traj_id!r}, {num_turns!r}): unknown or already ended trajectory, or a bad count",
                  "the barrier waits for exactly the announced turns",
                  "call it once per trajectory with its turn count")
        if any(j >= num_turns for j in trajs[traj_id]):
            fail(f"trajectory {traj_id!r} already has turn {max(trajs[traj_id])} but ends with {num_turns} turns",
                  "the turn count decides which turns the barrier waits for", "pass the trajectory's real turn count")
        self._ended[traj_id] = num_turns
        if self.granularity == "trajectory":
            self._release_if_complete(traj_id)

    @property
    def ready(self) -> int:
        return len(self._ready)

    @property
    def ready_count(self) -> int:
        """Scored turns waiting for their backward (the step's planner interface)."""
        return len(self._ready)

    def memory(self) -> dict[str, int]:
        """Turn rows hold no buckets: every turn goes straight into the batch gradient."""
        return {}

    fills_free_slots = True  # point 7: a busy learner's turns wait and merge (streamed_step's free-slot planning),
    eager_full_chunks = False  # and go just in time only: a waiting turn may still merge with its next turn

    def next_ops(self, max_chunk_size: int | None = None, max_backwards: int | None = None) -> list[TurnBackwardOp]:
        """The ready turns, in chunks of at most ``max_chunk_size`` rows, in arrival order; turns of one
        trajectory that are ready together share one row (point 7). ``max_backwards``: at most that many chunks
        (the learner's free slots); the rest stay ready, to merge with their trajectories' later turns."""
        size = int(max_chunk_size or self.max_chunk_size)
        ready = merge_ready_turns(self._ready)
        take = len(ready) if max_backwards is None else min(len(ready), max(0, int(max_backwards)) * size)
        ops = [TurnBackwardOp(tuple(ready[i : min(i + size, take)]), self.opd_clamp, self.loss)
               for i in range(0, take, size)]
        self._ready = [part for row in ready[take:] for part in getattr(row, "parts", (row,))] \
            if self.granularity == "turn" else ready[take:]
        return ops

    def missing(self) -> list[str]:
        """What the barrier still waits for."""
        out = [f"trajectory {t!r} has not ended" for t in self._batch() if t not in self._ended]
        for t, n in self._ended.items():
            gaps = [j for j in range(n) if j not in self._trajs[t]]
            if gaps:
                out.append(f"trajectory {t!r} lacks turns {gaps}")
        if self._ready:
            out.append(f"{len(self._ready)} scored turn(s) not taken by next_ops")
        return out

    def finalize(self) -> FinalizeOp:
        """The deferred normaliser, once every turn of every trajectory has been planned."""
        work = self.missing()
        if work:
            fail("finalize refused: " + "; ".join(work[:6]), "the optimizer step must see every turn of every "
                  "trajectory (a turn whose teacher scoring failed is not dropped)", "score and add the missing "
                  "turns, call next_ops() and run its ops, or drop the batch", StreamingStateError)
        n_seq = len(self._trajs)
        scale = batch_scale(self.loss_agg_mode, num_tokens=self.num_tokens, num_sequences=n_seq,
                            dp_size=1, loss_scale_factor=self.loss_scale_factor)
        if scale is None or not math.isfinite(scale):
            fail("finalize refused: the batch has no scored tokens", f"the {self.loss_agg_mode} normaliser divides "
                  "by that count", "drop the batch instead of stepping", StreamingStateError)
        self._trajs = None
        return FinalizeOp(scale, self.num_tokens, n_seq)


def merge_ready_turns(ready: Sequence[OPDTurn | TrajectoryRow]) -> list[OPDTurn | TrajectoryRow]:
    """One row per trajectory among ``ready``: two or more of its turns become one ``TrajectoryRow`` (the latest
    turn's prefix, every ready turn's action tokens scored), at the place of its first ready turn (point 7)."""
    by_traj: dict[Hashable, list] = {}
    for row in ready:
        by_traj.setdefault(row.traj_id, []).append(row)
    out = []
    for rows in by_traj.values():
        if len(rows) == 1 or not all(isinstance(r, OPDTurn) for r in rows):
            out += rows
        else:
            out.append(TrajectoryRow(tuple(sorted(rows, key=lambda t: t.turn))))
    return out


def turns_of_trajectory(traj_id: Hashable, prompt: Sequence[int], response: Sequence[int], response_mask: Sequence[int],
                        teacher_log_probs: Sequence[float] | None = None,
                        rollout_log_probs: Sequence[float] | None = None) -> list[OPDTurn]:
    """Split a trajectory into its turns (maximal runs of mask-1 tokens), e.g. to replay it.

    ``teacher_log_probs`` is aligned with ``response`` (values off the mask are ignored); without
    it the turns carry no teacher values yet (the teacher's scores of each turn fill them).
    ``rollout_log_probs`` (aligned the same way) gives each turn the rollout's log-probs of its action tokens.
    """
    teacher = [0.0] * len(response) if teacher_log_probs is None else list(teacher_log_probs)
    rollout = None if rollout_log_probs is None else list(rollout_log_probs)
    if any(len(x) != len(response) for x in (response_mask, teacher, rollout) if x is not None):
        fail("response, response_mask, teacher_log_probs and rollout_log_probs must have one entry per response token",
              "turns are the runs of scored tokens", "pass the trajectory's aligned per-token lists")
    turns, j, t = [], 0, 0
    while t < len(response):
        if not response_mask[t]:
            t += 1
            continue
        end = t
        while end < len(response) and response_mask[end]:
            end += 1
        values = () if teacher_log_probs is None else tuple(teacher[t:end])
        behaviour = () if rollout is None else tuple(rollout[t:end])
        turns.append(OPDTurn(traj_id, j, tuple(prompt), tuple(response[:end]), t, values, behaviour))
        j, t = j + 1, end
    return turns


# ----- config ---------------------------------------------------------------------------------

def opd_planner_from_verl_config(config: Any, *, max_chunk_size: int = 8, task_rewards: bool = False) -> OPDTurnPlanner:
    """An ``OPDTurnPlanner`` matching verl's ``distillation`` settings; refuses what turns cannot stream.

    The distillation term is ``opd_config.opd_loss_from_verl_config``'s (every single-sample estimator, as a policy
    gradient or supervised; its refusals). ``use_task_rewards=true`` needs the task-reward term streamed beside the
    turns (``opd_task.OPDTaskPlanner``): refused unless the caller says it streams it (``task_rewards``). A
    loss_agg_mode other than seq-mean-token-mean; ``thundersync.opd.granularity`` (turn | trajectory) picks the row.
    """
    loss = opd_loss_from_verl_config(config)
    if loss.use_task_rewards and not task_rewards:
        fail(f"{LOSS_KEY}.use_task_rewards=true: a turn planner alone streams the distillation term only",
             "verl then adds its ppo_loss with the task-reward (GRPO) advantages; those need the landed "
             "trajectories' rewards and their groups, which OPDTaskPlanner (algos/opd/opd_task.py) streams beside "
             "the turns", "build OPDTaskPlanner.from_verl_config(config) (opd_trainer_step.validate_opd_config "
             f"picks it), or set {LOSS_KEY}.use_task_rewards=false", StreamingConfigError)
    from thundersync_verl.config import ThunderSyncConfig  # imports verl: only when a run's config is read

    actor = _get(config, "actor_rollout_ref.actor")
    return OPDTurnPlanner(loss_agg_mode=_get(actor, "loss_agg_mode", "token-mean"),
                          loss_scale_factor=_get(actor, "loss_scale_factor"), max_chunk_size=max_chunk_size,
                          granularity=ThunderSyncConfig.from_verl(config).opd.granularity, loss=loss)


# ----- driver ---------------------------------------------------------------------------------
class OPDStreamClient:
    """Sends the planner's turn chunks to a worker group of ``StreamingActorWorker``, in order."""

    def __init__(self, worker_group, *, pad_token_id: int, temperature: float = 1.0, dp_size: int | None = None):
        self.wg = worker_group
        self.pad_token_id = int(pad_token_id)
        self.temperature = float(temperature)
        self.dp_size = int(dp_size or worker_group.world_size)

    def begin_batch(self, meta: dict) -> None:
        self.wg.stream_begin_batch(meta)

    def chunk(self, op: TurnBackwardOp):
        """The per-token chunk of one op (prefix rows, turn j's tokens scored); with one data-parallel rank it travels
        padded, for the learner to convert (``chunk_layout`` point 5), as a row chunk's parts do."""
        turns = op.turns
        rollout = [t.rollout_row() for t in turns]
        return build_token_chunk([t.prompt for t in turns], [t.response for t in turns],
                                 [t.token_coefs() for t in turns], dp_size=self.dp_size, pad_token_id=self.pad_token_id,
                                 teacher_log_probs=[t.teacher_row() for t in turns], opd_clamp=op.opd_clamp,
                                 temperature=self.temperature,
                                 rollout_log_probs=None if any(r is None for r in rollout) else rollout,
                                 distill_loss=op.loss.estimator, supervised=op.loss.supervised, coef=op.loss.coef,
                                 padded=self.dp_size == 1)

    def run(self, ops: Sequence[TurnBackwardOp]) -> list:
        """One ``stream_token_backward`` per op, each waited for; returns their results."""
        results = []
        for op in ops:
            if not isinstance(op, TurnBackwardOp):
                fail(f"unknown op {type(op).__name__}", "the OPD client sends turn chunks only",
                      "pass the list returned by OPDTurnPlanner.next_ops()")
            results.append(self.wg.stream_token_backward(self.chunk(op)))
        return results

    def finalize(self, op: FinalizeOp) -> dict:
        """The barrier; returns rank 0's metrics."""
        return self.wg.finalize_step(op.scale)[0]
