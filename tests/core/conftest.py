"""Shared fixtures for the exactness-core tests (CPU only, no GPU needed).

The tiny-transformer harness and the verl oracle live in benchmarks/_common.py so that the
benchmarks print figures produced by exactly the code these tests check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def harness():
    """The benchmarks' tiny-LM harness module (tiny Qwen2, verl oracle, streaming driver)."""
    import _common

    return _common


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
