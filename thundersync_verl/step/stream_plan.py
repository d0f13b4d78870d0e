"""The stream planner: which backward, fold and barrier operations the driver sends, and when.

Why:
1. The learner worker is a plain executor (backward into ``.grad`` or a bucket, fold buckets,
   step). Deciding WHAT it runs is pure bookkeeping over rewards and group sizes, so it lives
   here, framework-free (torch and the core only: no verl, no Ray) and unit-testable.
2. The bookkeeping is the core's: a shadow ``StreamingGradientAccumulator`` on the ``meta``
   device (no memory, no arithmetic) with the reward-bucket path tracks open/closed groups,
   reservations under the memory budget, token counts and every validation rule (unknown group,
   NaN reward, too many members). Its scheduling (``rank_ready``) and chunking
   (``split_into_chunks``) decide which ready trajectories run first and which share a backward.
3. Routes, in the worker's convention (gradient of a row = ts_coef * grad(-sum_t w log pi)):
       group closed when the trajectory runs   -> BackwardOp(dest="direct", ts_coef = A_i)
       group still open                        -> BackwardOp(dest=bucket(group, reward), ts_coef = 1)
       group closes (its last reward arrives)  -> FoldOp({bucket(group, r): A(r)})
       batch complete                          -> FinalizeOp(scale = c_batch)
   The last trajectory of a group always closes it, so it always goes direct.
4. A(r) comes from the core's estimators (verl's definitions) computed in float32 by default,
   the dtype of verl's reward tensors, so the coefficients equal verl's advantages. Estimators
   that need response lengths or batch statistics (OPO, GPG, REINFORCE++) go through the core's
   ``ArrivalView``: a batch-scope estimator's trajectories share ONE shadow group (one bucket per
   bucket class), folded when the batch's last trajectory lands; GPG's batch factor multiplies
   the barrier's scale.
   c_batch is the core's ``batch_scale`` with dp_size=1: the worker's loss already undoes the
   data-parallel averaging. Seq-mean modes divide by all trajectories of the batch, as verl's
   ``update_actor`` does (global_batch_size = ppo_mini_batch_size * rollout.n).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any, Hashable, Mapping

import torch

from thundersync_verl.core import (
    ScheduleHint,
    StreamingConfigError,
    StreamingGradientAccumulator,
    StreamingInputError,
    StreamingSettings,
    StreamingStateError,
    batch_scale,
    estimator_from_verl,
    validate_streaming_config,
)
from thundersync_verl.core.batch_estimators import ArrivalView
from thundersync_verl.core.errors import rule_message
from thundersync_verl.core.normalizers import check_count
from thundersync_verl.step.contracts import PlannerDefaults
from thundersync_verl.core.config_validation import config_value as _get

Item = tuple[Hashable, Hashable]


@dataclass(frozen=True)
class BackwardOp:
    """Backpropagate ``items`` in one chunk: row i weighted by ``coefs[i]``, into ``dest``."""

    items: tuple[Item, ...]
    coefs: tuple[float, ...]
    dest: str  # "direct" or a bucket key
    num_tokens: tuple[int, ...]


@dataclass(frozen=True)
class FoldOp:
    """Group ``group_id`` closed: ``.grad += coef * bucket`` for each ``{bucket_key: coef}``."""

    group_id: Hashable
    folds: dict[str, float]


@dataclass(frozen=True)
class FinalizeOp:
    """The barrier: multiply the batch gradient by ``scale``, clip, step."""

    scale: float
    num_tokens: int
    num_sequences: int


def bucket_key(group_id: Hashable, reward: float) -> str:
    """The worker-side name of the buffer of (group, reward)."""
    return f"g={group_id!r}|r={float(reward)!r}"


INDEPENDENT_BUCKETS_KEY = "independent_buckets"  # batch meta: bucketed rows keep their KL/entropy part apart


def independent_key(key: str) -> str:
    """The companion of bucket ``key`` that holds its rows' KL/entropy part (``minibatch_plan.py`` point 7)."""
    return f"{key}|independent"


class StreamPlanner(PlannerDefaults):
    """Turns trajectory arrivals into worker operations (see the module docstring)."""

    fills_free_slots = True  # coalescing plans only as many backwards as the pipeline has free slots

    def __init__(
        self,
        *,
        adv_estimator: str = "grpo",
        norm_adv_by_std_in_grpo: bool = True,
        epsilon: float = 1e-6,
        loss_agg_mode: str = "token-mean",
        loss_scale_factor: float | None = None,
        max_chunk_size: int = 8,
        stats_dtype: torch.dtype = torch.float32,
        grad_numel: int = 1,
        budget_bytes: int | None = None,
        max_distinct_rewards: int | None = None,
        gamma: float = 1.0,
    ):
        self.estimator = estimator_from_verl(adv_estimator, norm_adv_by_std_in_grpo, epsilon, dtype=stats_dtype,
                                             gamma=gamma)
        self._view = ArrivalView(self.estimator)  # arrivals -> the shadow's groups (point 4)
        self.verl_settings = {"adv_estimator": adv_estimator, "norm_adv_by_std_in_grpo": bool(norm_adv_by_std_in_grpo)}
        self.loss_agg_mode = loss_agg_mode
        self.loss_scale_factor = loss_scale_factor
        self.max_chunk_size = max_chunk_size
        shadow = torch.empty(int(grad_numel), dtype=torch.float32, device="meta")  # one local gradient shard
        self._acc = StreamingGradientAccumulator(
            [shadow],
            estimator=self._view.shadow_estimator,
            loss_agg_mode=loss_agg_mode,
            loss_scale_factor=loss_scale_factor,
            path="buckets",
            budget_bytes=budget_bytes,
            max_distinct_rewards=self._view.max_distinct(max_distinct_rewards),
        )
        self._sizes: dict[Hashable, int] = {}
        self._rewards: dict[Hashable, dict[Hashable, float]] = {}
        self._tokens: dict[Item, int] = {}
        self._clear_ready()
        self._buckets: dict[Hashable, set[float]] = {}
        self._queued: list[FoldOp] = []

    @classmethod
    def from_settings(cls, settings: StreamingSettings, **kwargs) -> "StreamPlanner":
        """A planner for a config validated by ``settings_from_verl_config``."""
        est = settings.estimator
        name = getattr(est, "verl_name", "rloo" if est.name == "rloo" else "grpo")
        norm = getattr(est, "norm_by_std", True)
        eps = getattr(est, "epsilon", 1e-6)
        return cls(adv_estimator=name, norm_adv_by_std_in_grpo=norm, epsilon=eps, loss_agg_mode=settings.loss_agg_mode,
                   loss_scale_factor=settings.loss_scale_factor, **kwargs)

    # ----- batch lifecycle ----------------------------------------------------------------
    def begin_batch(self, group_sizes: Mapping[Hashable, int]) -> None:
        """Declare the batch's groups {group_id: n}; an unfinished batch is dropped."""
        if self._acc.batch_open:
            self._acc.abort_batch()
        self._acc.begin_batch(self._view.begin(group_sizes))
        self._sizes = dict(group_sizes)
        self._rewards = {gid: {} for gid in group_sizes}
        self._tokens, self._buckets, self._queued = {}, {}, []
        self._clear_ready()

    def arrive(self, group_id: Hashable, traj_id: Hashable, reward: float, num_tokens: int) -> None:
        """A finished trajectory with its reward; if it closes its group, a FoldOp is queued.

        ``num_tokens`` is the number of SCORED response tokens (the response mask's sum): it
        feeds the token-mean normaliser exactly as verl's ``batch_num_tokens`` does.
        """
        item = (group_id, traj_id)
        if item in self._tokens:
            raise StreamingInputError(
                rule_message(
                    f"trajectory {item!r} arrived twice",
                    "each trajectory's gradient must enter the batch exactly once",
                    "give every sampled trajectory its own (group_id, traj_id)",
                )
            )
        check_count("num_tokens", num_tokens)
        shadow_gid, shadow_tid, shadow_reward = self._view.shadow_arrival(group_id, traj_id, reward, num_tokens)
        self._acc.report_reward(shadow_gid, shadow_tid, shadow_reward)  # validates; raises before any change
        self._view.record(group_id, traj_id, reward, num_tokens)
        self._rewards[group_id][traj_id] = float(reward)
        self._tokens[item] = int(num_tokens)
        self._fresh.append((shadow_gid, shadow_tid))
        if self._view.closes_group(shadow_gid):  # this arrival closed the (shadow) group
            self._queue_fold(shadow_gid)

    def _queue_fold(self, group_id: Hashable) -> None:
        by_reward = self._view.closing_coefficients(group_id)  # {shadow reward: A}
        folds = {bucket_key(group_id, r): by_reward[r] for r in sorted(self._buckets.pop(group_id, ()))}
        if folds:
            self._queued.append(FoldOp(group_id, folds))

    # ----- scheduling ---------------------------------------------------------------------
    @property
    def ready(self) -> list[Item]:
        """Arrived trajectories whose backward has not been planned yet."""
        return [self._view.real_item(item) for item in self._all_ready()]

    @property
    def queued_folds(self) -> int:
        """Folds of closed groups that the next ``next_ops`` returns (each one learner call)."""
        return len(self._queued)

    @property
    def ready_count(self) -> int:
        """How many arrived trajectories wait for their backward (the step's planner interface)."""
        return self._ranked_count + len(self._held) + len(self._fresh)

    def next_chunk_size(self, max_chunk_size: int | None = None) -> int:
        """Rows of the chunk that ``next_ops(max_backwards=1)`` would plan now (0: none): open groups' rows share a
        call only within a (group, reward) bucket, so what is ready is not what one call takes."""
        self._rank_if_stale(max_chunk_size or self.max_chunk_size)
        return len(self._ranked[0]) if self._ranked else 0

    def rank_ready(self) -> ScheduleHint:
        """The core's ranking of the ready trajectories: closed groups first, then open ones,
        new groups only while the memory budget allows (``wait`` holds the rest)."""
        return self._acc.rank_ready(self._all_ready())

    def next_ops(self, max_chunk_size: int | None = None, max_backwards: int | None = None) -> list:
        """Queued folds, then backward chunks for every ready trajectory that may run now.

        ``max_backwards`` plans only the best-ranked that many chunks (closed groups first; 0: the folds
        alone); the other ready trajectories stay unplanned, so rows that land meanwhile can join them, and a
        row whose group closes meanwhile goes direct, in one chunk with other groups' rows, instead of into its
        own bucket. ``held_count`` is then the trajectories the memory budget held back, not those left by
        the cap.

        The chunks a ranking leaves unplanned are kept, in rank order, until something new arrives (``_rank``):
        planning a few chunks at a time out of a backlog then costs per chunk, not a ranking of every ready row
        per call (which made a driver's CPU per trajectory grow with the batch).
        """
        if max_backwards is not None and int(max_backwards) < 0:
            raise ValueError(f"max_backwards must be >= 0 (chunks to plan besides the folds), got {max_backwards}")
        ops: list = list(self._queued)
        self._queued = []
        size = max_chunk_size or self.max_chunk_size
        if max_backwards is None:
            self._rank(size)
        else:
            self._rank_if_stale(size)
        take = len(self._ranked) if max_backwards is None else min(int(max_backwards), len(self._ranked))
        for _ in range(take):
            ops.append(self._plan(self._ranked[0]))  # a chunk the shadow refuses stays ready
            self._ranked_count -= len(self._ranked.popleft())
        return ops

    def _rank_if_stale(self, size: int) -> None:
        """Rank again unless the last ranking still holds: nothing arrived since, the same chunk size, and no rows
        the budget held back that could now be admitted (the ranked chunks are gone)."""
        if self._fresh or size != self._ranked_size or (self._held and not self._ranked):
            self._rank(size)

    def _rank(self, size: int) -> None:
        """Rank and chunk every ready trajectory (``split_into_chunks``): the chunks to plan, in order, and those
        the memory budget holds back. Valid until the next arrival: planning a ranked chunk changes no other
        chunk's loss weights or admission (the ranking counted every admitted group's reservation)."""
        chunks, waiting = self._acc.split_into_chunks(self._all_ready(), size)
        self._ranked, self._ranked_size = collections.deque(chunks), size
        self._ranked_count = sum(len(chunk) for chunk in chunks)
        self._held, self._fresh = list(waiting), []
        self.held_count = len(self._held)

    def _all_ready(self) -> list[Item]:
        """Every ready trajectory: the ranked chunks' in order, then those held back, then the fresh arrivals."""
        return [item for chunk in self._ranked for item in chunk] + self._held + self._fresh

    def _clear_ready(self, items: list[Item] | None = None) -> None:
        """No ranking; ``items`` (default none) ready, as fresh arrivals."""
        self._ranked: collections.deque = collections.deque()  # chunks of the last ranking, not planned yet
        self._ranked_count, self._ranked_size = 0, None
        self._held: list[Item] = []  # held back by the memory budget at the last ranking
        self._fresh: list[Item] = list(items or [])  # arrived since the last ranking
        self.held_count = 0  # ready trajectories the memory budget held back at the last plan

    def _plan(self, chunk: list[Item]) -> BackwardOp:
        plan = self._acc.plan_chunk(chunk)
        items = tuple(self._view.real_item(it) for it in plan.items)
        tokens = tuple(self._tokens[it] for it in items)
        if plan.destination == "direct":
            coefs = tuple(-w for w in plan.loss_weights)  # core loss weight is -A_i
            dest = "direct"
        else:
            gid = plan.items[0][0]
            coefs = (1.0,) * len(plan.items)
            dest = bucket_key(gid, plan.reward)  # type: ignore[arg-type]
            self._buckets.setdefault(gid, set()).add(float(plan.reward))  # type: ignore[arg-type]
        self._acc.add_chunk_grad(plan, [None], list(tokens))
        return BackwardOp(items, coefs, dest, tokens)

    # ----- mini-batches (minibatch_plan.py) ------------------------------------------------
    def withdraw(self, keep_groups) -> list[Item]:
        """Take back the ready trajectories whose group is not in ``keep_groups``; returns them.

        Mini-batch 1 of a several-step batch is sealed with its own groups: the other groups' rows
        run later, at the weights of their own mini-batch (``MiniBatchPlanner``).
        """
        keep = set(keep_groups)
        ready = self._all_ready()
        taken = [item for item in ready if item[0] not in keep]
        self._clear_ready([item for item in ready if item[0] in keep])
        return taken

    def end_batch(self) -> None:
        """Drop the batch's bookkeeping without a barrier (the shadow holds no gradient)."""
        if self._acc.batch_open:
            self._acc.abort_batch()

    # ----- barrier ------------------------------------------------------------------------
    def finalize(self) -> FinalizeOp:
        """The deferred normaliser, once every group is folded and every trajectory planned."""
        work = self._acc.pending_work() + ([f"{len(self._queued)} fold op(s) not taken by next_ops"] if self._queued else [])
        if work:
            raise StreamingStateError(
                rule_message(
                    "finalize refused: " + "; ".join(work[:6]),
                    "the optimizer step must see every trajectory with its final coefficient",
                    "let the missing trajectories arrive and call next_ops() until it returns nothing",
                )
            )
        counts = self._acc.counts
        num_sequences = sum(self._sizes.values())
        scale = batch_scale(self.loss_agg_mode, num_tokens=counts.num_tokens, num_sequences=num_sequences,
                            dp_size=1, loss_scale_factor=self.loss_scale_factor)
        if scale is not None:
            scale *= self._view.barrier_factor()  # GPG's alpha; 1 for the other estimators
        if scale is None or not math.isfinite(scale):
            raise StreamingStateError(
                rule_message(
                    "finalize refused: the batch has no scored tokens",
                    f"the {self.loss_agg_mode} normaliser divides by that count (verl would produce NaN)",
                    "drop the batch (begin_batch again) instead of stepping",
                )
            )
        self._acc.abort_batch()  # the shadow holds no gradient: ending it is all the barrier needs
        return FinalizeOp(scale, counts.num_tokens, num_sequences)

    # ----- accounting ---------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Shadow accounting: buffers x ``grad_numel`` float32 values (one local gradient shard).

        As in the core, the figures include the batch gradient itself (one buffer, the worker's
        ``.grad``); the worker's ``stream/peak_bytes`` counts bucket buffers only. ``budget_bytes``
        bounds ``reserved_bytes``: a new group waits in ``rank_ready().wait`` until it fits.
        """
        acc = self._acc
        return {"bytes_in_use": acc.bytes_in_use, "peak_bytes": acc.peak_bytes, "reserved_bytes": acc.reserved_bytes,
                "open_groups": acc.open_groups, "peak_open_groups": acc.peak_open_groups}

    def pending_work(self) -> list[str]:
        return self._acc.pending_work()


# ----- config ----------------------------------------------------------------------------

def settings_from_verl_config(config: Any, *, train_batch_size: int | None = None, adv_estimator: str | None = None,
                              norm_adv_by_std_in_grpo: bool | None = None, loss_agg_mode: str | None = None,
                              rollout_is: str | None = None, rollout_is_threshold: float | str | None = None,
                              rollout_is_batch_normalize: bool | None = None) -> StreamingSettings:
    """Validate a verl config (the trainer's, or its ``actor_rollout_ref``) for streaming.

    Raises ``StreamingConfigError`` naming the key to change. Keyword arguments supply what an
    ``actor_rollout_ref``-only config lacks (the worker passes them from the batch meta: the trainer's
    ``rollout_correction_meta``).
    """
    full = _get(config, "actor_rollout_ref") is not None
    arr = _get(config, "actor_rollout_ref") if full else config
    actor = _get(arr, "actor")
    mode = _get(actor, "loss_agg_mode", "token-mean")
    if loss_agg_mode is not None and loss_agg_mode != mode:
        raise StreamingConfigError(
            rule_message(
                f"the batch asks for loss_agg_mode={loss_agg_mode!r} but actor_rollout_ref.actor.loss_agg_mode={mode!r}",
                "the streamed loss must aggregate tokens exactly like verl's configured loss",
                "send the actor's loss_agg_mode in the batch meta, or change the config",
            )
        )
    mini = int(_get(actor, "ppo_mini_batch_size"))
    tbs = train_batch_size if train_batch_size is not None else (_get(config, "data.train_batch_size") if full else None)
    low = _get(actor, "clip_ratio_low", _get(actor, "clip_ratio", 0.2))
    rc = "algorithm.rollout_correction"
    settings = validate_streaming_config(
        ppo_epochs=int(_get(actor, "ppo_epochs", 1)),
        ppo_mini_batch_size=mini,
        train_batch_size=int(tbs) if tbs is not None else mini,
        rollout_n=int(_get(arr, "rollout.n", 1)),
        loss_agg_mode=mode,
        loss_scale_factor=_get(actor, "loss_scale_factor"),
        policy_loss_mode=_get(actor, "policy_loss.loss_mode", "vanilla"),
        dro_beta=_get(actor, "policy_loss.dro_beta"),
        clip_ratio_low=float(low),
        clip_ratio_high=float(_get(actor, "clip_ratio_high", low)),
        clip_ratio_c=float(_get(actor, "clip_ratio_c", 3.0)),
        adv_estimator=adv_estimator or (_get(config, "algorithm.adv_estimator", "grpo") if full else "grpo"),
        norm_adv_by_std_in_grpo=bool(norm_adv_by_std_in_grpo if norm_adv_by_std_in_grpo is not None
                                     else (_get(config, "algorithm.norm_adv_by_std_in_grpo", True) if full else True)),
        gamma=float(_get(config, "algorithm.gamma", 1.0)) if full else 1.0,
        use_kl_loss=bool(_get(actor, "use_kl_loss", False)),
        kl_loss_type=_get(actor, "kl_loss_type", "low_var_kl"),
        rollout_is=_get(config, f"{rc}.rollout_is") if full else rollout_is,
        rollout_is_threshold=(_get(config, f"{rc}.rollout_is_threshold", 2.0) if full
                              else 2.0 if rollout_is_threshold is None else rollout_is_threshold),
        rollout_is_batch_normalize=bool(_get(config, f"{rc}.rollout_is_batch_normalize", False) if full
                                        else rollout_is_batch_normalize),
        bypass_mode=bool(_get(config, f"{rc}.bypass_mode", False)) if full else False,
        bypass_loss_type=_get(config, f"{rc}.loss_type", "ppo_clip") if full else "ppo_clip",
    )
    if full and _get(config, f"{rc}.rollout_rs") is not None:
        raise StreamingConfigError(rule_message(
            f"{rc}.rollout_rs={_get(config, f'{rc}.rollout_rs')!r} (rejection sampling) cannot be streamed yet",
            "it removes tokens from the response mask after the old-log-prob forward, which changes the batch's token "
            "count and the group statistics the stream fixes on arrival",
            f"set {rc}.rollout_rs=null (rollout_is weights stream), or run mode=sync"))
    steps = int(_get(actor, "ppo_epochs", 1)) * (int(tbs) if tbs is not None else mini) // mini  # as validate_streaming_config
    _check_policy_term_only(actor, settings, optimizer_steps=steps)
    return settings


def rollout_correction_meta(config: Any) -> dict:
    """The ``algorithm.rollout_correction`` keys the learner's loss needs (``stream_loss.py`` point 8), for the batch
    meta: the worker holds only ``actor_rollout_ref``."""
    rc = "algorithm.rollout_correction"
    level = _get(config, f"{rc}.rollout_is")
    if level is None:
        return {}
    return {"rollout_is": level, "rollout_is_threshold": _get(config, f"{rc}.rollout_is_threshold", 2.0),
            "rollout_is_batch_normalize": bool(_get(config, f"{rc}.rollout_is_batch_normalize", False))}


def _check_policy_term_only(actor: Any, settings: StreamingSettings, *, optimizer_steps: int = 1) -> None:
    """The streaming worker's loss is the policy term at ratio 1 (times verl's rollout IS weights, ``stream_loss.py``
    point 8) plus verl's KL loss and entropy bonus (point 6: advantage-free per-token terms)."""
    extra = []
    if not settings.ratio_is_one:
        extra.append("algorithm.rollout_correction.bypass_mode=false")
    if settings.rollout_is is not None and optimizer_steps > 1:
        extra.append("algorithm.rollout_correction.rollout_is=null, or one mini-batch per step "
                     "(actor.ppo_mini_batch_size = data.train_batch_size, ppo_epochs=1): later mini-batches' PPO "
                     "chunks carry no IS weights")
    if extra:
        raise StreamingConfigError(
            rule_message(
                "the streaming learner streams the policy-gradient term (ratio 1, with verl's rollout IS weights in "
                "the first mini-batch), KL loss and entropy bonus only",
                "other importance-weight terms are not part of its chunk loss, so the update would silently differ "
                "from verl's",
                "set " + ", ".join(extra),
            )
        )
