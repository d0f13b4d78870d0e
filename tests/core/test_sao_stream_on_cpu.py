"""Streamed SAO math (thundersync_verl.core.sao_stream) against the batch estimator and hand-computed cases.

1. A trajectory's GAE computed alone at arrival equals its row of the batch estimator (observations too).
2. The whitened policy gradient sum_t A_t f_t equals inv_std * (G1 - mean * G2), G1/G2 accumulated in any
   arrival order, for a linear model (f_t = feature vectors): the decomposition the stream relies on.
3. Hand-computed batch: mean, unbiased variance and the fold's coefficients.
4. The statistics do not depend on arrival order (bitwise); bad inputs are refused.
5. The critic's per-token coefficient is the autograd gradient of 0.5 sum (V - G)^2.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from thundersync_verl.core.errors import StreamingInputError, StreamingStateError
from thundersync_verl.core.sao import sao_advantages_and_returns
from thundersync_verl.core.sao_stream import (
    SAO_BUCKET,
    WhitenLedger,
    actor_token_coefficients,
    critic_token_coefficients,
    trajectory_gae,
)

D = torch.float64


def _batch(seed: int, b: int = 6, t: int = 11):
    """Rewards on the last agent token, random values, agent masks with observation runs and padding."""
    g = torch.Generator().manual_seed(seed)
    agent, rewards = torch.zeros(b, t, dtype=D), torch.zeros(b, t, dtype=D)
    for i in range(b):
        n = int(torch.randint(4, t + 1, (1,), generator=g))
        agent[i, :n] = 1
        if n > 6:
            agent[i, 2:4] = 0  # a tool observation inside the response
        rewards[i, n - 1] = float(torch.rand(1, generator=g) > 0.4)
    values = torch.randn(b, t, generator=g, dtype=D) * agent
    return rewards, values, agent


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8)])
def test_gae_at_arrival_equals_the_batch_row(gamma, lam):
    rewards, values, agent = _batch(0)
    adv, ret = sao_advantages_and_returns(rewards, values, agent, gamma=gamma, lam=lam, whiten=False)
    for i in range(rewards.shape[0]):
        gae, returns = trajectory_gae(rewards[i], values[i], agent[i], gamma=gamma, lam=lam, dtype=D)
        assert torch.equal(gae, adv[i]) and torch.equal(returns, ret[i])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_streamed_whitening_decomposition_equals_the_batch_gradient(seed):
    rewards, values, agent = _batch(seed)
    b, t = rewards.shape
    feats = torch.randn(b, t, 5, generator=torch.Generator().manual_seed(seed + 10), dtype=D)  # f_t, [B, T, 5]
    adv, _ = sao_advantages_and_returns(rewards, values, agent)  # whitened, [B, T]
    expected = (adv.unsqueeze(-1) * feats).sum(dim=(0, 1))  # [5]

    ledger, grad, bucket = WhitenLedger(), torch.zeros(5, dtype=D), torch.zeros(5, dtype=D)
    order = list(range(b))
    random.Random(seed).shuffle(order)
    for i in order:  # arrival: each trajectory's coefficients are final, two backwards
        gae, _ = trajectory_gae(rewards[i], values[i], agent[i], dtype=D)
        ledger.add(i, gae, agent[i])
        coefs = actor_token_coefficients(gae, agent[i])
        grad += (torch.tensor(coefs["direct"], dtype=D).unsqueeze(-1) * feats[i]).sum(0)
        bucket += (torch.tensor(coefs[SAO_BUCKET], dtype=D).unsqueeze(-1) * feats[i]).sum(0)
    fold = ledger.fold()
    streamed = fold.scale(1.0) * (grad + fold.bucket_coef * bucket)
    assert fold.num_tokens == int(agent.sum())
    assert torch.allclose(streamed, expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(grad * fold.inv_std, expected, rtol=1e-3)  # the mean term matters


def test_hand_computed_fold():
    # two trajectories, gamma = lam = 1, reward 1 on the last agent token
    # traj a: agent [1, 1], values [0.5, 0.25] -> gae = [1 - 0.5, 1 - 0.25] = [0.5, 0.75]
    # traj b: agent [1, 0, 1], values [0.0, 9.0 (observation), 1.0], reward 0 -> gae = [0 - 0, 0 - 1] = [0, -1]
    ga, _ = trajectory_gae([0.0, 1.0], [0.5, 0.25], [1, 1], dtype=D)
    gb, _ = trajectory_gae([0.0, 0.0, 0.0], [0.0, 9.0, 1.0], [1, 0, 1], dtype=D)
    assert ga.tolist() == [0.5, 0.75] and gb.tolist() == [0.0, 0.0, -1.0]
    ledger = WhitenLedger()
    ledger.add("b", gb, [1, 0, 1])
    ledger.add("a", ga, [1, 1])
    fold = ledger.fold()
    mean = (0.5 + 0.75 + 0.0 - 1.0) / 4  # 0.0625
    var = sum((x - mean) ** 2 for x in (0.5, 0.75, 0.0, -1.0)) / 3
    assert fold.mean == pytest.approx(mean, abs=1e-15) and fold.bucket_coef == pytest.approx(-mean, abs=1e-15)
    assert fold.inv_std == pytest.approx(1 / math.sqrt(var + 1e-8), rel=1e-14)
    assert fold.scale(0.25) == pytest.approx(0.25 / math.sqrt(var + 1e-8), rel=1e-14)
    coefs = actor_token_coefficients(gb, [1, 0, 1])
    assert coefs == {"direct": [0.0, 0.0, -1.0], SAO_BUCKET: [1.0, 0.0, 1.0]}
    assert set(actor_token_coefficients(gb, [1, 0, 1], whiten=False)) == {"direct"}


def test_statistics_do_not_depend_on_arrival_order():
    rewards, values, agent = _batch(4, b=8)
    folds = []
    for seed in (0, 1):
        order = list(range(8))
        random.Random(seed).shuffle(order)
        ledger = WhitenLedger()
        for i in order:
            ledger.add(f"t{i}", trajectory_gae(rewards[i], values[i], agent[i])[0], agent[i])
        folds.append(ledger.fold())
    assert folds[0] == folds[1]


def test_bad_inputs_are_refused():
    ledger = WhitenLedger()
    gae, _ = trajectory_gae([1.0], [0.0], [1])
    ledger.add("a", gae, [1])
    with pytest.raises(StreamingInputError, match="twice"):
        ledger.add("a", gae, [1])
    with pytest.raises(StreamingStateError, match="at least 2 agent tokens"):
        ledger.fold()
    with pytest.raises(StreamingStateError, match="no trajectory"):
        WhitenLedger().fold()
    with pytest.raises(StreamingInputError, match="finite"):
        trajectory_gae([1.0, float("nan")], [0.0, 0.0], [1, 1])
    with pytest.raises(StreamingInputError, match="one entry per response token"):
        trajectory_gae([1.0, 0.0], [0.0], [1, 1])


def test_critic_coefficient_is_the_value_loss_gradient():
    values = torch.tensor([0.3, -1.0, 2.0, 0.5], dtype=D, requires_grad=True)
    returns = torch.tensor([1.0, 1.0, 0.0, 7.0], dtype=D)
    mask = torch.tensor([1, 1, 0, 1])
    (0.5 * (((values - returns) ** 2) * mask).sum()).backward()
    assert critic_token_coefficients(values.detach(), returns, mask) == values.grad.tolist()


def test_group_planner_refuses_sao_and_says_where_it_streams():
    from thundersync_verl.core.errors import StreamingConfigError
    from thundersync_verl.core.estimators import estimator_from_verl

    with pytest.raises(StreamingConfigError, match="algos/sao/sao_streaming.py"):
        estimator_from_verl("sao")
