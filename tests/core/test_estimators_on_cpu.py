"""Group estimators: hand-computed closed forms, and equality with verl's own functions.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync_verl.core import (
    FunctionEstimator,
    GRPOEstimator,
    RLOOEstimator,
    StreamingConfigError,
    estimator_from_verl,
)


def test_grpo_closed_form_binary_group():
    # rewards 1,0,0,1: mean 0.5, unbiased std sqrt(1/3)
    adv = GRPOEstimator().advantages([1.0, 0.0, 0.0, 1.0])
    s = math.sqrt(1.0 / 3.0) + 1e-6
    assert adv == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], rel=1e-15)


def test_grpo_singleton_uses_verl_float32_divisor():
    # verl: mean torch.tensor(0.0), std torch.tensor(1.0) (float32) -> divisor float32(1 + 1e-6)
    divisor = float(torch.tensor(1.0) + 1e-6)
    assert divisor != 1.0 + 1e-6
    assert GRPOEstimator().advantages([3.0]) == [3.0 / divisor]
    assert GRPOEstimator(norm_by_std=False).advantages([3.0]) == [3.0]
    assert RLOOEstimator().advantages([3.0]) == [3.0]


def test_equal_rewards_give_equal_advantages():
    assert GRPOEstimator().advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]
    # 0.7 is not exact in binary: like verl, the mean rounds and the advantages are a tiny
    # common value (amplified by 1 / (std + eps)); what matters is that they are all equal
    adv = GRPOEstimator().advantages([0.7, 0.7, 0.7])
    assert len(set(adv)) == 1 and abs(adv[0]) < 1e-9
    assert RLOOEstimator().advantages([0.7, 0.7]) == pytest.approx([0.0, 0.0], abs=1e-15)


def test_rloo_closed_form():
    # n=3, rewards 1,2,6: A_i = r_i - mean(others) = (r_i*n - sum)/(n-1)
    adv = RLOOEstimator().advantages([1.0, 2.0, 6.0])
    assert adv == pytest.approx([1 - 4.0, 2 - 3.5, 6 - 1.5], rel=1e-14)


@pytest.mark.parametrize("est", [GRPOEstimator(), GRPOEstimator(norm_by_std=False), RLOOEstimator()])
def test_affine_coefficients_reproduce_advantages(est):
    rewards = [0.3, -1.2, 2.5, 2.5, 0.0]
    alpha, beta = est.affine_coefficients(rewards)
    assert [alpha * r + beta for r in rewards] == pytest.approx(est.advantages(rewards), rel=1e-13, abs=1e-13)


def _verl(name: str, rewards: list[float], index: list[int], dtype) -> list[float]:
    from verl.trainer.ppo import core_algos as ca

    scores = torch.zeros(len(rewards), 3, dtype=dtype)
    scores[:, -1] = torch.tensor(rewards, dtype=dtype)
    mask = torch.ones_like(scores)
    if name == "rloo":
        adv, _ = ca.compute_rloo_outcome_advantage(scores, mask, np.array(index))
    else:
        adv, _ = ca.compute_grpo_outcome_advantage(scores, mask, np.array(index), norm_adv_by_std_in_grpo=name == "grpo")
    return adv[:, 0].tolist()


groups_strategy = st.lists(
    st.lists(st.one_of(st.sampled_from([0.0, 1.0, 0.5]), st.floats(-10, 10, allow_nan=False, width=32)), min_size=1, max_size=6),
    min_size=1,
    max_size=4,
)


@settings(max_examples=80, deadline=None)
@given(groups=groups_strategy, name=st.sampled_from(["grpo", "grpo_no_std", "rloo"]), fp32=st.booleans())
def test_matches_verl_estimators(groups, name, fp32):
    """Bit-for-bit in the reward dtype verl computes in (float32 or float64)."""
    dtype = torch.float32 if fp32 else torch.float64
    rewards = [r for g in groups for r in g]
    index = [gi for gi, g in enumerate(groups) for _ in g]
    expected = _verl(name, rewards, index, dtype)
    adv_name = "rloo" if name == "rloo" else "grpo"
    est = estimator_from_verl(adv_name, norm_adv_by_std_in_grpo=name == "grpo", dtype=dtype)
    got = []
    for g in groups:
        got += est.advantages([float(torch.tensor(r, dtype=dtype)) for r in g])
    assert got == expected


def test_function_estimator_and_name_mapping():
    est = FunctionEstimator(lambda rs: [r - min(rs) for r in rs], name="min-baseline")
    assert est.advantages([2.0, 5.0]) == [0.0, 3.0]
    assert not est.is_affine
    assert isinstance(estimator_from_verl("grpo_vectorized"), GRPOEstimator)
    assert isinstance(estimator_from_verl("rloo_vectorized"), RLOOEstimator)
    with pytest.raises(StreamingConfigError, match="algorithm.adv_estimator"):
        estimator_from_verl("gae")
    with pytest.raises(StreamingConfigError, match="one advantage per reward"):
        FunctionEstimator(lambda rs: [0.0], name="short").advantages([1.0, 2.0])
