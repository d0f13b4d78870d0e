"""Distributions and the group copula (CPU, no GPU, < 5 s)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from thundersync_verl.sim.dists import Dist, const, group_latents, lognormal, mixture, normal_cdf, pareto
from thundersync_verl.sim.dists import _normal_ppf


def test_normal_cdf_and_ppf_match_erf():
    z = np.linspace(-6, 6, 121)
    exact = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in z])
    assert np.max(np.abs(normal_cdf(z) - exact)) < 2e-7
    u = np.array([1e-9, 1e-4, 0.01, 0.3, 0.5, 0.7, 0.99, 1 - 1e-6])
    assert np.allclose(normal_cdf(_normal_ppf(u)), u, rtol=1e-3, atol=2e-7)  # the CDF's absolute error bound
    z = np.linspace(-4, 4, 81)
    assert np.max(np.abs(_normal_ppf(exact[20:101]) - z)) < 1e-6


def test_lognormal_median_and_spread():
    x = lognormal(30, 0.8).sample(np.random.default_rng(0), 200_000)
    assert abs(np.median(x) / 30 - 1) < 0.01
    assert abs(np.log(x).std() - 0.8) < 0.01


def test_pareto_tail_follows_power_law():
    d = pareto(10, 1.5)
    x = d.sample(np.random.default_rng(1), 400_000)
    assert x.min() >= 10
    for q in (20, 50, 100):
        assert abs((x > q).mean() / (10 / q) ** 1.5 - 1) < 0.05


def test_mixture_marginal_has_component_weights():
    d = mixture([0.7, 0.3], [const(1.0), const(10.0)])
    x = d.sample(np.random.default_rng(2), 100_000)
    assert abs((x == 10.0).mean() - 0.3) < 0.01
    assert set(np.unique(x)) == {1.0, 10.0}


def test_cap_clips_samples_and_moments_match_monte_carlo():
    d = lognormal(50, 1.0, cap=300)
    x = d.sample(np.random.default_rng(3), 400_000)
    assert x.max() <= 300
    assert abs(d.mean() / x.mean() - 1) < 0.01
    assert abs(d.var() / x.var() - 1) < 0.03


@pytest.mark.parametrize("icc", [0.0, 0.72, 1.0])
def test_group_latents_have_the_requested_within_group_correlation(icc):
    z = group_latents(np.random.default_rng(4), 20_000, 2, icc).reshape(-1, 2)
    assert abs(z.std() - 1) < 0.02
    assert abs(np.corrcoef(z[:, 0], z[:, 1])[0, 1] - icc) < 0.03


def test_invalid_specs_explain_the_rule():
    with pytest.raises(ValueError, match="sum to 1"):
        mixture([0.5, 0.4], [const(1), const(2)])
    with pytest.raises(ValueError, match="unknown"):
        Dist("weibull")
    with pytest.raises(ValueError, match="median > 0"):
        lognormal(0, 1)
    with pytest.raises(ValueError, match="share of variance"):
        group_latents(np.random.default_rng(0), 2, 2, 1.5)


def test_dict_round_trip():
    d = mixture([0.6, 0.4], [lognormal(10, 0.5), pareto(40, 2.0, cap=500)], cap=400)
    assert Dist.from_dict(d.to_dict()) == d
