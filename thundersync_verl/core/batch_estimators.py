"""Estimators whose coefficient needs more than the group's rewards: lengths or batch statistics.

Why:
1. Several of verl 0.9.1's estimators still give each trajectory ONE advantage that depends only on
   its outcome score, given statistics beyond its group's rewards: OPO's baseline weights the group's
   scores by response length; GPG multiplies the group-centred score by alpha = B / #(nonzero scores)
   of the whole batch; REINFORCE++ (outcome reward, gamma = 1) whitens the return over every valid
   token of the batch, A = (s - mu_tok) * rsqrt(var_tok + 1e-8) (verl's ``masked_whiten``: unbiased
   variance, N / (N - 1) with N the batch's valid tokens); its baseline variant subtracts the group
   mean first. The advantage is the same on every valid token, so a trajectory still folds with a
   scalar.
2. Such an estimator streams exactly with reward buckets: members that must get the same advantage
   share one buffer (``bucket_class``): (group, reward) when the group enters, the reward alone for
   REINFORCE++ (one buffer per distinct reward of the batch). Coefficients are final when the group
   closes (scope "group") or at the batch's last arrival (scope "batch": the planner's barrier waits
   for the whole batch anyway). GPG's alpha is a batch scalar that multiplies the whole gradient at the
   barrier (``barrier_factor``), so GPG buffers like Dr.GRPO.
3. ``advantages`` reproduces verl's function operation for operation on the same dtypes (verl's
   float32 0-dim constants and integer token counts included); only the order of a batch-wide sum
   can differ (verl reduces a padded [B, T] tensor in batch row order), which the core tests bound.
4. ``ArrivalView`` maps a planner's arrivals onto the core accumulator's groups: identity for group
   estimators; one accumulator group for the whole batch when the scope is "batch", with one
   shadow reward per bucket class, so the accumulator's buckets, budget and closing rules apply
   unchanged. It imports nothing of the core but errors (the estimators module imports it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

import torch

from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError, rule_message

WHITEN_EPS = 1e-8  # verl_F.masked_mean's and masked_whiten's epsilon
BATCH_GROUP = "__batch__"  # the accumulator group of a batch-scope estimator


@dataclass(frozen=True)
class Outcome:
    """One finished trajectory as an estimator sees it: its group, id, score and scored tokens."""

    group: Hashable
    traj: Hashable
    reward: float
    length: int  # response_mask.sum(): the tokens that carry the advantage


def _by_group(outcomes: Sequence[Outcome]) -> dict[Hashable, list[int]]:
    """Positions of each group's members, groups in first-seen order (verl's dict order)."""
    out: dict[Hashable, list[int]] = {}
    for i, o in enumerate(outcomes):
        out.setdefault(o.group, []).append(i)
    return out


def _group_means(scores: torch.Tensor, groups: dict[Hashable, list[int]]) -> list[torch.Tensor]:
    """Per member: its group's mean score, verl's float32 ``torch.tensor(0.0)`` for a group of one."""
    means: list[torch.Tensor] = [torch.tensor(0.0)] * scores.numel()
    for idx in groups.values():
        mean = torch.tensor(0.0) if len(idx) == 1 else torch.mean(torch.stack([scores[i] for i in idx]))
        for i in idx:
            means[i] = mean
    return means


class ArrivalEstimator(ABC):
    """verl's advantage from trajectory outcomes and group or batch statistics (point 1)."""

    name = "arrival"
    scope = "group"  # "group": final when the group closes; "batch": at the batch's last arrival
    is_affine = False

    def __init__(self, dtype: torch.dtype = torch.float64):
        self.dtype = dtype

    @abstractmethod
    def advantages(self, outcomes: Sequence[Outcome]) -> list[float]:
        """verl's advantages of the whole batch, one per outcome, same order."""

    def coefficients(self, outcomes: Sequence[Outcome]) -> list[float]:
        """What the stream folds: one closed group's outcomes (scope group) or the batch's (scope batch)."""
        return self.advantages(outcomes)

    def barrier_factor(self, outcomes: Sequence[Outcome]) -> float:
        """A batch scalar that multiplies the whole gradient at the barrier (1 unless stated)."""
        return 1.0

    def bucket_class(self, outcome: Outcome) -> Hashable:
        """Members with equal classes get equal advantages (and may share a buffer)."""
        return (outcome.reward if self.reward_only_classes else (outcome.group, outcome.reward))

    @property
    def reward_only_classes(self) -> bool:
        """True when the advantage depends on the reward alone (not on the member's group)."""
        return False

    def _scores(self, outcomes: Sequence[Outcome]) -> torch.Tensor:
        return torch.tensor([float(o.reward) for o in outcomes], dtype=self.dtype)  # [n]


class OPOEstimator(ArrivalEstimator):
    """verl ``compute_opo_outcome_advantage``: A = s - sum(L s) / sum(L) over the group (1 member: A = s)."""

    name = "opo"

    def advantages(self, outcomes: Sequence[Outcome]) -> list[float]:
        scores = self._scores(outcomes)  # [n]
        lengths = torch.tensor([int(o.length) for o in outcomes], dtype=torch.int64)  # [n] int, as the mask sums
        out = scores.clone()
        for idx in _by_group(outcomes).values():
            if len(idx) == 1:
                baseline = torch.tensor(0.0)
            else:
                s, n = torch.stack([scores[i] for i in idx]), torch.stack([lengths[i] for i in idx])
                baseline = (n * s).sum() / n.sum()
            for i in idx:
                out[i] = scores[i] - baseline
        return out.tolist()


class GPGEstimator(ArrivalEstimator):
    """verl ``compute_gpg_outcome_advantage``: A = alpha (s - mean_g) / f_norm, alpha = B / max(#(s != 0), 1).

    The stream folds s - mean_g (Dr.GRPO's coefficient) and multiplies the gradient by alpha / f_norm
    at the barrier; verl computes alpha in float32 (an int64 count divided), which is kept.
    """

    name = "gpg"

    def __init__(self, dtype: torch.dtype = torch.float64, f_norm: float = 1.0):
        super().__init__(dtype)
        self.f_norm = float(f_norm)

    def _alpha(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)  # 0-dim float32, as verl's

    def advantages(self, outcomes: Sequence[Outcome]) -> list[float]:
        scores = self._scores(outcomes)  # [n]
        alpha = self._alpha(scores)
        means = _group_means(scores, _by_group(outcomes))
        return [float(alpha * (scores[i] - means[i]) / self.f_norm) for i in range(len(outcomes))]

    def coefficients(self, outcomes: Sequence[Outcome]) -> list[float]:
        scores = self._scores(outcomes)  # [n] one group
        means = _group_means(scores, _by_group(outcomes))
        return [float(scores[i] - means[i]) for i in range(len(outcomes))]

    def barrier_factor(self, outcomes: Sequence[Outcome]) -> float:
        return float(self._alpha(self._scores(outcomes))) / self.f_norm


class ReinforcePlusPlusEstimator(ArrivalEstimator):
    """verl's REINFORCE++ (``baseline=False``) and REINFORCE++-baseline on outcome rewards, gamma = 1.

    The return is the score on each of a trajectory's L valid tokens; ``masked_whiten`` over the batch:
    mu = sum L g / (N + 1e-8), var = sum L (g - mu)^2 / (N + 1e-8) * N / (N - 1), N = sum L, and
    A = (g - mu) * rsqrt(var + 1e-8), with g = s, or g = s - mean_group(s) for the baseline variant.
    """

    scope = "batch"

    def __init__(self, baseline: bool = False, dtype: torch.dtype = torch.float64):
        super().__init__(dtype)
        self.baseline = bool(baseline)
        self.name = "reinforce_plus_plus_baseline" if self.baseline else "reinforce_plus_plus"

    @property
    def reward_only_classes(self) -> bool:
        return not self.baseline

    def advantages(self, outcomes: Sequence[Outcome]) -> list[float]:
        scores = self._scores(outcomes)  # [n]
        if self.baseline:
            means = _group_means(scores, _by_group(outcomes))
            values = torch.stack([scores[i] - means[i] for i in range(len(outcomes))])  # [n]
        else:
            values = scores
        lengths = torch.tensor([int(o.length) for o in outcomes], dtype=torch.int64)  # [n]
        n_tok = lengths.sum()  # 0-dim int64: verl's mask.sum()
        if int(n_tok) < 2:
            raise StreamingInputError(
                rule_message(
                    f"{self.name} needs at least 2 scored tokens in the batch (got {int(n_tok)})",
                    "verl's masked_whiten divides by N - 1 (the unbiased variance) and raises for N <= 1",
                    "drop the batch, or train on batches with more than one response token",
                )
            )
        weights = lengths.to(values.dtype)  # [n] each trajectory's value sits on L valid tokens
        mean = (values * weights).sum() / (n_tok + WHITEN_EPS)
        var = ((values - mean) ** 2 * weights).sum() / (n_tok + WHITEN_EPS)
        var = var * (n_tok / (n_tok - 1))  # Bessel factor in float32, as int64 / int64 gives
        return ((values - mean) * torch.rsqrt(var + WHITEN_EPS)).tolist()


# ----- the planner's view -----------------------------------------------------------------------
class _TableEstimator:
    """The accumulator's estimator for a view: advantages looked up by shadow reward."""

    is_affine = False

    def __init__(self, name: str):
        self.name = name
        self.table: dict[float, float] = {}

    def advantages(self, rewards: Sequence[float]) -> list[float]:
        return [self.table[float(r)] for r in rewards]


class ArrivalView:
    """Maps (group, traj, reward, length) arrivals onto the accumulator's groups (point 4).

    ``shadow_arrival`` gives the accumulator's (group, traj, reward) for an arrival and, when the
    arrival closes that accumulator group, prepares the coefficients the accumulator will ask for;
    ``record`` stores the arrival once the accumulator accepted it.
    """

    def __init__(self, estimator: Any):
        self.estimator = estimator
        self.arrival = isinstance(estimator, ArrivalEstimator)
        self.batch_scope = self.arrival and estimator.scope == "batch"
        self.shadow_estimator = _TableEstimator(estimator.name) if self.arrival else estimator
        self._sizes: dict[Hashable, int] = {}
        self._total = 0
        self._outcomes: dict[Hashable, dict[Hashable, Outcome]] = {}
        self._classes: dict[Hashable, float] = {}
        self._arrived: dict[Hashable, int] = {}  # recorded arrivals per accumulator group

    def begin(self, group_sizes: Mapping[Hashable, int]) -> dict[Hashable, int]:
        """The accumulator's group sizes for a batch of ``group_sizes``."""
        self._sizes = dict(group_sizes)
        self._total = sum(int(n) for n in group_sizes.values())
        self._outcomes = {gid: {} for gid in group_sizes}
        self._classes = {}
        self._arrived = {}
        if self.batch_scope:
            return {BATCH_GROUP: self._total} if group_sizes else {}
        return dict(group_sizes)

    def max_distinct(self, requested: int | None) -> int | None:
        """The accumulator's bucket cap: per group, or None when classes mix groups and rewards."""
        if self.batch_scope and not self.estimator.reward_only_classes:
            return None
        return requested

    def shadow_item(self, gid: Hashable, tid: Hashable) -> tuple:
        return (BATCH_GROUP, (gid, tid)) if self.batch_scope else (gid, tid)

    @staticmethod
    def real_item(item: tuple) -> tuple:
        return item[1] if item[0] == BATCH_GROUP else item

    def shadow_arrival(self, gid: Hashable, tid: Hashable, reward: float, length: int) -> tuple:
        """(group, traj, reward) for the accumulator; prepares the table if this arrival closes its group."""
        if gid not in self._sizes:
            return gid, tid, reward  # the accumulator raises its unknown-group error
        if not self.arrival:
            return gid, tid, reward
        new = Outcome(gid, tid, float(reward), int(length))
        sg, st = self.shadow_item(gid, tid)
        sr = self._shadow_reward(new)
        if self._arrived.get(sg, 0) + 1 == self._shadow_size(sg):  # closes: the accumulator asks for the table
            self.shadow_estimator.table = self._table(self._members(sg) + [new])
        return sg, st, sr

    def record(self, gid: Hashable, tid: Hashable, reward: float, length: int) -> None:
        out = Outcome(gid, tid, float(reward), int(length))
        self._outcomes[gid][tid] = out
        sg = self.shadow_item(gid, tid)[0]
        self._arrived[sg] = self._arrived.get(sg, 0) + 1
        if self.batch_scope:
            self._classes.setdefault(self.estimator.bucket_class(out), float(len(self._classes)))

    def _shadow_reward(self, out: Outcome) -> float:
        if not self.batch_scope:
            return out.reward
        cls = self.estimator.bucket_class(out)
        return self._classes.get(cls, float(len(self._classes)))

    def _shadow_size(self, sg: Hashable) -> int:
        return self._total if sg == BATCH_GROUP else self._sizes[sg]

    def _members(self, sg: Hashable) -> list[Outcome]:
        """Recorded outcomes of accumulator group ``sg`` in batch order (groups as declared, ids sorted)."""
        gids = list(self._sizes) if sg == BATCH_GROUP else [sg]
        return [self._outcomes[g][t] for g in gids for t in _sorted_ids(self._outcomes[g])]

    def _table(self, members: list[Outcome]) -> dict[float, float]:
        """{shadow reward: coefficient} of a closing accumulator group; one value per bucket class."""
        members = _in_batch_order(members, list(self._sizes))
        table: dict[float, float] = {}
        for out, value in zip(members, self.estimator.coefficients(members)):
            key = self._classes.get(self.estimator.bucket_class(out), float(len(self._classes))) if self.batch_scope else out.reward
            if key in table and table[key] != float(value):
                raise StreamingConfigError(
                    rule_message(
                        f"estimator {self.estimator.name!r} gave one bucket class two advantages "
                        f"({table[key]} and {float(value)}) at trajectory ({out.group!r}, {out.traj!r})",
                        "a bucket folds all its members with one coefficient",
                        "make bucket_class separate every pair of outcomes whose advantages may differ",
                    )
                )
            table[key] = float(value)
        return table

    def closing_coefficients(self, sg: Hashable) -> dict[float, float]:
        """{shadow reward: advantage} of accumulator group ``sg``, which has just closed."""
        if not self.arrival:
            members = self._members(sg)
            values = self.estimator.advantages([o.reward for o in members])
            return {o.reward: float(v) for o, v in zip(members, values)}
        return dict(self.shadow_estimator.table)

    def closes_group(self, sg: Hashable) -> bool:
        """True once every member of accumulator group ``sg`` is recorded."""
        return self._arrived.get(sg, 0) == self._shadow_size(sg)

    def barrier_factor(self) -> float:
        """The batch scalar of the barrier (GPG's alpha; 1 for the others)."""
        if not self.arrival:
            return 1.0
        return self.estimator.barrier_factor(_in_batch_order(self._members_all(), list(self._sizes)))

    def _members_all(self) -> list[Outcome]:
        return [o for g in self._sizes for o in self._outcomes[g].values()]


def _sorted_ids(members: Mapping[Hashable, Any]) -> list:
    """Trajectory ids in the accumulator's order (``groups.canonical_sorted``'s rule)."""
    keys = list(members)
    try:
        return sorted(keys)
    except TypeError:
        return sorted(keys, key=lambda k: (type(k).__name__, repr(k)))


def _in_batch_order(outcomes: Sequence[Outcome], group_order: list) -> list[Outcome]:
    """Groups in declared order, members by sorted id: the row order the stream and verl's batch share."""
    rank = {g: i for i, g in enumerate(group_order)}
    by_group: dict[Hashable, dict[Hashable, Outcome]] = {}
    for o in outcomes:
        by_group.setdefault(o.group, {})[o.traj] = o
    return [by_group[g][t] for g in sorted(by_group, key=lambda g: rank.get(g, len(rank))) for t in _sorted_ids(by_group[g])]


def check_arrival_scope(estimator: Any, optimizer_steps: int) -> None:
    """Arrival estimators stream one optimizer step per batch (their statistics span the batch)."""
    if isinstance(estimator, ArrivalEstimator) and optimizer_steps > 1:
        raise StreamingConfigError(
            rule_message(
                f"algorithm.adv_estimator={estimator.name!r} streams with one optimizer step per batch "
                f"(mini-batches x ppo_epochs = {optimizer_steps})",
                "its advantages need response lengths or batch statistics, which the mini-batch planner's "
                "early first step and its PPO chunks do not carry",
                "set actor_rollout_ref.actor.ppo_mini_batch_size = data.train_batch_size and "
                "actor_rollout_ref.actor.ppo_epochs=1, or use grpo, rloo or grpo_passk",
            )
        )
