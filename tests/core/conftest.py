"""Shared fixtures for the exactness-core tests (CPU only, no GPU needed).

The tiny-transformer harness and the verl oracle live in ``thundersync_harness.tiny_lm``
(tests/harness/) so that the benchmarks print figures produced by exactly the code these tests check.
"""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def harness():
    """The tiny-LM harness module the benchmarks use (tiny Qwen2, verl oracle, streaming driver)."""
    from thundersync_harness import tiny_lm

    return tiny_lm


class LinearLogProbs(torch.nn.Module):
    """A 'policy' whose log-prob of token (i, t) is linear in the parameters: <theta, phi_it>.

    Cheap enough for hundreds of property-test examples, yet every gradient still flows
    through verl's own loss functions in the oracle.
    """

    def __init__(self, seed: int, max_len: int, batch: int, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(4, 3, generator=g, dtype=dtype))
        self.b = torch.nn.Parameter(torch.randn(5, generator=g, dtype=dtype))
        self.phi_w = torch.randn(batch, max_len, 4, 3, generator=g, dtype=dtype)  # [B, T, 4, 3]
        self.phi_b = torch.randn(batch, max_len, 5, generator=g, dtype=dtype)  # [B, T, 5]

    def forward(self, rows: list[int]) -> torch.Tensor:
        idx = torch.tensor(rows)
        lw = (self.phi_w[idx] * self.w).sum(dim=(-1, -2))  # [R, T]
        lb = (self.phi_b[idx] * self.b).sum(dim=-1)  # [R, T]
        return -torch.nn.functional.softplus(lw + lb)  # [R, T], a valid log-prob range


@pytest.fixture
def linear_model():
    return LinearLogProbs
