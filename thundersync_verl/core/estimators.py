"""Group-wise advantage estimators with verl's exact scalar rules.

Why:
1. Streaming defers the group statistics, not the backward: each trajectory's gradient is
   kept until its group closes, then folded with the estimator's coefficient. The estimator
   therefore only has to turn the group's rewards into one advantage per trajectory.
2. "The same update as verl" means verl's definitions, not the papers': GRPO uses the
   UNBIASED std (``torch.std``) plus epsilon 1e-6, a group of one gets mean 0 and std 1,
   Dr.GRPO (``norm_adv_by_std_in_grpo=False``) drops the std, and RLOO leaves a group of one
   untouched. verl's group-of-one std is a float32 tensor, so its divisor is float32(1 + 1e-6)
   = 1.00000095...; that rounding is reproduced. Statistics are computed with torch in
   ``dtype`` (float64 by default; float32 reproduces verl's float32 reward tensors exactly)
   over the rewards sorted by trajectory id, so they do not depend on arrival order.
3. Any estimator that gives equal rewards equal advantages is exact with one buffer per
   (group, distinct reward). An estimator that is also AFFINE in the reward given its group
   (A_i = alpha_g * r_i + beta_g: GRPO, Dr.GRPO, RLOO) needs only two buffers per open group:
   sum_i (r_i - r_ref) H_i and sum_i H_i. ``is_affine`` lets the accumulator pick that path.
4. ``estimator_from_verl`` maps every one of verl 0.9.1's 14 ``algorithm.adv_estimator`` names
   either onto an estimator (these classes, or ``batch_estimators``' for the ones that need
   response lengths or batch statistics) or onto a refusal that says why it cannot be streamed
   exactly and what to set instead (``STREAMED`` and ``REFUSED`` list them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

import torch

from thundersync_verl.core.batch_estimators import GPGEstimator, OPOEstimator, ReinforcePlusPlusEstimator
from thundersync_verl.core.errors import StreamingConfigError, rule_message

GRPO_EPSILON = 1e-6  # verl's default ``epsilon`` of compute_grpo_outcome_advantage


def _as_tensor(rewards: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([float(r) for r in rewards], dtype=dtype)  # [n]


class GroupEstimator(ABC):
    """Maps the rewards of one prompt group (sorted by trajectory id) to advantages."""

    name: str = "group"
    is_affine: bool = False

    @abstractmethod
    def advantages(self, rewards: Sequence[float]) -> list[float]:
        """One advantage per reward, same order."""

    def affine_coefficients(self, rewards: Sequence[float]) -> tuple[float, float]:
        """(alpha, beta) with A_i = alpha * r_i + beta for every member of this group."""
        raise NotImplementedError(f"estimator {self.name!r} is not affine in the reward")


class GRPOEstimator(GroupEstimator):
    """verl ``compute_grpo_outcome_advantage``: A = (r - mean) / (std + eps), or r - mean."""

    is_affine = True

    def __init__(self, norm_by_std: bool = True, epsilon: float = GRPO_EPSILON, dtype: torch.dtype = torch.float64):
        self.norm_by_std = bool(norm_by_std)
        self.epsilon = float(epsilon)
        self.dtype = dtype
        self.name = "grpo" if self.norm_by_std else "grpo_no_std"

    def _mean_denom(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Group mean and the divisor std + eps (0-dim tensors), with verl's singleton rule."""
        if scores.numel() == 1:  # verl: torch.tensor(0.0) and torch.tensor(1.0), both float32
            return torch.tensor(0.0), torch.tensor(1.0) + self.epsilon
        return torch.mean(scores), torch.std(scores) + self.epsilon  # unbiased std (torch default)

    def advantages(self, rewards: Sequence[float]) -> list[float]:
        scores = _as_tensor(rewards, self.dtype)  # [n]
        mean, denom = self._mean_denom(scores)
        adv = (scores - mean) / denom if self.norm_by_std else scores - mean  # [n]
        return adv.tolist()

    def affine_coefficients(self, rewards: Sequence[float]) -> tuple[float, float]:
        mean, denom = self._mean_denom(_as_tensor(rewards, self.dtype))
        if not self.norm_by_std:
            return 1.0, -float(mean)
        d = float(denom)
        return 1.0 / d, -float(mean) / d


class RLOOEstimator(GroupEstimator):
    """verl ``compute_rloo_outcome_advantage``: A = r*n/(n-1) - mean*n/(n-1); n == 1: A = r."""

    name = "rloo"
    is_affine = True

    def __init__(self, dtype: torch.dtype = torch.float64):
        self.dtype = dtype

    def advantages(self, rewards: Sequence[float]) -> list[float]:
        scores = _as_tensor(rewards, self.dtype)  # [n]
        n = scores.numel()
        if n == 1:
            return scores.tolist()
        mean = torch.mean(scores)
        adv = scores * n / (n - 1) - mean * n / (n - 1)  # [n], verl's evaluation order
        return adv.tolist()

    def affine_coefficients(self, rewards: Sequence[float]) -> tuple[float, float]:
        n = len(rewards)
        if n == 1:
            return 1.0, 0.0
        mean = torch.mean(_as_tensor(rewards, self.dtype))
        return n / (n - 1), -float(mean * n / (n - 1))


class FunctionEstimator(GroupEstimator):
    """Wraps any ``rewards -> advantages`` rule; streamed exactly through reward buckets.

    The rule must give equal rewards equal advantages; the accumulator checks it when a group
    closes and raises if it does not hold.
    """

    def __init__(self, fn: Callable[[Sequence[float]], Sequence[float]], name: str = "custom"):
        self._fn = fn
        self.name = name

    def advantages(self, rewards: Sequence[float]) -> list[float]:
        out = [float(a) for a in self._fn(list(rewards))]
        if len(out) != len(rewards):
            raise StreamingConfigError(
                rule_message(
                    f"estimator {self.name!r} returned {len(out)} advantages for {len(rewards)} rewards",
                    "each trajectory of a group needs exactly one advantage to fold its gradient",
                    "return one advantage per reward, in the order of the rewards given",
                )
            )
        return out


class GRPOPassKEstimator(GroupEstimator):
    """verl ``compute_grpo_passk_outcome_advantage``: only the best member gets r_max - r_second.

    Divided by (unbiased std + eps) when ``norm_by_std``. A tie at the top gives every member 0,
    whichever index ``torch.topk`` picks, so equal rewards always get equal advantages. verl
    raises for a group of one; so does this estimator.
    """

    def __init__(self, norm_by_std: bool = True, epsilon: float = GRPO_EPSILON, dtype: torch.dtype = torch.float64):
        self.norm_by_std = bool(norm_by_std)
        self.epsilon = float(epsilon)
        self.dtype = dtype
        self.name = "grpo_passk"

    def advantages(self, rewards: Sequence[float]) -> list[float]:
        scores = _as_tensor(rewards, self.dtype)  # [n]
        if scores.numel() < 2:
            raise StreamingConfigError(
                rule_message(
                    f"grpo_passk got a group of {scores.numel()} trajectory",
                    "pass@k's advantage is the gap between the best and the second-best member",
                    "set actor_rollout_ref.rollout.n >= 2",
                )
            )
        top, top_idx = torch.topk(scores, 2)
        gap = top[0] - top[1]
        if self.norm_by_std:
            gap = gap / (torch.std(scores) + self.epsilon)
        adv = torch.zeros_like(scores)  # [n]
        adv[int(top_idx[0])] = gap
        return adv.tolist()


# verl 0.9.1's AdvantageEstimator names that stream, and why the others cannot.
STREAMED = (
    "grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "grpo_passk", "opo", "gpg",
    "reinforce_plus_plus", "reinforce_plus_plus_baseline",
)
REFUSED = {
    "gae": "GAE's advantage is a per-token function of a critic's value estimates, not of the outcome score",
    "remax": "ReMax's baseline is the reward of a second, greedy rollout per prompt, which the streamed "
             "rollout does not generate (verl generates it in its own synchronous step)",
    "gdpo": "GDPO normalises each reward component (algorithm.gdpo_reward_keys) separately; the streamed "
            "arrivals carry one score per trajectory, not its components",
    "optimal_token_baseline": "its baseline is per token and weighted by every group member's rollout "
                              "probabilities (old_log_probs, sum_pi_squared), so one scalar per trajectory cannot "
                              "carry it",
    "tir_optimal_token_baseline": "its baseline is per token and weighted by every group member's rollout "
                                  "probabilities (old_log_probs, sum_pi_squared), so one scalar per trajectory "
                                  "cannot carry it",
}

# Estimators this package registers in verl that the group-wise stream planner does not take.
PLUGIN_REFUSED = {
    "sao": "SAO's advantage is per token (GAE over the critic's values, whitened over the batch); it streams "
           "through its own planner (algos/sao/sao_streaming.py), not this group-wise one: the ThunderSync trainer "
           "selects it for algorithm.adv_estimator=sao (algos/sao/sao_trainer_step.py)",
}


def estimator_from_verl(
    adv_estimator: str,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = GRPO_EPSILON,
    dtype: torch.dtype = torch.float64,
    gamma: float = 1.0,
):
    """The estimator matching verl's ``algorithm.adv_estimator`` (and its GRPO std flag, gamma).

    The ``*_vectorized`` variants compute the same quantities (in float32, with a different
    variance formula); they map to the same exact rule here. REINFORCE++ streams with gamma = 1
    only: a discount makes the advantage differ from token to token.
    """
    name = str(getattr(adv_estimator, "value", adv_estimator))
    if name not in STREAMED:
        reason = REFUSED.get(name) or PLUGIN_REFUSED.get(name) or (
            f"{name!r} is not one of verl 0.9.1's estimators known to stream exactly")
        raise StreamingConfigError(
            rule_message(
                f"algorithm.adv_estimator={name!r} cannot be streamed",
                "streaming folds each trajectory's gradient with one coefficient per trajectory that "
                f"depends on its outcome score and group or batch statistics; {reason}",
                f"set algorithm.adv_estimator to one of {list(STREAMED)}",
            )
        )
    if name.startswith("reinforce_plus_plus") and float(gamma) != 1.0:
        raise StreamingConfigError(
            rule_message(
                f"algorithm.adv_estimator={name!r} streams with algorithm.gamma=1.0 only (got {gamma})",
                "with a discount the return, and so the advantage, differs from token to token of a "
                "trajectory; a streamed row carries one coefficient",
                "set algorithm.gamma=1.0, or use grpo / rloo",
            )
        )
    est = _build(name, bool(norm_adv_by_std_in_grpo), float(epsilon), dtype)
    est.verl_name = name
    return est


def _build(name: str, norm: bool, epsilon: float, dtype: torch.dtype):
    if name in ("grpo", "grpo_vectorized"):
        return GRPOEstimator(norm_by_std=norm, epsilon=epsilon, dtype=dtype)
    if name in ("rloo", "rloo_vectorized"):
        return RLOOEstimator(dtype=dtype)
    if name == "grpo_passk":
        return GRPOPassKEstimator(norm_by_std=norm, epsilon=epsilon, dtype=dtype)
    if name == "opo":
        return OPOEstimator(dtype=dtype)
    if name == "gpg":
        return GPGEstimator(dtype=dtype)
    return ReinforcePlusPlusEstimator(baseline=name.endswith("_baseline"), dtype=dtype)
