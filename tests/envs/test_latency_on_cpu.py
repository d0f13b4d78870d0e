"""The latency model has the documented heavy-tailed shape and a single scale knob. CPU only."""

from __future__ import annotations

import random

import pytest

from thundersync_verl.envs.latency import LatencyModel


def _quantiles(model: LatencyModel, n: int = 40_000, seed: int = 0) -> dict[float, float]:
    xs = sorted(model.sample_many(n, random.Random(seed)))
    return {q: xs[int(q * n)] for q in (0.5, 0.9, 0.99)} | {1.0: xs[-1]}


def test_default_shape_matches_the_documented_quantiles():
    q = _quantiles(LatencyModel())
    assert 0.13 < q[0.5] < 0.18
    assert 0.25 < q[0.9] < 0.45
    assert 1.4 < q[0.99] < 2.6
    assert q[1.0] == pytest.approx(4.0)  # the cap is reached and never exceeded


def test_scale_multiplies_quantiles_and_cap():
    base, scaled = _quantiles(LatencyModel()), _quantiles(LatencyModel(scale=3.0))
    for q in (0.5, 0.9, 0.99, 1.0):
        assert scaled[q] == pytest.approx(3.0 * base[q])


def test_kinds():
    assert LatencyModel(kind="constant", median_s=0.25).sample() == 0.25
    lognormal = _quantiles(LatencyModel(kind="lognormal", median_s=1.0, sigma=0.5, max_s=100.0))
    assert 0.95 < lognormal[0.5] < 1.05
    pareto = _quantiles(LatencyModel(kind="pareto", tail_scale=0.5, alpha=2.0, max_s=1e9))
    assert pareto[0.5] == pytest.approx(0.5 * 2 ** 0.5, rel=0.05)  # Pareto median x_m * 2^(1/alpha)
    assert min(LatencyModel(kind="pareto").sample_many(1000, random.Random(0))) >= 0.5


def test_sampling_is_reproducible():
    assert LatencyModel(seed=3).sample_many(50) == LatencyModel(seed=3).sample_many(50)
    assert LatencyModel().sample_many(50, random.Random(1)) == LatencyModel().sample_many(50, random.Random(1))
    assert LatencyModel(seed=3).sample_many(50) != LatencyModel(seed=4).sample_many(50)


def test_from_config_round_trip_and_validation():
    model = LatencyModel(kind="lognormal", median_s=0.3, scale=2.0)
    assert LatencyModel.from_config(model.to_config()) == model
    assert LatencyModel.from_config(None) == LatencyModel()
    assert LatencyModel.from_config({"median_s": None, "scale": 2.0}) == LatencyModel(scale=2.0)
    with pytest.raises(ValueError, match="unknown latency keys"):
        LatencyModel.from_config({"median": 0.1})
    with pytest.raises(ValueError, match="kind must be one of"):
        LatencyModel(kind="gamma")
    with pytest.raises(ValueError, match="probability"):
        LatencyModel(tail_prob=1.5)
    with pytest.raises(ValueError, match=">= 0"):
        LatencyModel(scale=-1.0)
