"""Streaming gradient accumulator: one batch, fixed weights, exactly one optimizer step.

Why:
1. With one PPO epoch and one mini-batch every ratio is 1, so the batch gradient is
   g = c_batch * sum_i (-A_i) H_i with H_i = grad sum_t w_{i,t} log pi(a_{i,t} | h_{i,t}).
   H_i is computable as soon as trajectory i is finished; only the scalar -A_i waits for the
   group's rewards, and c_batch waits for the batch (see normalizers.py).
2. Three routes keep that sum exact while the batch is in flight:
   - closed group (all rewards known): H_i goes straight into the batch gradient with its
     final coefficient; no buffer;
   - open group, affine estimator (GRPO, Dr.GRPO, RLOO: A = alpha_g r + beta_g): two buffers
     S1 = sum (r_i - r_ref) H_i and S0 = sum H_i, folded at close as
     -(alpha S1 + (alpha r_ref + beta) S0). Shifting by the first reward r_ref keeps S1 small
     when rewards sit far from zero, so the fold does not cancel large terms;
   - open group, any estimator giving equal rewards equal advantages: one buffer per distinct
     reward, folded with -a(r) at close.
   A trajectory whose reward is still unknown is parked in a pending buffer until it arrives.
3. canonical_order=True stores each trajectory's gradient and folds groups strictly in sorted
   group order and members in sorted trajectory order: the update is then bitwise identical
   whatever order trajectories arrive in (given deterministic kernels). Cost: one buffer per
   processed member of every group that is not yet committed; at worst (the first group in
   canonical order finishes last) B*n buffers.
4. sign_buckets=True supports PPO's sign-dependent clip when ratio != 1: each open-group
   trajectory brings two gradients (token weights for A > 0 and for A < 0), kept per
   (group, reward, sign); at close each reward's sign picks one.
5. Every public method validates everything before it mutates anything: on an exception the
   accumulator is exactly as before the call. The barrier (barrier.py) refuses to step while a
   group is open or a local trajectory is unprocessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

import torch

from . import barrier as _barrier
from . import folding as _folding
from . import scheduling as _scheduling
from .buffers import BufferPool, GradLayout, axpy_, copy_into_
from .errors import StreamingConfigError, StreamingInputError, StreamingStateError, rule_message
from .estimators import GroupEstimator
from .groups import ANY, NEG, POS, GroupState, TrajectoryState, canonical_sorted, check_group_sizes
from .groups import check_reward, check_same_reward, variant_of
from .normalizers import BatchCounts, check_count, check_loss_agg_mode

PATHS = ("auto", "affine", "buckets")
_BATCH_OWNER = ("batch",)


@dataclass(frozen=True)
class ChunkPlan:
    """Trajectories that can share one backward: sum_i loss_weights[i] * sum_t w log pi."""

    batch_serial: int
    items: tuple[tuple[Hashable, Hashable], ...]
    loss_weights: tuple[float, ...]
    sign_classes: tuple[str | None, ...]  # per item, for sign buckets in closed groups
    destination: str  # "direct" (closed groups) or "bucket" (one open group, one reward)
    reward: float | None = None


class StreamingGradientAccumulator:
    """Accumulates streamed per-trajectory gradients into the exact batch gradient."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        estimator: GroupEstimator,
        loss_agg_mode: str = "token-mean",
        loss_scale_factor: float | None = None,
        path: str = "auto",
        canonical_order: bool = False,
        sign_buckets: bool = False,
        independent_terms: bool = False,
        budget_bytes: int | None = None,
        storage: str = "device",
        accum_dtype: torch.dtype | None = None,
        max_distinct_rewards: int | None = None,
    ):
        check_loss_agg_mode(loss_agg_mode, loss_scale_factor)
        self.estimator = estimator
        self.loss_agg_mode = loss_agg_mode
        self.loss_scale_factor = loss_scale_factor
        self.canonical_order = bool(canonical_order)
        self.sign_buckets = bool(sign_buckets)
        self.independent_terms = bool(independent_terms)
        self.path = self._choose_path(path)
        bad = isinstance(max_distinct_rewards, bool) or not isinstance(max_distinct_rewards, int)
        if max_distinct_rewards is not None and (bad or max_distinct_rewards < 1):
            raise StreamingConfigError(
                rule_message(
                    f"max_distinct_rewards must be a positive int or None (got {max_distinct_rewards!r})",
                    "it sizes the reward buckets reserved per open group",
                    "pass 2 for binary rewards, or None to reserve one bucket per member",
                )
            )
        self.max_distinct_rewards = max_distinct_rewards
        self.variants = (POS, NEG) if self.sign_buckets else (ANY,)
        self.layout = GradLayout.from_tensors(list(params), accum_dtype)
        self.pool = BufferPool(self.layout, storage=storage, budget_bytes=budget_bytes)
        self._groups: dict[Hashable, GroupState] = {}
        self._order: list[Hashable] = []
        self._commit_pos = 0
        self._direct: list[torch.Tensor] | None = None
        self._counts = BatchCounts()
        self._serial = 0

    def _choose_path(self, path: str) -> str:
        if path not in PATHS:
            raise StreamingConfigError(
                rule_message(f"path={path!r} is unknown", "it selects how open groups are buffered", f"use one of {PATHS}")
            )
        if self.canonical_order:
            return "canonical"
        affine_ok = self.estimator.is_affine and not self.sign_buckets
        if path == "affine" and not affine_ok:
            raise StreamingConfigError(
                rule_message(
                    f"path='affine' needs an affine estimator without sign buckets (estimator "
                    f"{self.estimator.name!r}, sign_buckets={self.sign_buckets})",
                    "the two-buffer fold relies on A = alpha_g * r + beta_g with one gradient per member",
                    "use path='buckets' or path='auto'",
                )
            )
        return "affine" if (path == "affine" or (path == "auto" and affine_ok)) else "buckets"

    # ----- accounting ---------------------------------------------------------------------
    @property
    def batch_open(self) -> bool:
        return self._direct is not None

    @property
    def bytes_in_use(self) -> int:
        return self.pool.bytes_in_use

    @property
    def peak_bytes(self) -> int:
        return self.pool.peak_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.pool.reserved_bytes

    @property
    def open_groups(self) -> int:
        return self.pool.open_groups

    @property
    def peak_open_groups(self) -> int:
        return self.pool.peak_open_groups

    @property
    def counts(self) -> BatchCounts:
        return BatchCounts(self._counts.num_tokens, self._counts.num_sequences)

    def reset_peaks(self) -> None:
        """Restart peak_bytes / peak_open_groups from the current usage (e.g. per batch)."""
        self.pool.peak_bytes = self.pool.bytes_in_use
        self.pool.peak_open_groups = self.pool.open_groups

    def group_reservation(self, gid: Hashable) -> int:
        """Buffers a group reserves when it first needs memory (its worst case)."""
        return _scheduling.group_reservation(self, self._group(gid))

    # ----- batch lifecycle ----------------------------------------------------------------
    def begin_batch(
        self, group_sizes: Mapping[Hashable, int], local_members: Mapping[Hashable, Sequence[Hashable]] | None = None
    ) -> None:
        """Declare the groups of a new batch: {group_id: n}, and optionally this rank's members."""
        if self.batch_open:
            raise StreamingStateError(
                rule_message(
                    "begin_batch called while a batch is open",
                    "each batch ends with exactly one optimizer step; mixing two batches would "
                    "sum gradients taken at different weights",
                    "call finish_batch (or abort_batch) first",
                )
            )
        spec = check_group_sizes(group_sizes, local_members)
        groups = {gid: GroupState(gid, size, local) for gid, (size, local) in spec.items()}
        self._groups, self._order = groups, canonical_sorted(groups)
        worst = max((self.group_reservation(gid) for gid in groups), default=0)
        need = (1 + worst) * self.pool.buffer_bytes
        if self.pool.budget_bytes is not None and need > self.pool.budget_bytes:
            self._groups, self._order = {}, []
            raise StreamingConfigError(
                rule_message(
                    f"budget_bytes={self.pool.budget_bytes} cannot hold even one open group: the batch "
                    f"buffer plus {worst} group buffer(s) of {self.pool.buffer_bytes} bytes need {need}",
                    "a group keeps its members' gradients until its last reward is known; with no "
                    "room for one group streaming cannot make progress",
                    f"raise budget_bytes to at least {need}, use an affine estimator (2 buffers per "
                    "group), set max_distinct_rewards (e.g. 2 for binary rewards), or shard the "
                    "parameters over more ranks",
                )
            )
        self._serial += 1
        self._commit_pos = 0
        self._counts = BatchCounts()
        self.pool.reserve(_BATCH_OWNER, 1, is_group=False)
        self._direct = self.pool.allocate(_BATCH_OWNER, on_param_device=True)

    def abort_batch(self) -> None:
        """Drop the current batch without stepping (e.g. after a failed rollout)."""
        self._end_batch()

    def _end_batch(self) -> None:
        self.pool.release_all()
        self._groups, self._order, self._direct = {}, [], None
        self._commit_pos = 0

    def _require_batch(self) -> None:
        if not self.batch_open:
            raise StreamingStateError(
                rule_message(
                    "no batch is open",
                    "gradients and rewards belong to one batch sampled at one set of weights",
                    "call begin_batch({group_id: n, ...}) first",
                )
            )

    def _group(self, gid: Hashable) -> GroupState:
        g = self._groups.get(gid)
        if g is None:
            raise StreamingInputError(
                rule_message(
                    f"group {gid!r} is not part of the current batch",
                    "only declared groups have a known size, and so a defined closing point",
                    "declare it in begin_batch, or check the group id",
                )
            )
        return g

    # ----- rewards ------------------------------------------------------------------------
    def report_reward(self, gid: Hashable, tid: Hashable, reward: float) -> None:
        """Record a trajectory's reward; the last reward of a group closes and folds it."""
        self._require_batch()
        g = self._group(gid)
        g.check_member(tid, for_gradient=False)
        r = check_reward(gid, tid, reward)
        traj = g.trajs.get(tid)
        if traj is not None and traj.reward is not None:
            check_same_reward(gid, tid, traj.reward, r)
            return
        coefs = self._coefs_if_closing(g, tid, r)
        if coefs is None and traj is not None and traj.pending is not None:
            self._check_bucket_room(g, r)
        traj = g.trajs.setdefault(tid, TrajectoryState())
        traj.reward = r
        if coefs is not None:
            _folding.close_group(self, g, coefs)
        elif traj.pending is not None:
            _folding.route_open(self, g, traj.pending, r)
            traj.pending = None
            self.pool.release(("pending", gid, tid))
        _folding.advance_commits(self)

    def _coefs_if_closing(self, g: GroupState, tid: Hashable, r: float) -> dict | None:
        """The group's coefficients if recording reward ``r`` for ``tid`` closes it, else None."""
        has = tid in g.trajs and g.trajs[tid].reward is not None
        if g.closed or has or g.num_rewards + 1 < g.size:
            return None
        saved = g.trajs.get(tid)
        probe = TrajectoryState(reward=r) if saved is None else TrajectoryState(reward=r, processed=saved.processed)
        g.trajs[tid] = probe
        try:
            return g.compute_coefficients(self.estimator)
        finally:
            if saved is None:
                del g.trajs[tid]
            else:
                g.trajs[tid] = saved

    def _check_bucket_room(self, g: GroupState, r: float) -> None:
        if self.path != "buckets" or self.max_distinct_rewards is None:
            return
        distinct = g.distinct_rewards()
        if r not in distinct and len(distinct) + 1 > self.max_distinct_rewards:
            raise StreamingInputError(
                rule_message(
                    f"group {g.gid!r} would hold {len(distinct) + 1} distinct rewards, more than "
                    f"max_distinct_rewards={self.max_distinct_rewards}",
                    "each distinct reward of an open group needs its own buffer and the group "
                    "reserved only max_distinct_rewards of them",
                    "raise max_distinct_rewards (or leave it None), or use an affine estimator",
                )
            )

    # ----- policy gradients ---------------------------------------------------------------
    def required_variants(self, gid: Hashable, tid: Hashable) -> tuple[str, ...]:
        """Which gradients add_policy_grad needs for this trajectory right now.

        (ANY,) without sign buckets; with sign buckets (POS, NEG) while the group is open, the
        one sign class of its advantage once closed, and () when that advantage is 0.
        """
        self._require_batch()
        g = self._group(gid)
        if not self.sign_buckets:
            return (ANY,)
        if not g.closed or self.path == "canonical":
            return (POS, NEG)
        v = variant_of(g.coefs[tid])
        return () if v is None else (v,)

    def add_policy_grad(
        self,
        gid: Hashable,
        tid: Hashable,
        grads: Sequence[torch.Tensor | None] | None,
        num_tokens: int,
        reward: float | None = None,
        grads_negative: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Add H_i = grad sum_t w_{i,t} log pi for one finished trajectory.

        ``grads`` are the local gradient shards of an UNWEIGHTED-by-advantage backward; the
        accumulator applies -A_i. With sign buckets ``grads`` uses the A > 0 token weights and
        ``grads_negative`` the A < 0 ones (see ``required_variants``).
        """
        self._require_batch()
        g = self._group(gid)
        g.check_member(tid, for_gradient=True)
        traj = g.trajs.get(tid)
        if traj is not None and traj.processed:
            raise StreamingInputError(
                rule_message(
                    f"trajectory ({gid!r}, {tid!r}) was already added",
                    "adding a gradient twice counts the trajectory twice in the batch gradient",
                    "add each trajectory once; use a fresh id for a new sample",
                )
            )
        check_count("num_tokens", num_tokens)
        known = traj.reward if traj is not None else None
        r = None if reward is None else check_reward(gid, tid, reward)
        if r is not None and known is not None:
            check_same_reward(gid, tid, known, r)
        eff = known if known is not None else r
        coefs = None if (r is None or known is not None) else self._coefs_if_closing(g, tid, r)
        closed_after = g.closed or coefs is not None
        variants = self._variant_grads(g, tid, closed_after, coefs, grads, grads_negative)
        pending = eff is None and not closed_after and self.path != "canonical"
        if eff is not None and not closed_after:
            self._check_bucket_room(g, eff)
        _scheduling.reserve(self, g, need_group=not closed_after or self.path == "canonical", pending=pending, tid=tid)
        traj = g.trajs.setdefault(tid, TrajectoryState())
        traj.processed = True
        self._counts.add(num_tokens, 1 if num_tokens > 0 else 0)
        if r is not None and known is None:
            traj.reward = r
        if coefs is not None:
            _folding.close_group(self, g, coefs)
        _folding.route(self, g, tid, traj, variants, pending)
        _folding.advance_commits(self)

    def add_policy_grad_from_params(
        self, params: Sequence[torch.Tensor], gid: Hashable, tid: Hashable, num_tokens: int, reward: float | None = None
    ) -> None:
        """Harvest ``p.grad`` of plain tensors as H_i, add it, then zero those gradients."""
        self.add_policy_grad(gid, tid, [p.grad for p in params], num_tokens, reward=reward)
        _zero_grads(params)

    def _variant_grads(self, g, tid, closed_after, coefs, grads, grads_negative) -> dict:
        if not self.sign_buckets:
            if grads_negative is not None:
                raise StreamingConfigError(
                    rule_message(
                        "grads_negative given without sign_buckets",
                        "a second gradient only makes sense when PPO's clip depends on the sign of A",
                        "construct the accumulator with sign_buckets=True, or drop grads_negative",
                    )
                )
            need: tuple[str, ...] = (ANY,)
        elif closed_after and self.path != "canonical":
            v = variant_of((coefs or g.coefs)[tid])
            need = () if v is None else (v,)
        else:
            need = (POS, NEG)
        given = {ANY: grads, POS: grads, NEG: grads_negative}
        out = {}
        for v in need:
            name = "grads_negative" if v == NEG else "grads"
            if given[v] is None:
                raise StreamingInputError(
                    rule_message(
                        f"trajectory ({g.gid!r}, {tid!r}) needs {name} (sign class {v!r})",
                        "with sign buckets the token weights of PPO's clip depend on the sign of "
                        "the advantage, which is unknown while the group is open",
                        "pass the gradients listed by required_variants(gid, tid)",
                    )
                )
            self.layout.check(given[v], name)
            out[v] = given[v]
        return out

    # ----- reward-independent terms -------------------------------------------------------
    def add_independent_grad(
        self,
        grads: Sequence[torch.Tensor | None],
        *,
        key: tuple[Hashable, Hashable] | None = None,
        num_tokens: int = 0,
        num_sequences: int = 0,
    ) -> None:
        """Add a gradient that needs no advantage (KL to reference, entropy, OPD turns).

        It shares the deferred normaliser, so it must use the same token weights w_{i,t}.
        ``num_tokens``/``num_sequences`` count new scored tokens and sequences (0 when the
        trajectory was already counted by add_policy_grad). ``key`` ties it to a trajectory;
        canonical order needs it (and ``independent_terms=True``).
        """
        self._require_batch()
        self.layout.check(grads)
        check_count("num_tokens", num_tokens)
        check_count("num_sequences", num_sequences)
        g = traj = None
        if key is not None:
            g = self._group(key[0])
            g.check_member(key[1], for_gradient=True)
            traj = g.trajs.get(key[1])
            if traj is not None and traj.independent:
                raise StreamingInputError(
                    rule_message(
                        f"reward-independent gradient of {key!r} was already added",
                        "adding it twice doubles the KL/entropy term of that trajectory",
                        "add it once per trajectory",
                    )
                )
        if (self.path == "canonical" or self.independent_terms) and (g is None or not self.independent_terms):
            raise StreamingConfigError(
                rule_message(
                    "canonical order and independent_terms=True need independent gradients keyed by "
                    "(group_id, traj_id), with independent_terms=True",
                    "a fixed reduction order must know where each term goes in the sum, and the "
                    "barrier checks that every trajectory's term arrived",
                    "construct with independent_terms=True and pass key=(gid, tid)",
                )
            )
        if self.path == "canonical":
            _scheduling.reserve(self, g, need_group=True, pending=False, tid=None)
        if g is not None:
            traj = g.trajs.setdefault(key[1], TrajectoryState())  # type: ignore[index]
            traj.independent = True
        if self.path == "canonical":
            buf = self.pool.allocate(("group", g.gid))  # type: ignore[union-attr]
            copy_into_(buf, grads)
            traj.stored["independent"] = buf  # type: ignore[union-attr]
        else:
            axpy_(self._direct, grads, 1.0)  # type: ignore[arg-type]
        self._counts.add(num_tokens, num_sequences)
        _folding.advance_commits(self)

    def add_independent_grad_from_params(self, params: Sequence[torch.Tensor], **kwargs) -> None:
        """Harvest ``p.grad`` as a reward-independent gradient, then zero it."""
        self.add_independent_grad([p.grad for p in params], **kwargs)
        _zero_grads(params)

    # ----- chunks, scheduling, barrier (thin wrappers; see those modules) -------------------
    def plan_chunk(self, items: Sequence[tuple[Hashable, Hashable]]) -> ChunkPlan:
        """Loss weights letting ``items`` share one backward (scheduling.plan_chunk)."""
        return _scheduling.plan_chunk(self, items)

    def add_chunk_grad(self, plan: ChunkPlan, grads, num_tokens: Sequence[int], grads_negative=None) -> None:
        """Add the gradient of a planned chunk (scheduling.add_chunk_grad)."""
        _scheduling.add_chunk_grad(self, plan, grads, num_tokens, grads_negative)

    def rank_ready(self, items: Sequence[tuple[Hashable, Hashable]]) -> "_scheduling.ScheduleHint":
        """Ready trajectories ordered to bound open groups, plus those that must wait."""
        return _scheduling.rank_ready(self, items)

    def split_into_chunks(self, items, max_chunk_size: int, min_open_chunk: int = 1):
        """Ranked ready trajectories grouped into valid chunks, plus the waiting ones."""
        return _scheduling.split_into_chunks(self, items, max_chunk_size, min_open_chunk)

    def pending_work(self) -> list[str]:
        """What still blocks the barrier (empty when the step may run)."""
        return _barrier.pending_work(self)

    def compute_batch_gradient(self, **normaliser) -> list[torch.Tensor]:
        """A normalised copy of the batch gradient; the batch stays open."""
        return _barrier.compute_batch_gradient(self, **normaliser)

    def finish_batch(self, params=None, **kwargs) -> "_barrier.BarrierReport":
        """The barrier: normalise, write, reduce, clip, step, schedule, zero (barrier.py)."""
        return _barrier.finish_batch(self, params, **kwargs)


def _zero_grads(params: Sequence[torch.Tensor]) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.zero_()
