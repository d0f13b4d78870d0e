"""SAO (single-rollout asynchronous optimisation): the actor-critic math, framework-free.

Why:
1. With one rollout per prompt there is no group to compare against: a value model (verl's critic)
   supplies the baseline. Advantages are GAE over the AGENT's own tokens only: a tool observation is
   not an action, so the recursion jumps over observation tokens (they take no time step, get no
   advantage, no value target and no value loss). ``masked_gae`` implements that recursion;
   ``mc_returns`` gives the critic's Monte-Carlo targets (discounted reward-to-go over agent tokens).
   A reward that lands on an observation token (a trajectory that ends on a tool reply) is credited
   to the agent token before it (``fold_observation_rewards``), so it is never lost.
2. With no observation tokens and lam = 1 both match verl's ``compute_gae_advantage_return``
   (whose recursion also skips masked tokens); the tests check it against verl itself.
3. The policy loss is the strict double-sided token mask against the ROLLOUT engine's log-probs:
   keep token t iff 1-eps_low < r_t < 1+eps_high with r_t = pi_theta / pi_rollout, whatever the sign
   of A; the kept tokens contribute -A_t * r_t. The mask is detached and sign-independent, so the
   loss stays linear in the advantage (streamable: see ``corrections.double_sided_token_mask``).
   Masked tokens still count in the normaliser (verl's ``agg_loss`` over the response mask), so the
   normaliser is known when a trajectory arrives and does not depend on the ratios.
4. ``explained_variance`` is verl's ``critic/vf_explained_var`` definition, over a mask.
5. Shapes: every per-token tensor is [B, T] over the response tokens; ``agent_mask`` is 1 on the
   agent's tokens, 0 on observations and padding (verl's ``response_mask``).
"""

from __future__ import annotations

import torch

from thundersync_verl.core.corrections import LOG_RATIO_BOUND, double_sided_token_mask
from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError, rule_message

WHITEN_EPS = 1e-8  # verl's masked_whiten
EXPLAINED_VAR_EPS = 1e-5  # verl's critic/vf_explained_var


def _check_inputs(mask: torch.Tensor, *tensors: torch.Tensor) -> None:
    shapes = {tuple(t.shape) for t in (mask, *tensors)}
    if len(shapes) != 1 or mask.dim() != 2:
        raise StreamingInputError(
            rule_message(
                f"SAO per-token tensors must share one [B, T] shape (got {sorted(shapes)})",
                "rewards, values and the agent mask are read token by token",
                "pass [B, T] tensors aligned on the response tokens",
            )
        )


def _check_discount(gamma: float, lam: float = 1.0) -> None:
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise StreamingConfigError(
            rule_message(
                f"algorithm.gamma and algorithm.lam must lie in [0, 1] (got {gamma}, {lam})",
                "GAE and the Monte-Carlo targets are discounted sums",
                "set algorithm.gamma=1.0 algorithm.lam=1.0 (outcome rewards) or values in [0, 1]",
            )
        )


def fold_observation_rewards(rewards: torch.Tensor, agent_mask: torch.Tensor) -> torch.Tensor:
    """Rewards moved off observation/padding tokens onto the agent token before them, [B, T].

    A reward before any agent token (impossible for a response that starts with the agent) is dropped.
    """
    _check_inputs(agent_mask, rewards)
    agent = agent_mask.bool()  # [B, T]
    folded = torch.where(agent, rewards, torch.zeros_like(rewards))  # [B, T]
    positions = torch.arange(rewards.shape[1], device=rewards.device).expand_as(agent)  # [B, T]
    last_agent = torch.where(agent, positions, torch.full_like(positions, -1)).cummax(dim=1).values  # [B, T]
    stray = (~agent) & (rewards != 0) & (last_agent >= 0)  # [B, T]
    if bool(stray.any()):
        rows, cols = stray.nonzero(as_tuple=True)
        folded.index_put_((rows, last_agent[rows, cols]), rewards[rows, cols], accumulate=True)
    return folded


def masked_gae(rewards: torch.Tensor, values: torch.Tensor, agent_mask: torch.Tensor, gamma: float,
               lam: float) -> torch.Tensor:
    """GAE over agent tokens only (observation tokens skipped), unwhitened, 0 off the agent's tokens, [B, T].

    At agent token t with next agent token t' (none: V = 0): delta_t = r_t + gamma V_t' - V_t and
    A_t = delta_t + gamma lam A_t'. ``rewards`` should already be folded (``fold_observation_rewards``).
    """
    _check_inputs(agent_mask, rewards, values)
    _check_discount(gamma, lam)
    agent = agent_mask.to(values.dtype)  # [B, T]
    next_value = torch.zeros_like(values[:, 0])  # [B]
    next_adv = torch.zeros_like(values[:, 0])  # [B]
    out = torch.zeros_like(values)  # [B, T]
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [B]
        adv = delta + gamma * lam * next_adv  # [B]
        keep = agent[:, t]  # [B]
        out[:, t] = adv * keep
        next_value = values[:, t] * keep + next_value * (1 - keep)  # observation: jump over it
        next_adv = adv * keep + next_adv * (1 - keep)
    return out


def mc_returns(rewards: torch.Tensor, agent_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Monte-Carlo value targets: G_t = r_t + gamma G_t' over agent tokens (t' the next one), 0 elsewhere, [B, T]."""
    zeros = torch.zeros_like(rewards)
    return masked_gae(rewards, zeros, agent_mask, gamma, 1.0)  # with V = 0, GAE(lam=1) is the reward-to-go


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over ``mask`` (unbiased var, as verl), 0 off the mask, [B, T]."""
    m = mask.to(x.dtype)  # [B, T]
    count = m.sum()
    if count < 2:
        raise StreamingInputError(
            rule_message(
                f"whitening needs at least 2 agent tokens in the batch (got {int(count)})",
                "the unbiased variance of fewer than two values is undefined",
                "train on batches with at least two response tokens",
            )
        )
    mean = (x * m).sum() / count
    var = (((x - mean) ** 2) * m).sum() / count * (count / (count - 1))
    return (x - mean) * torch.rsqrt(var + WHITEN_EPS) * m  # [B, T]


def sao_advantages_and_returns(rewards: torch.Tensor, values: torch.Tensor, agent_mask: torch.Tensor, *,
                               gamma: float = 1.0, lam: float = 1.0,
                               whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` of SAO: whitened GAE over agent tokens and Monte-Carlo targets, [B, T] each."""
    with torch.no_grad():
        folded = fold_observation_rewards(rewards, agent_mask)  # [B, T]
        adv = masked_gae(folded, values, agent_mask, gamma, lam)  # [B, T]
        returns = mc_returns(folded, agent_mask, gamma)  # [B, T]
        if whiten:
            adv = masked_whiten(adv, agent_mask)  # [B, T]
    return adv, returns


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(G - V) / (Var(G) + 1e-5) over ``mask`` (unbiased variances: verl's vf_explained_var)."""
    _check_inputs(mask, values, returns)
    keep = mask.bool()
    g, v = returns[keep], values[keep]  # [N]
    if g.numel() < 2:
        return float("nan")
    return float(1.0 - torch.var(g - v) / (torch.var(g) + EXPLAINED_VAR_EPS))


def sao_policy_loss(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, eps_low: float, eps_high: float) -> tuple[torch.Tensor, dict]:
    """SAO's per-token loss -A_t r_t m_t and its statistics: ``(loss_mat [B, T], stats)``.

    r_t = exp(clamp(log_prob - rollout_log_prob, +-20)) carries the gradient (r_t grad log pi_t);
    m_t = 1[1-eps_low < r_t < 1+eps_high] is detached. Aggregate ``loss_mat`` over ``response_mask``
    (masked tokens count in the normaliser). ``stats``: ``masked_frac`` (share of response tokens
    outside the band) and ``ppo_kl`` (mean of rollout_log_prob - log_prob over the response).
    """
    _check_inputs(response_mask, log_prob, rollout_log_prob, advantages)
    keep = double_sided_token_mask(log_prob, rollout_log_prob, eps_low, eps_high)  # [B, T] bool, detached
    log_ratio = torch.clamp(log_prob - rollout_log_prob.detach(), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    loss_mat = -advantages.detach() * ratio * keep.to(ratio.dtype)  # [B, T]
    resp = response_mask.bool()
    n = resp.sum().clamp(min=1)
    stats = {
        "masked_frac": float(((~keep) & resp).sum() / n),
        "ppo_kl": float(((rollout_log_prob - log_prob).detach() * resp).sum() / n),
    }
    return loss_mat, stats


def token_mean(loss_mat: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``loss_mat`` over the response tokens / their count (verl's token-mean, one rank)."""
    m = response_mask.to(loss_mat.dtype)  # [B, T]
    return (loss_mat * m).sum() / m.sum().clamp(min=1)
