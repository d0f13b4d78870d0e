"""SAO's framework-free math (thundersync_verl.core.sao) against hand-computed cases.

1. The double-sided mask keeps exactly the tokens with 1-eps_low < r < 1+eps_high, for either sign of
   A, and the loss gradient is -A r m on each token (by autograd).
2. GAE skips observation tokens: a trajectory with observations equals the same trajectory with them
   cut out, on the agent tokens (hand-computed numbers), and observations get 0.
3. Monte-Carlo returns are the discounted reward-to-go over agent tokens; with lam = 1, A + V = G.
4. A reward landing on an observation token is credited to the agent token before it.
5. Explained variance and whitening follow verl's definitions.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import pytest
import torch

from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError
from thundersync_verl.core.sao import (
    explained_variance,
    fold_observation_rewards,
    masked_gae,
    masked_whiten,
    mc_returns,
    sao_advantages_and_returns,
    sao_policy_loss,
    token_mean,
)

D = torch.float64


def _t(rows):
    return torch.tensor(rows, dtype=D)


def test_double_sided_mask_keeps_the_band_for_both_signs():
    ratios = _t([[0.5, 0.8, 1.0, 3.0, 7.0, 0.7]])
    rollout = _t([[-1.0, -2.0, -0.5, -1.5, -3.0, -1.2]])
    log_prob = (rollout + ratios.log()).requires_grad_(True)
    mask = torch.ones(1, 6, dtype=torch.bool)
    for sign in (1.0, -1.0):
        adv = torch.full((1, 6), 2.0 * sign, dtype=D)
        loss_mat, stats = sao_policy_loss(log_prob, rollout, adv, mask, eps_low=0.3, eps_high=5.0)
        # band (0.7, 6.0), strict at both ends: 0.5 out, 0.8 in, 1 in, 3 in, 7 out, 0.7 out
        keep = _t([[0, 1, 1, 1, 0, 0]])
        assert torch.allclose(loss_mat.detach(), -adv * ratios * keep)
        assert stats["masked_frac"] == pytest.approx(3 / 6)
        (grad,) = torch.autograd.grad(loss_mat.sum(), log_prob)
        assert torch.allclose(grad, -adv * ratios * keep)  # d(-A r)/d log pi = -A r on kept tokens


def test_policy_loss_token_mean_counts_masked_tokens():
    rollout = torch.zeros(2, 3, dtype=D)
    log_prob = _t([[0.0, 0.0, 5.0], [0.0, 0.0, 0.0]])  # one token far outside the band
    adv = torch.ones(2, 3, dtype=D)
    resp = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    loss_mat, _ = sao_policy_loss(log_prob, rollout, adv, resp, eps_low=0.2, eps_high=0.2)
    assert token_mean(loss_mat, resp).item() == pytest.approx(-4 / 5)  # 4 kept tokens of r=1, 5 counted


def test_gae_skips_observation_tokens_hand_computed():
    # tokens: agent, agent, obs, obs, agent; reward 1 at the end; gamma = lam = 0.5
    rewards = _t([[0, 0, 0, 0, 1]])
    values = _t([[0.5, 0.25, 9.0, 9.0, 0.75]])  # observation values must not matter
    agent = _t([[1, 1, 0, 0, 1]])
    adv = masked_gae(rewards, values, agent, gamma=0.5, lam=0.5)
    # t=4: 1 - 0.75 = 0.25; t=1: 0.5*0.75 - 0.25 + 0.25*0.25 = 0.1875; t=0: 0.5*0.25 - 0.5 + 0.25*0.1875
    assert torch.allclose(adv, _t([[-0.328125, 0.1875, 0.0, 0.0, 0.25]]))
    cut = masked_gae(_t([[0, 0, 1]]), _t([[0.5, 0.25, 0.75]]), _t([[1, 1, 1]]), gamma=0.5, lam=0.5)
    assert torch.allclose(adv[:, [0, 1, 4]], cut)


def test_mc_returns_hand_computed_and_lam1_identity():
    rewards = _t([[0, 0, 0, 0, 1], [0, 0.5, 0, 1, 0]])
    agent = _t([[1, 1, 0, 0, 1], [1, 1, 1, 1, 0]])
    assert torch.allclose(mc_returns(rewards, agent, gamma=0.5), _t([[0.25, 0.5, 0, 0, 1], [0.375, 0.75, 0.5, 1, 0]]))
    g = torch.Generator().manual_seed(0)
    values = torch.randn(2, 5, generator=g, dtype=D)
    adv = masked_gae(rewards, values, agent, gamma=0.9, lam=1.0)
    assert torch.allclose((adv + values) * agent, mc_returns(rewards, agent, gamma=0.9))


def test_reward_on_an_observation_token_goes_to_the_agent_token_before_it():
    rewards = _t([[0, 0, 0, 1, 0]])
    agent = _t([[1, 1, 0, 0, 0]])  # ends on a tool reply; the reward sits on it
    assert torch.allclose(fold_observation_rewards(rewards, agent), _t([[0, 1, 0, 0, 0]]))
    _, returns = sao_advantages_and_returns(rewards, torch.zeros(1, 5, dtype=D), agent, gamma=1.0, lam=1.0)
    assert torch.allclose(returns, _t([[1, 1, 0, 0, 0]]))


def test_whiten_and_explained_variance_follow_verl_definitions():
    x = _t([[1, 2, 3, 100], [4, 5, 6, 100]])
    mask = _t([[1, 1, 1, 0], [1, 1, 1, 0]])
    w = masked_whiten(x, mask)
    kept = w[mask.bool()]
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert kept.std().item() == pytest.approx(1.0, abs=1e-6)  # unbiased std, eps 1e-8
    assert torch.all(w[~mask.bool()] == 0)
    returns = _t([[1.0, 0.0, 1.0, 0.0]])
    ones = torch.ones(1, 4)
    assert explained_variance(returns, returns, ones) == pytest.approx(1.0)
    # V = 0.5 everywhere: Var(G - V) = Var(G), EV = 1 - v/(v + 1e-5) with v = 1/3
    assert explained_variance(torch.full((1, 4), 0.5, dtype=D), returns, ones) == pytest.approx(1 - (1 / 3) / (1 / 3 + 1e-5))


def test_bad_inputs_are_refused():
    a = torch.zeros(2, 3)
    with pytest.raises(StreamingInputError, match="one \\[B, T\\] shape"):
        masked_gae(a, torch.zeros(2, 4), a, 1.0, 1.0)
    with pytest.raises(StreamingConfigError, match="algorithm.gamma"):
        masked_gae(a, a, a, 1.5, 1.0)
    with pytest.raises(StreamingInputError, match="at least 2 agent tokens"):
        masked_whiten(a, torch.zeros(2, 3))
    with pytest.raises(StreamingConfigError, match="offsets must be positive"):
        sao_policy_loss(a, a, a, a.bool(), eps_low=0.0, eps_high=1.0)
