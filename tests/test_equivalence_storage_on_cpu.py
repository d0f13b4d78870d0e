"""benchmarks/equivalence_storage.py: a gap made of one fp32 storage flip of a weight near 1 is told apart from a gap
spread over the model (equivalence.py point 20)."""

from __future__ import annotations

import torch

from thundersync_harness.benchmarks import load_benchmark

S = load_benchmark("equivalence_storage")


def _params(n: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    p = (0.05 * torch.randn(n, generator=g)).float()
    p[7] = 0.99990  # a norm weight just below 1
    return p.double()


def test_one_flip_of_a_weight_near_1_carries_the_gap():
    params = _params()
    spread = 1e-10 * torch.randn(params.numel(), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    one_ulp = float(S.ulps(params[7:8])[0])
    assert one_ulp == 2.0 ** -24  # the fp32 spacing just below 1
    gap = spread.clone()
    gap[7] += one_ulp  # one path stored the weight one ulp higher
    row = S.storage_report(gap, params)
    assert row["worst_step_top3_gap_share"] > 0.95
    assert row["worst_step_top3_ulps"][0] == 1.0 and row["worst_step_top3_magnitudes"][0] == round(0.9999, 4)


def test_a_gap_spread_over_the_model_is_not_a_flip():
    params = _params()
    gap = 1e-9 * torch.randn(params.numel(), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    row = S.storage_report(gap, params)
    assert row["worst_step_top3_gap_share"] < 0.05
    assert S.storage_report(gap, None) == {} and S.storage_report(gap, params[:10]) == {}  # nothing kept: no figure
