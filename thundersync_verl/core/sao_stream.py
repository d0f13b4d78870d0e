"""Streamed SAO: what is final when a single-rollout trajectory arrives, and what waits for the barrier.

Why:
1. With one rollout per prompt there is no group: a trajectory's GAE over its agent tokens depends only
   on its own rewards and on the critic's values of its tokens. The critic runs its forward when the
   trajectory arrives, with the weights of the step start (the critic is updated after the actor reads
   the values, as in verl's step), so ``trajectory_gae`` is final at arrival: the same numbers verl's
   batch estimator (``core/sao.py``) computes row by row.
2. verl's ``sao`` estimator then WHITENS the GAE over every agent token of the batch:
   A_t = (g_t - mu) * s with s = rsqrt(var + 1e-8) (unbiased variance). mu and s exist only once the
   last trajectory has arrived. The policy term of SAO is linear in A (the double-sided mask is detached
   and sign-independent), so with f_t = grad(-r_t m_t) (r_t the ratio to the rollout log-prob, m_t the
   mask, both known at arrival):
       sum_t A_t f_t = s * (sum_t g_t f_t - mu * sum_t f_t) = s * (G1 - mu * G2)
   G1 (coefficient g_t per token) goes straight into the batch gradient; G2 (coefficient 1 per agent
   token) into ONE bucket shared by the whole batch. At the barrier the bucket is folded with -mu and
   the deferred normaliser is multiplied by s (``WhitenFold``). Two backwards per trajectory, one extra
   gradient buffer per batch, exact.
3. ``whiten=False`` (the unwhitened GAE) needs no bucket: the coefficient g_t is final at arrival.
4. The statistics are computed in float64 over the trajectories sorted by id, so they do not depend on
   arrival order (verl computes them in float32 over its padded batch: the difference is rounding).
5. The critic's own step streams the same way: its loss at the step-start weights is
   0.5 * sum_t (V_t - G_t)^2 over agent tokens (verl's value clip is inactive at ratio 1: V = V_old), with
   the Monte-Carlo targets G final at arrival; the token-mean normaliser is deferred
   (``critic_token_coefficients``: the per-token coefficient (V_t - G_t) of grad V_t).
6. Numerics (fp32 engine, ``benchmarks/sao.py --gap-only``): the streamed step differs from verl's by about
   8e-7 (relative) where verl's own update with its rows regrouped differs by 4e-7 to 7e-7: verl rounds
   A_t = (g_t - mu) s per token, the stream rounds g_t and applies mu and s once. Subtracting an early
   estimate of mu from every direct coefficient (the same gradient, a smaller fold term) was measured and
   changed nothing beyond noise, so the plain decomposition is kept.
Shapes: per-trajectory vectors are [T] over the response tokens; ``agent_mask`` 1 on agent tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from thundersync_verl.core.errors import StreamingStateError, fail
from thundersync_verl.core.sao import WHITEN_EPS, fold_observation_rewards, masked_gae, mc_returns

SAO_BUCKET = "__sao_whiten__"  # the one bucket of a batch: G2 = sum over agent tokens of grad(-r m)



def _row(values: Sequence[float] | torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    return torch.as_tensor(values, dtype=dtype).reshape(1, -1)  # [1, T]


def trajectory_gae(rewards: Sequence[float], values: Sequence[float], agent_mask: Sequence[int], *,
                   gamma: float = 1.0, lam: float = 1.0,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gae, returns)`` of ONE trajectory, [T] each, 0 off its agent tokens: final at arrival (point 1).

    The same computation as verl's batch estimator restricted to this row (``dtype`` float32 as verl's
    reward and value tensors). ``rewards`` are per response token (the score on the last agent token).
    """
    r, v, m = _row(rewards, dtype), _row(values, dtype), _row(agent_mask, dtype)
    if not (r.shape == v.shape == m.shape) or r.shape[1] == 0:
        fail(f"rewards, values and agent_mask must have one entry per response token (got {r.shape[1]}, "
              f"{v.shape[1]}, {m.shape[1]})", "GAE reads them token by token",
              "pass the trajectory's per-token rewards, the critic's values and its response mask, unpadded")
    if not bool(torch.isfinite(r).all() and torch.isfinite(v).all()):
        fail("rewards and critic values must be finite", "one NaN poisons every advantage of the batch "
              "through the whitening statistics", "check the reward function and the critic's forward")
    folded = fold_observation_rewards(r, m)  # [1, T]
    gae = masked_gae(folded, v, m, gamma, lam)  # [1, T]
    returns = mc_returns(folded, m, gamma)  # [1, T]
    return gae[0], returns[0]


@dataclass(frozen=True)
class WhitenFold:
    """The barrier's part of the whitening: fold the bucket with -mean, multiply the normaliser by inv_std."""

    mean: float
    inv_std: float
    num_tokens: int

    @property
    def bucket_coef(self) -> float:
        return -self.mean

    def scale(self, base_scale: float) -> float:
        return base_scale * self.inv_std


class WhitenLedger:
    """The agent-token GAE of every trajectory of a batch, for the deferred whitening statistics (point 2)."""

    def __init__(self):
        self._gae: dict[Hashable, torch.Tensor] = {}

    def add(self, traj_id: Hashable, gae: torch.Tensor, agent_mask: Sequence[int]) -> None:
        if traj_id in self._gae:
            fail(f"trajectory {traj_id!r} arrived twice", "its tokens would be counted twice in the batch "
                  "mean and variance", "add each trajectory once per batch")
        keep = torch.as_tensor(agent_mask).reshape(-1) != 0  # [T]
        self._gae[traj_id] = gae.reshape(-1)[keep].to(torch.float64)  # [n_agent]

    def __len__(self) -> int:
        return len(self._gae)

    @property
    def num_tokens(self) -> int:
        return sum(int(g.numel()) for g in self._gae.values())

    def fold(self) -> WhitenFold:
        """mean and rsqrt(unbiased var + 1e-8) over every agent token, as ``core.sao.masked_whiten``."""
        if not self._gae:
            fail("no trajectory in the batch", "the whitening statistics need its agent tokens",
                  "add every trajectory before the barrier", StreamingStateError)
        x = torch.cat([self._gae[k] for k in sorted(self._gae, key=repr)])  # [N] canonical order
        n = int(x.numel())
        if n < 2:
            fail(f"whitening needs at least 2 agent tokens in the batch (got {n})",
                  "the unbiased variance of fewer than two values is undefined",
                  "train on batches with at least two response tokens", StreamingStateError)
        mean = x.sum() / n
        var = ((x - mean) ** 2).sum() / n * (n / (n - 1))
        return WhitenFold(float(mean), float(torch.rsqrt(var + WHITEN_EPS)), n)


def actor_token_coefficients(gae: torch.Tensor, agent_mask: Sequence[int], *,
                             whiten: bool = True) -> dict[str, list[float]]:
    """Per-token coefficients of a trajectory's backwards: {"direct": g_t, bucket: 1} (whiten) or {"direct": g_t}.

    Zero off the agent tokens. The direct row's coefficient is final at arrival; the bucket row is folded
    with -mean at the barrier (point 2).
    """
    mask = [1.0 if m else 0.0 for m in torch.as_tensor(agent_mask).reshape(-1).tolist()]
    g = gae.reshape(-1).tolist()
    if len(g) != len(mask):
        fail(f"gae has {len(g)} tokens, agent_mask {len(mask)}", "coefficients align with response tokens",
              "pass the trajectory's own GAE and mask")
    if not all(math.isfinite(x) for x in g):
        fail("GAE values must be finite", "one NaN poisons the batch gradient", "check rewards and critic values")
    out = {"direct": [x * m for x, m in zip(g, mask)]}
    if whiten:
        out[SAO_BUCKET] = mask
    return out


def critic_token_coefficients(values: Sequence[float], returns: Sequence[float],
                              agent_mask: Sequence[int]) -> list[float]:
    """(V_t - G_t) on agent tokens, 0 elsewhere: grad of 0.5 sum_t (V_t - G_t)^2 is sum_t coef_t grad V_t (point 5)."""
    v, g, m = (torch.as_tensor(x, dtype=torch.float64).reshape(-1) for x in (values, returns, agent_mask))
    if not (v.shape == g.shape == m.shape):
        fail("values, returns and agent_mask must align token by token", "the value loss pairs V_t with G_t",
              "pass the trajectory's critic values, MC returns and response mask")
    return ((v - g) * (m != 0)).tolist()
