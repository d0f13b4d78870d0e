"""The batch ledger: everything the streaming accumulator knows about a batch except the gradients.

Why:
1. Exactness depends on bookkeeping, not on tensors: which groups the batch has, which rewards
   and gradients arrived, which groups are closed and with which coefficients, how many tokens
   and sequences the deferred normaliser will divide by. The ledger holds that and nothing
   else, so a planner without gradients (the trainer's stream plan) and the learner that
   holds them take the same decisions from the same code.
2. Memory is decided here too, in buffers of one fixed size: each group reserves its worst
   case when it first needs memory (2 buffers on the affine path, one per distinct reward and
   sign class for buckets, one per member and variant for the canonical order), under the
   byte budget of ``MemoryBudget``. Every buffer that exists is recorded here by owner and
   name (e.g. a group's reward bucket ``("bucket", r, sign)``); the tensors behind those keys
   live in ``GradientBuffers`` (gradients.py), which the ledger's decisions drive (folding.py).
3. Canonical order keeps room for the first uncommitted group (the head): a later group is
   admitted only if the head's worst case still fits afterwards, so the fixed commit order can
   never deadlock on memory.
4. Every check raises before anything is mutated, so a rejected call leaves the ledger as it
   was.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

from thundersync_verl.core.budget import MemoryBudget
from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError, StreamingStateError, int_at_least, rule_message
from thundersync_verl.core.estimators import GroupEstimator
from thundersync_verl.core.groups import ANY, NEG, POS, GroupState, TrajectoryState, canonical_sorted, check_group_sizes
from thundersync_verl.core.normalizers import BatchCounts, check_loss_agg_mode

PATHS = ("auto", "affine", "buckets")
BATCH_OWNER = ("batch",)
Item = tuple[Hashable, Hashable]


def group_owner(gid: Hashable) -> tuple:
    """Owner of an open group's buffers (its sums, buckets, or stored members)."""
    return ("group", gid)


def pending_owner(gid: Hashable, tid: Hashable) -> tuple:
    """Owner of the buffers of a trajectory whose reward is not known yet."""
    return ("pending", gid, tid)


class BatchLedger:
    """Groups, arrivals, counts, reservations and buffer keys of the current batch."""

    def __init__(
        self,
        *,
        estimator: GroupEstimator,
        buffer_bytes: int,
        loss_agg_mode: str = "token-mean",
        loss_scale_factor: float | None = None,
        path: str = "auto",
        canonical_order: bool = False,
        sign_buckets: bool = False,
        independent_terms: bool = False,
        budget_bytes: int | None = None,
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
        if max_distinct_rewards is not None and not int_at_least(max_distinct_rewards, 1):
            raise StreamingConfigError(
                rule_message(
                    f"max_distinct_rewards must be a positive int or None (got {max_distinct_rewards!r})",
                    "it sizes the reward buckets reserved per open group",
                    "pass 2 for binary rewards, or None to reserve one bucket per member",
                )
            )
        self.max_distinct_rewards = max_distinct_rewards
        self.variants = (POS, NEG) if self.sign_buckets else (ANY,)
        self.budget = MemoryBudget(buffer_bytes, budget_bytes)
        self._groups: dict[Hashable, GroupState] = {}
        self._order: list[Hashable] = []
        self._commit_pos = 0
        self._open = False
        self._counts = BatchCounts()
        self._serial = 0
        self._buffers: dict[Hashable, list[Hashable]] = {}  # owner -> names of its buffers, in creation order

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

    # ----- the batch ----------------------------------------------------------------------
    @property
    def batch_open(self) -> bool:
        return self._open

    @property
    def serial(self) -> int:
        """Number of the current batch (chunk plans carry it)."""
        return self._serial

    @property
    def counts(self) -> BatchCounts:
        return BatchCounts(self._counts.num_tokens, self._counts.num_sequences)

    @property
    def groups(self) -> Mapping[Hashable, GroupState]:
        """The batch's groups by id (read them; mutate them only through the ledger's callers)."""
        return dict(self._groups)

    @property
    def order(self) -> tuple:
        """Group ids in canonical (sorted) order."""
        return tuple(self._order)

    @property
    def head(self) -> Hashable | None:
        """The first group not yet committed in canonical order (None when all are)."""
        return self._order[self._commit_pos] if self._commit_pos < len(self._order) else None

    def begin(self, group_sizes: Mapping[Hashable, int], local_members: Mapping | None = None) -> None:
        """Declare a new batch's groups and charge its batch buffer; raises before any change."""
        if self._open:
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
        worst = max((self.group_reservation(g) for g in groups.values()), default=0)
        need = (1 + worst) * self.budget.buffer_bytes
        if self.budget.budget_bytes is not None and need > self.budget.budget_bytes:
            raise StreamingConfigError(
                rule_message(
                    f"budget_bytes={self.budget.budget_bytes} cannot hold even one open group: the batch "
                    f"buffer plus {worst} group buffer(s) of {self.budget.buffer_bytes} bytes need {need}",
                    "a group keeps its members' gradients until its last reward is known; with no "
                    "room for one group streaming cannot make progress",
                    f"raise budget_bytes to at least {need}, use an affine estimator (2 buffers per "
                    "group), set max_distinct_rewards (e.g. 2 for binary rewards), or shard the "
                    "parameters over more ranks",
                )
            )
        self._groups, self._order = groups, canonical_sorted(groups)
        self._serial += 1
        self._commit_pos = 0
        self._counts = BatchCounts()
        self._open = True
        self.budget.reserve(BATCH_OWNER, 1, is_group=False)
        self.charge(BATCH_OWNER, "batch")

    def end(self) -> None:
        """Forget the batch and every reservation (its tensors must be dropped too)."""
        self.budget.release_all()
        self._buffers = {}
        self._groups, self._order = {}, []
        self._open = False
        self._commit_pos = 0

    def require_batch(self) -> None:
        if not self._open:
            raise StreamingStateError(
                rule_message(
                    "no batch is open",
                    "gradients and rewards belong to one batch sampled at one set of weights",
                    "call begin_batch({group_id: n, ...}) first",
                )
            )

    def group(self, gid: Hashable) -> GroupState:
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

    def unprocessed(self, item: Item) -> tuple[GroupState, TrajectoryState | None]:
        """The group and state of a trajectory that still waits for its backward, or raise."""
        gid, tid = item
        g = self.group(gid)
        g.check_member(tid, for_gradient=True)
        traj = g.trajs.get(tid)
        if traj is not None and traj.processed:
            raise StreamingInputError(
                rule_message(
                    f"trajectory {item!r} was already added",
                    "adding a gradient twice counts the trajectory twice in the batch gradient",
                    "add each trajectory once and drop it from the ready list then; use a fresh id "
                    "for a new sample",
                )
            )
        return g, traj

    def mark_processed(self, g: GroupState, tid: Hashable, num_tokens: int) -> TrajectoryState:
        """Record that ``tid``'s gradient arrived with ``num_tokens`` scored tokens."""
        traj = g.trajs.setdefault(tid, TrajectoryState())
        traj.processed = True
        self._counts.add(num_tokens, 1 if num_tokens > 0 else 0)
        return traj

    def count(self, num_tokens: int, num_sequences: int) -> None:
        """Add scored tokens and sequences to the deferred normaliser's counts."""
        self._counts.add(num_tokens, num_sequences)

    def pending_work(self) -> list[str]:
        """Everything that still blocks the barrier, one line per group."""
        if not self._open:
            return ["no batch is open"]
        out = []
        for gid in self._order:
            g = self._groups[gid]
            if not g.closed:
                out.append(f"group {gid!r} is open: {g.num_rewards}/{g.size} rewards known")
            missing = g.missing_local(self.independent_terms)
            if missing:
                out.append(f"group {gid!r} misses " + ", ".join(missing))
        return out

    # ----- closing --------------------------------------------------------------------------
    def coefs_if_closing(self, g: GroupState, tid: Hashable, r: float) -> dict | None:
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

    def check_bucket_room(self, g: GroupState, r: float) -> None:
        """Raise if reward ``r`` would need more reward buckets than the group reserved."""
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

    def head_complete(self) -> GroupState | None:
        """Canonical order: the head group if it is closed and has every local gradient."""
        if self._commit_pos >= len(self._order):
            return None
        g = self._groups[self._order[self._commit_pos]]
        return g if g.closed and g.locally_complete(self.independent_terms) else None

    def commit_head(self) -> None:
        """Canonical order: the head group is folded; the next one becomes the head."""
        self._groups[self._order[self._commit_pos]].committed = True
        self._commit_pos += 1

    # ----- memory ---------------------------------------------------------------------------
    def group_reservation(self, g: GroupState) -> int:
        """Buffers a group reserves when it first needs memory: its worst case on its path."""
        if self.path == "canonical":
            return g.n_local * (len(self.variants) + (1 if self.independent_terms else 0))
        if self.path == "affine":
            return 2
        cap = g.n_local if self.max_distinct_rewards is None else min(g.n_local, self.max_distinct_rewards)
        return cap * len(self.variants)

    def group_reserved(self, gid: Hashable) -> int:
        """Buffers group ``gid`` holds reserved right now (0 before it first needed memory)."""
        return self.budget.reserved_buffers(group_owner(gid))

    def reserve(self, g: GroupState, *, need_group: bool, pending: bool, tid: Hashable | None) -> None:
        """Reserve what one incoming gradient needs, all or nothing (raises before reserving)."""
        extra_group = 0
        if need_group and self.group_reserved(g.gid) == 0:
            extra_group = self.group_reservation(g)
        extra_pending = len(self.variants) if pending else 0
        headroom = self.canonical_headroom(g) if extra_group else 0
        self.budget.check_fits(group_owner(g.gid), extra_group + extra_pending + headroom)
        if extra_group:
            self.budget.reserve(group_owner(g.gid), extra_group, is_group=True)
        if extra_pending:
            self.budget.reserve(pending_owner(g.gid, tid), extra_pending, is_group=False)

    def canonical_headroom(self, g: GroupState, reserved_head: int | None = None) -> int:
        """Buffers to keep free for the head group when admitting non-head group ``g``."""
        if self.path != "canonical" or self._commit_pos >= len(self._order):
            return 0
        head = self._order[self._commit_pos]
        if g.gid == head:
            return 0
        worst = max(self.group_reservation(self._groups[gid]) for gid in self._order[self._commit_pos :])
        if reserved_head is None:
            reserved_head = self.group_reserved(head)
        return max(0, worst - reserved_head)

    def charge(self, owner: Hashable, name: Hashable) -> None:
        """Record a new buffer ``name`` of ``owner``, charged to its reservation."""
        if name in self._buffers.get(owner, ()):
            raise StreamingStateError(
                rule_message(
                    f"buffer {name!r} of {owner!r} already exists",
                    "a second buffer under one key would drop the first one's gradients",
                    "this is an internal accounting fault; report it with the call sequence",
                )
            )
        self.budget.charge(owner)
        self._buffers.setdefault(owner, []).append(name)

    def has_buffer(self, owner: Hashable, name: Hashable) -> bool:
        return name in self._buffers.get(owner, ())

    def buffer_names(self, owner: Hashable) -> Sequence[Hashable]:
        """Names of ``owner``'s buffers, in the order they were created."""
        return tuple(self._buffers.get(owner, ()))

    def release(self, owner: Hashable) -> None:
        """Forget ``owner``'s buffers and reservation (its tensors must be dropped too)."""
        self.budget.release(owner)
        self._buffers.pop(owner, None)
