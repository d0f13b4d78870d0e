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
6. The class is a facade over two parts: ``BatchLedger`` (ledger.py: groups, counts,
   reservations, buffer keys; no tensors) and ``GradientBuffers`` (gradients.py: the tensors).
   folding.py turns ledger decisions into buffer arithmetic; scheduling.py and chunks.py plan
   and add shared backwards; barrier.py steps. None of them imports this module.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Hashable, Mapping, Sequence

import torch

from thundersync_verl.core.barrier import BarrierReport, compute_batch_gradient, finish_batch
from thundersync_verl.core.buffers import GradLayout
from thundersync_verl.core.chunks import add_chunk_grad
from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError, rule_message
from thundersync_verl.core.folding import advance_commits, close_group, route, route_pending, store_independent
from thundersync_verl.core.gradients import GradientBuffers
from thundersync_verl.core.groups import ANY, NEG, POS, TrajectoryState, check_reward, check_same_reward, variant_of
from thundersync_verl.core.ledger import PATHS, BatchLedger
from thundersync_verl.core.normalizers import check_count
from thundersync_verl.core.scheduling import ChunkPlan, ScheduleHint, plan_chunk, rank_ready, split_into_chunks

__all__ = ["PATHS", "ChunkPlan", "StreamingGradientAccumulator"]


class _Owned:
    """A read-only attribute of the accumulator, read from the part that owns it."""

    def __init__(self, part: str, name: str):
        self.part, self.name = part, name

    def __get__(self, obj, objtype=None):
        return self if obj is None else getattr(attrgetter(self.part)(obj), self.name)

    def __set__(self, obj, value) -> None:
        raise AttributeError(f"{self.name} is read-only here: it belongs to the accumulator's {self.part}")


def _reads_from(part: str, *names: str):
    """Class decorator: read-only attributes ``names``, each read from the instance's ``part``."""

    def decorate(cls):
        for name in names:
            setattr(cls, name, _Owned(part, name))
        return cls

    return decorate


# settings and accounting figures, read-only: the ledger and its budget own them
@_reads_from(
    "ledger", "estimator", "loss_agg_mode", "loss_scale_factor", "path", "canonical_order", "sign_buckets",
    "independent_terms", "max_distinct_rewards", "variants", "batch_open", "counts",
)
@_reads_from("ledger.budget", "bytes_in_use", "peak_bytes", "reserved_bytes", "open_groups", "peak_open_groups")
class StreamingGradientAccumulator:
    """Accumulates streamed per-trajectory gradients into the exact batch gradient."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        storage: str = "device",
        accum_dtype: torch.dtype | None = None,
        **settings,
    ):
        """``params``: the local parameter shards (their shapes, devices and dtypes fix the layout).

        ``storage`` ("device" or "host") places the open-group buffers; ``accum_dtype`` is the
        dtype they sum in. ``settings`` go to ``BatchLedger``: ``estimator`` (required),
        ``loss_agg_mode``, ``loss_scale_factor``, ``path`` ("auto", "affine", "buckets"),
        ``canonical_order``, ``sign_buckets``, ``independent_terms``, ``budget_bytes`` and
        ``max_distinct_rewards``.
        """
        self.layout = GradLayout.from_tensors(list(params), accum_dtype)
        self.buffers = GradientBuffers(self.layout, storage=storage)
        self.ledger = BatchLedger(buffer_bytes=self.layout.buffer_bytes, **settings)

    def reset_peaks(self) -> None:
        """Restart peak_bytes / peak_open_groups from the current usage (e.g. per batch)."""
        self.ledger.budget.reset_peaks()

    def group_reservation(self, gid: Hashable) -> int:
        """Buffers a group reserves when it first needs memory (its worst case)."""
        return self.ledger.group_reservation(self.ledger.group(gid))

    # ----- batch lifecycle ----------------------------------------------------------------
    def begin_batch(
        self, group_sizes: Mapping[Hashable, int], local_members: Mapping[Hashable, Sequence[Hashable]] | None = None
    ) -> None:
        """Declare the groups of a new batch: {group_id: n}, and optionally this rank's members."""
        self.ledger.begin(group_sizes, local_members)
        self.buffers.open_batch()

    def abort_batch(self) -> None:
        """Drop the current batch without stepping (e.g. after a failed rollout)."""
        self.ledger.end()
        self.buffers.close_batch()

    # ----- rewards ------------------------------------------------------------------------
    def report_reward(self, gid: Hashable, tid: Hashable, reward: float) -> None:
        """Record a trajectory's reward; the last reward of a group closes and folds it."""
        self.ledger.require_batch()
        g = self.ledger.group(gid)
        g.check_member(tid, for_gradient=False)
        r = check_reward(gid, tid, reward)
        traj = g.trajs.get(tid)
        if traj is not None and traj.reward is not None:
            check_same_reward(gid, tid, traj.reward, r)
            return
        coefs = self.ledger.coefs_if_closing(g, tid, r)
        if coefs is None and traj is not None and traj.pending:
            self.ledger.check_bucket_room(g, r)
        traj = g.trajs.setdefault(tid, TrajectoryState())
        traj.reward = r
        if coefs is not None:
            close_group(self.ledger, self.buffers, g, coefs)
        elif traj.pending:
            route_pending(self.ledger, self.buffers, g, tid)
        advance_commits(self.ledger, self.buffers)

    # ----- policy gradients ---------------------------------------------------------------
    def required_variants(self, gid: Hashable, tid: Hashable) -> tuple[str, ...]:
        """Which gradients add_policy_grad needs for this trajectory right now.

        (ANY,) without sign buckets; with sign buckets (POS, NEG) while the group is open, the
        one sign class of its advantage once closed, and () when that advantage is 0.
        """
        self.ledger.require_batch()
        g = self.ledger.group(gid)
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
        ledger = self.ledger
        ledger.require_batch()
        g, traj = ledger.unprocessed((gid, tid))
        check_count("num_tokens", num_tokens)
        known = traj.reward if traj is not None else None
        r = None if reward is None else check_reward(gid, tid, reward)
        if r is not None and known is not None:
            check_same_reward(gid, tid, known, r)
        eff = known if known is not None else r
        coefs = None if (r is None or known is not None) else ledger.coefs_if_closing(g, tid, r)
        closed_after = g.closed or coefs is not None
        variants = self._variant_grads(g, tid, closed_after, coefs, grads, grads_negative)
        pending = eff is None and not closed_after and self.path != "canonical"
        if eff is not None and not closed_after:
            ledger.check_bucket_room(g, eff)
        ledger.reserve(g, need_group=not closed_after or self.path == "canonical", pending=pending, tid=tid)
        traj = ledger.mark_processed(g, tid, num_tokens)
        if r is not None and known is None:
            traj.reward = r
        if coefs is not None:
            close_group(ledger, self.buffers, g, coefs)
        route(ledger, self.buffers, g, tid, traj, variants, pending)
        advance_commits(ledger, self.buffers)

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
        ledger = self.ledger
        ledger.require_batch()
        self.layout.check(grads)
        check_count("num_tokens", num_tokens)
        check_count("num_sequences", num_sequences)
        g = traj = None
        if key is not None:
            g = ledger.group(key[0])
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
            ledger.reserve(g, need_group=True, pending=False, tid=None)
        if g is not None:
            traj = g.trajs.setdefault(key[1], TrajectoryState())  # type: ignore[index]
            traj.independent = True
        if self.path == "canonical":
            store_independent(ledger, self.buffers, g, key[1], grads)  # type: ignore[arg-type,index]
        else:
            self.buffers.add_to_batch(grads, 1.0)
        ledger.count(num_tokens, num_sequences)
        advance_commits(ledger, self.buffers)

    def add_independent_grad_from_params(self, params: Sequence[torch.Tensor], **kwargs) -> None:
        """Harvest ``p.grad`` as a reward-independent gradient, then zero it."""
        self.add_independent_grad([p.grad for p in params], **kwargs)
        _zero_grads(params)

    # ----- chunks, scheduling, barrier (thin wrappers; see those modules) -------------------
    def plan_chunk(self, items: Sequence[tuple[Hashable, Hashable]]) -> ChunkPlan:
        """Loss weights letting ``items`` share one backward (scheduling.plan_chunk)."""
        return plan_chunk(self.ledger, items)

    def add_chunk_grad(self, plan: ChunkPlan, grads, num_tokens: Sequence[int], grads_negative=None) -> None:
        """Add the gradient of a planned chunk (chunks.add_chunk_grad)."""
        add_chunk_grad(self.ledger, self.buffers, plan, grads, num_tokens, grads_negative)

    def rank_ready(self, items: Sequence[tuple[Hashable, Hashable]]) -> ScheduleHint:
        """Ready trajectories ordered to bound open groups, plus those that must wait."""
        return rank_ready(self.ledger, items)

    def split_into_chunks(self, items, max_chunk_size: int, min_open_chunk: int = 1):
        """Ranked ready trajectories grouped into valid chunks, plus the waiting ones."""
        return split_into_chunks(self.ledger, items, max_chunk_size, min_open_chunk)

    def pending_work(self) -> list[str]:
        """What still blocks the barrier (empty when the step may run)."""
        return self.ledger.pending_work()

    def compute_batch_gradient(self, **normaliser) -> list[torch.Tensor]:
        """A normalised copy of the batch gradient; the batch stays open."""
        return compute_batch_gradient(self.ledger, self.buffers, **normaliser)

    def finish_batch(self, params=None, **kwargs) -> BarrierReport:
        """The barrier: normalise, write, reduce, clip, step, schedule, zero (barrier.py)."""
        return finish_batch(self.ledger, self.buffers, params, **kwargs)


def _zero_grads(params: Sequence[torch.Tensor]) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.zero_()
