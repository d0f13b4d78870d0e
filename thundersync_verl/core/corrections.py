"""Off-policy corrections that keep the streamed objective linear in the advantage.

Why:
1. Streaming needs loss = sum_t A * c_t * (something whose gradient is fixed once the
   trajectory is known). Any DETACHED per-token factor c_t keeps that form: the gradient is
   -A * sum_t c_t grad log pi_t, so c_t simply joins the token weights w_{i,t}.
2. Such factors, all sign-independent and so exact while the group is open:
   - truncated IS weights vs the rollout engine's log-probs (verl ``rollout_is`` token or
     sequence level, TIS clamp or IcePop band), reproduced from verl's definitions;
   - SAO's strict double-sided token mask: keep t iff 1-eps_low < r_t < 1+eps_high, with r_t
     the ratio to the ROLLOUT engine's log-prob, whatever the sign of A.
3. PPO's clip is different: when ratio != 1 it picks its branch by the SIGN of A, unknown
   while the group is open. For A > 0 the gradient flows iff r <= 1+eps_high; for A < 0 iff
   1-eps_low <= r < clip_ratio_c (dual clip). ``ppo_clip_token_weights`` gives the detached
   weights r_t * mask_t of each sign class; with sign buckets each open-group trajectory is
   backpropagated once per class. ``check_sign_independent`` raises when the two classes
   differ on any token and sign buckets are off: that is the inexact case.
4. The ratio follows verl: r = exp(clamp(log_prob - old_log_prob, -20, 20)); a clamped
   log-ratio also stops the gradient.
"""

from __future__ import annotations

import torch

from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError, rule_message

LOG_RATIO_BOUND = 20.0  # verl's clamp of the log-ratio in the PPO loss and the IS weights


def _check_same_shape(*tensors: torch.Tensor) -> None:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise StreamingInputError(
            rule_message(
                f"per-token tensors have different shapes {sorted(shapes)}",
                "token weights are combined element by element",
                "pass [B, T] tensors aligned on the same response tokens",
            )
        )


def ratio_and_gate(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached r_t = exp(clamp(log_prob - old)) and the clamp's gradient gate, both [B, T]."""
    _check_same_shape(log_prob, old_log_prob)
    log_ratio = (log_prob - old_log_prob).detach()  # [B, T]
    gate = (log_ratio >= -LOG_RATIO_BOUND) & (log_ratio <= LOG_RATIO_BOUND)  # [B, T]
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # [B, T]
    return ratio, gate


def ppo_clip_token_weights(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    sign: str,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
) -> torch.Tensor:
    """Detached weights c_t with grad(PPO-clip loss) = -A * sum_t c_t grad log pi_t, [B, T].

    ``sign`` is "pos" (A > 0) or "neg" (A < 0). Exact ties at a clip bound (measure zero)
    follow the open/closed ends written in the module docstring.
    """
    ratio, gate = ratio_and_gate(log_prob, old_log_prob)
    if sign == "pos":
        keep = ratio <= 1.0 + clip_ratio_high  # [B, T]
    elif sign == "neg":
        keep = (ratio >= 1.0 - clip_ratio_low) & (ratio < clip_ratio_c)  # [B, T]
    else:
        raise StreamingInputError(
            rule_message(
                f"sign must be 'pos' or 'neg' (got {sign!r})",
                "PPO's clip keeps different tokens for positive and negative advantages",
                "pass the sign class from required_variants / ChunkPlan.sign_classes",
            )
        )
    return ratio * (keep & gate).to(ratio.dtype)  # [B, T]


def check_sign_independent(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
) -> None:
    """Raise unless PPO's clip keeps the same tokens for both signs (then it is linear in A)."""
    pos = ppo_clip_token_weights(log_prob, old_log_prob, "pos", clip_ratio_low, clip_ratio_high, clip_ratio_c)
    neg = ppo_clip_token_weights(log_prob, old_log_prob, "neg", clip_ratio_low, clip_ratio_high, clip_ratio_c)
    differ = (pos != neg) & (mask != 0)  # [B, T]
    if bool(differ.any()):
        raise StreamingConfigError(
            rule_message(
                f"PPO's clip is sign-dependent on {int(differ.sum())} token(s): the ratio to the old "
                "log-probs leaves the clip band",
                "the clipped surrogate picks its branch by the sign of the advantage, which is unknown "
                "until the group closes, so a streamed backward would use the wrong branch",
                "recompute old log-probs with the learner (algorithm.rollout_correction.bypass_mode="
                "false) so every ratio is 1, use a detached IS weight or a double-sided mask, or "
                "enable sign_buckets=True",
            )
        )


def rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    upper: float = 2.0,
    lower: float | None = None,
) -> torch.Tensor:
    """Detached truncated IS weights pi_old / pi_rollout as verl computes them, [B, T].

    ``level``: "token" or "sequence" (product over the sequence). ``lower`` None: TIS, clamp
    at ``upper``; else IcePop: zero outside [lower, upper]. Padding tokens get weight 0.
    """
    _check_same_shape(old_log_prob, rollout_log_prob, mask)
    if level not in ("token", "sequence") or not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise StreamingConfigError(
            rule_message(
                f"rollout IS settings level={level!r}, upper={upper!r}, lower={lower!r} are invalid",
                "the weights must match verl's algorithm.rollout_correction definitions",
                "use rollout_is in {'token', 'sequence'} and 0 < lower <= upper (rollout_is_threshold)",
            )
        )
    maskf = mask.to(old_log_prob.dtype)  # [B, T]
    log_ratio = (old_log_prob - rollout_log_prob).detach()  # [B, T]
    if level == "token":
        raw = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # [B, T]
    else:
        seq = (log_ratio * maskf).sum(dim=-1, keepdim=True)  # [B, 1]
        raw = torch.exp(torch.clamp(seq, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)).expand_as(log_ratio)  # [B, T]
    raw = raw * maskf  # [B, T]
    if lower is None:
        return raw.clamp(max=upper)  # [B, T]
    keep = (raw >= lower) & (raw <= upper)  # [B, T]
    return torch.where(keep, raw, torch.zeros_like(raw))  # [B, T]


def double_sided_token_mask(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """SAO's strict mask: keep t iff 1-eps_low < r_t < 1+eps_high, r_t vs the rollout engine, [B, T]."""
    _check_same_shape(log_prob, rollout_log_prob)
    if not (eps_low > 0 and eps_high > 0):
        raise StreamingConfigError(
            rule_message(
                f"double-sided mask offsets must be positive (got {eps_low}, {eps_high})",
                "the band 1-eps_low < r < 1+eps_high must contain 1 so on-policy tokens are kept",
                "use e.g. eps_low=0.3, eps_high=5.0 (reasoning) or 0.8 / 3.0 (coding)",
            )
        )
    ratio = torch.exp((log_prob - rollout_log_prob).detach())  # [B, T]
    return (ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)  # [B, T] bool
