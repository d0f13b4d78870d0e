"""Per-group bookkeeping of the streaming accumulator: rewards, processed members, coefficients.

Why:
1. A group is OPEN until all of its n rewards are known; only then are its statistics (and so
   every member's coefficient) fixed. The group is the unit of buffering, budgeting and
   folding, so its state lives in one small object that the ledger drives. It holds no
   tensor: the gradient buffers are keyed by owner and name elsewhere (gradients.py).
2. Trajectories are identified by (group_id, traj_id). The caller declares each group's size
   per batch and, on a data-parallel rank that processes only some members, which members are
   local; rewards of remote members still count towards closing the group.
3. Coefficients are the LOSS coefficients -A_i (the policy loss is -A * log pi), computed from
   the rewards sorted by trajectory id so that they do not depend on arrival order.
4. All checks here raise before anything is mutated, so a rejected call leaves no trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Iterable

from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError, int_at_least, rule_message
from thundersync_verl.core.estimators import GroupEstimator

POS, NEG, ANY = "pos", "neg", "any"  # gradient variants: sign classes, or the single one


def canonical_sorted(keys: Iterable[Hashable]) -> list:
    """Keys in a fixed order: natural order when comparable, else by (type name, repr)."""
    keys = list(keys)
    try:
        return sorted(keys)
    except TypeError:
        return sorted(keys, key=lambda k: (type(k).__name__, repr(k)))


def check_reward(gid: Hashable, tid: Hashable, reward: object) -> float:
    """A finite float reward, or ``StreamingInputError``."""
    try:
        value = float(reward)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or isinstance(reward, bool):
        raise StreamingInputError(
            rule_message(
                f"reward of trajectory ({gid!r}, {tid!r}) must be a finite number (got {reward!r})",
                "one NaN or inf reward makes the group's mean and std non-finite and poisons the "
                "whole batch gradient",
                "fix the reward function, or map failures to a finite reward (e.g. 0.0) before "
                "reporting",
            )
        )
    return value


def check_same_reward(gid: Hashable, tid: Hashable, old: float, new: float) -> None:
    """A reward may be reported again only with the same value."""
    if old != new:
        raise StreamingInputError(
            rule_message(
                f"trajectory ({gid!r}, {tid!r}) already has reward {old}, now given {new}",
                "a reward may already be folded into the group statistics",
                "report each reward once, or fix the duplicate trajectory id",
            )
        )


@dataclass
class TrajectoryState:
    reward: float | None = None
    processed: bool = False
    independent: bool = False
    pending: bool = False  # its gradient waits in a pending buffer: reward unknown, group open


class GroupState:
    """One prompt group of the current batch."""

    def __init__(self, gid: Hashable, size: int, local: frozenset | None):
        self.gid = gid
        self.size = size
        self.local = local
        self.trajs: dict[Hashable, TrajectoryState] = {}
        self.closed = False
        self.committed = False
        self.coefs: dict[Hashable, float] = {}
        self.r_ref: float | None = None  # affine path: reward shift of the first member

    # ----- counts -----------------------------------------------------------------------
    @property
    def n_local(self) -> int:
        return self.size if self.local is None else len(self.local)

    @property
    def num_rewards(self) -> int:
        return sum(1 for t in self.trajs.values() if t.reward is not None)

    @property
    def num_processed(self) -> int:
        return sum(1 for t in self.trajs.values() if t.processed)

    def distinct_rewards(self) -> set[float]:
        return {t.reward for t in self.trajs.values() if t.processed and t.reward is not None}

    def missing_local(self, need_independent: bool) -> list[str]:
        """Human-readable list of local work still missing in this group."""
        missing = []
        if self.local is None:
            todo = self.size - self.num_processed
            if todo:
                missing.append(f"{todo} trajectory gradient(s)")
        else:
            absent = [t for t in canonical_sorted(self.local) if not self.trajs.get(t, TrajectoryState()).processed]
            if absent:
                missing.append(f"gradients of trajectories {absent}")
        if need_independent:
            lacking = [t for t, s in self.trajs.items() if s.processed and not s.independent]
            if lacking or self.num_processed < self.n_local:
                missing.append("reward-independent gradients")
        return missing

    def locally_complete(self, need_independent: bool) -> bool:
        return not self.missing_local(need_independent)

    # ----- validation -------------------------------------------------------------------
    def check_member(self, tid: Hashable, *, for_gradient: bool) -> None:
        """Raise unless ``tid`` may (still) join this group."""
        if tid not in self.trajs and len(self.trajs) >= self.size:
            raise StreamingInputError(
                rule_message(
                    f"group {self.gid!r} already has {self.size} trajectories; ({self.gid!r}, {tid!r}) "
                    "would be one more than its declared size",
                    "the group statistics (mean, std, leave-one-out baseline) are defined over "
                    "exactly the declared members",
                    "declare the right size in begin_batch, or check the trajectory ids",
                )
            )
        if for_gradient and self.local is not None and tid not in self.local:
            raise StreamingInputError(
                rule_message(
                    f"trajectory ({self.gid!r}, {tid!r}) is not a local member of its group",
                    "each trajectory's gradient must be added on exactly one data-parallel rank",
                    "add it on the rank whose begin_batch(local_members=...) lists it",
                )
            )

    # ----- closing ----------------------------------------------------------------------
    def sorted_rewards(self) -> tuple[list, list[float]]:
        tids = canonical_sorted(self.trajs)
        return tids, [self.trajs[t].reward for t in tids]  # type: ignore[misc]

    def compute_coefficients(self, estimator: GroupEstimator) -> dict[Hashable, float]:
        """Loss coefficients -A_i for every member, checking the equal-reward rule."""
        tids, rewards = self.sorted_rewards()
        adv = estimator.advantages(rewards)
        by_reward: dict[float, float] = {}
        for r, a in zip(rewards, adv):
            if not math.isfinite(a):
                raise StreamingInputError(
                    rule_message(
                        f"estimator {estimator.name!r} gave a non-finite advantage {a} in group {self.gid!r}",
                        "a non-finite coefficient poisons the batch gradient",
                        "check the rewards of this group and the estimator's epsilon",
                    )
                )
            if r in by_reward and by_reward[r] != a:
                raise StreamingConfigError(
                    rule_message(
                        f"estimator {estimator.name!r} gave reward {r} two different advantages "
                        f"({by_reward[r]} and {a}) in group {self.gid!r}",
                        "reward buckets fold all members with the same reward with ONE coefficient; "
                        "that is exact only if equal rewards get equal advantages",
                        "use an estimator that depends only on the group's rewards, or stream it "
                        "with canonical_order=True (one buffer per trajectory)",
                    )
                )
            by_reward[r] = a
        return {t: -a for t, a in zip(tids, adv)}


def variant_of(coef: float) -> str | None:
    """Sign class of a loss coefficient -A: POS when A > 0, NEG when A < 0, None when 0."""
    if coef < 0:
        return POS
    if coef > 0:
        return NEG
    return None


def check_group_sizes(group_sizes: object, local_members: object) -> dict:
    """Validate begin_batch arguments; returns {gid: (size, local frozenset | None)}."""
    if not hasattr(group_sizes, "items"):
        raise StreamingInputError(
            rule_message(
                f"begin_batch needs a mapping {{group_id: group_size}} (got {type(group_sizes).__name__})",
                "a group closes when its declared number of rewards is known",
                "pass e.g. {gid: rollout.n for gid in prompt_ids}; pass {} for a batch without "
                "groups (on-policy distillation feeds only reward-independent gradients)",
            )
        )
    out = {}
    for gid, size in group_sizes.items():  # type: ignore[union-attr]
        if not int_at_least(size, 1):
            raise StreamingInputError(
                rule_message(
                    f"group {gid!r} has size {size!r}",
                    "a group needs at least one trajectory",
                    "declare a positive int size per group",
                )
            )
        local = None
        if local_members is not None:
            members = local_members.get(gid, ())  # type: ignore[union-attr]
            local = frozenset(members)
            if len(local) > size:
                raise StreamingInputError(
                    rule_message(
                        f"group {gid!r} lists {len(local)} local members but has size {size}",
                        "local members are a subset of the group",
                        "list only this rank's trajectory ids",
                    )
                )
        out[gid] = (size, local)
    if local_members is not None:
        unknown = [g for g in local_members if g not in out]  # type: ignore[union-attr]
        if unknown:
            raise StreamingInputError(
                rule_message(
                    f"local_members names groups {unknown} that are not in group_sizes",
                    "every local trajectory must belong to a declared group",
                    "declare those groups' sizes too",
                )
            )
    return out
