"""Per-token objective pieces a learner backpropagates into the accumulator.

Why:
1. The policy term of trajectory i is H_i = grad sum_t w_{i,t} log pi_t: ``policy_surrogate``
   builds that sum from log-probs and the token weights (loss-agg weight x mask x any detached
   correction). The accumulator applies -A_i later.
2. Reward-independent terms (KL to a reference policy, entropy bonus) need no advantage: their
   gradient goes straight into the batch gradient as soon as the trajectory (and its reference
   log-probs) exists. They use the SAME token weights and deferred normaliser as the policy
   term, as verl aggregates them with the same ``loss_agg_mode``. ``kl_per_token`` reproduces
   verl's ``kl_penalty`` estimators (k1/kl, abs, k2/mse, k3/low_var_kl, and the "+"
   straight-through variants whose gradient is k2's).
3. On-policy distillation (OPD) scores each token with the teacher: A_t = -(log pi_s - log pi_t),
   detached; loss -sum_t A_t log pi_s (importance weight 1 on-policy), normalised by scored
   tokens. There is no group statistic, so every turn can be backpropagated as soon as the
   teacher has scored it: the sum over turns is the sum over the trajectory. A per-turn
   backward that recomputes the prefix with grad is exact because later turns attend to the
   earlier turns' keys and values through the same graph.
4. OPD turn streaming needs a per-token weight that does not depend on the trajectory's final
   length: seq-mean-token-mean (1/|o_i|) is refused for turns, all other modes work.
5. Supervised distillation (verl's ``use_policy_gradient: false``): the estimator itself is the
   per-token loss, NOT detached: ``distillation_token_loss`` is verl's ``kl_penalty(log pi_student,
   log p_teacher, mode)`` (the same estimators as the KL loss, the teacher in the reference's place),
   then verl's ``loss_max_clamp`` (a clamp of the value, so a clamped token has zero gradient). Each
   token's loss depends on that token alone: a turn's tokens can be backpropagated when the turn
   is scored, with the loss-agg normaliser deferred exactly as the policy-gradient form's.
"""

from __future__ import annotations

import torch

from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError, rule_message

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_LOG_RATIO_BOUND = 20.0  # verl clamps ref - logprob before exp in k3
KL_VALUE_BOUND = 10.0  # verl clamps the k3 value


def policy_surrogate(log_prob: torch.Tensor, token_weights: torch.Tensor) -> torch.Tensor:
    """sum_{i,t} w_{i,t} log pi_{i,t} for [B, T] inputs; its gradient is sum_i H_i."""
    if log_prob.shape != token_weights.shape:
        raise StreamingInputError(
            rule_message(
                f"log_prob {tuple(log_prob.shape)} and token_weights {tuple(token_weights.shape)} differ",
                "each token's weight multiplies its own log-prob",
                "build the weights from the same [B, T] response mask",
            )
        )
    return (log_prob * token_weights.detach()).sum()  # scalar


def _kl_forward(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("kl", "k1"):
        return log_prob - ref_log_prob  # [B, T]
    if kind == "abs":
        return (log_prob - ref_log_prob).abs()  # [B, T]
    if kind in ("mse", "k2"):
        return 0.5 * (log_prob - ref_log_prob).square()  # [B, T]
    log_r = torch.clamp(ref_log_prob - log_prob, min=-KL_LOG_RATIO_BOUND, max=KL_LOG_RATIO_BOUND)  # [B, T]
    k3 = torch.exp(log_r) - log_r - 1  # [B, T]
    return torch.clamp(k3, min=-KL_VALUE_BOUND, max=KL_VALUE_BOUND)  # [B, T]


def kl_per_token(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate to the reference policy, as verl's ``kl_penalty`` defines it, [B, T]."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_KINDS:
        raise StreamingConfigError(
            rule_message(
                f"actor_rollout_ref.actor.kl_loss_type={kind!r} is not supported",
                "the KL term is accumulated per token and must match verl's estimator",
                f"use one of {list(KL_KINDS)} (optionally with a '+' suffix)",
            )
        )
    forward = _kl_forward(log_prob, ref_log_prob, base)
    if not kind.endswith("+") or base in ("mse", "k2"):
        return forward
    k2 = 0.5 * (log_prob - ref_log_prob).square()  # [B, T], straight-through gradient
    return k2 - k2.detach() + forward.detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy of softmax(logits) over the last axis, [...]."""
    log_z = torch.logsumexp(logits, dim=-1)  # [...]
    probs = torch.softmax(logits, dim=-1)  # [..., V]
    return log_z - (probs * logits).sum(dim=-1)  # [...]


def opd_token_advantages(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor) -> torch.Tensor:
    """A_t = -(log pi_student - log pi_teacher), detached, [B, T]."""
    if student_log_prob.shape != teacher_log_prob.shape:
        raise StreamingInputError(
            rule_message(
                "student and teacher log-probs have different shapes",
                "the teacher scores exactly the tokens the student produced",
                "score the same [B, T] response tokens with the teacher",
            )
        )
    return -(student_log_prob - teacher_log_prob).detach()  # [B, T]


def distillation_token_loss(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor, kind: str,
                            clamp: float | None = None) -> torch.Tensor:
    """verl's per-token supervised distillation loss (point 5), with grad through the student, [B, T]."""
    loss = kl_per_token(student_log_prob, teacher_log_prob, kind)  # [B, T]
    if clamp is not None:
        loss = loss.clamp(min=-float(clamp), max=float(clamp))  # verl: min clamps k1, which can be negative
    return loss


def check_opd_turn_mode(loss_agg_mode: str) -> None:
    """Refuse loss_agg_modes whose token weight needs the final trajectory length."""
    if loss_agg_mode == "seq-mean-token-mean":
        raise StreamingConfigError(
            rule_message(
                "OPD turn streaming cannot use loss_agg_mode='seq-mean-token-mean'",
                "its token weight 1/|o_i| needs the length of the whole trajectory, unknown while "
                "earlier turns are backpropagated",
                "use token-mean (verl's default), token-sum or seq-mean-token-sum, or stream OPD "
                "per trajectory instead of per turn",
            )
        )


def opd_turn_loss(
    student_log_prob: torch.Tensor,
    teacher_log_prob: torch.Tensor,
    mask: torch.Tensor,
    token_weight: float = 1.0,
) -> torch.Tensor:
    """Unnormalised OPD loss of one turn: -sum_t w * mask_t * A_t * log pi_student_t (scalar).

    The batch normaliser (e.g. 1 / scored tokens) is applied once at the barrier.
    """
    adv = opd_token_advantages(student_log_prob, teacher_log_prob)  # [B, T]
    weights = mask.to(student_log_prob.dtype) * token_weight  # [B, T]
    return -(adv * weights * student_log_prob).sum()  # scalar
