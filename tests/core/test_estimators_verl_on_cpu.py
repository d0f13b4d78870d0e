"""The estimators beyond GRPO/RLOO against verl 0.9.1's own estimator functions, and the refusals.

Each streamed estimator gets random batches (uneven groups, groups of one, ties, all-equal groups,
varied response lengths) laid out as verl's trainer lays them out (outcome reward on the last valid
token, int64 response mask) and is compared with verl's registered function:
- group statistics (grpo_passk, opo, gpg): bit for bit in float32 and float64 when verl's batch rows
  are in the stream's order (groups as declared, members by id); any other row order changes only
  float64 summation order (1e-12);
- batch whitening (reinforce_plus_plus and its baseline): verl reduces a padded [B, T] tensor and the
  core sums per trajectory, so float64 agrees to 1e-12 and float32 within 8 float32 ulps of the largest
  advantage (measured: at most a few). Whitening divides the rounding of the batch mean (a few ulps of
  the largest input) by sqrt(var + 1e-8), so when the returns barely vary (one row, all rewards equal)
  both sides are rounding noise amplified up to 1e4 times, and the bound is that amplified ulp.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from thundersync_harness.estimator_steps import verl_advantages
from thundersync_verl.core import StreamingConfigError
from thundersync_verl.core.batch_estimators import ArrivalEstimator, Outcome
from thundersync_verl.core.estimators import REFUSED, STREAMED, estimator_from_verl

NEW = ["grpo_passk", "opo", "gpg", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
WHITENED = {"reinforce_plus_plus", "reinforce_plus_plus_baseline"}


def core_advantages(name: str, outcomes: list[Outcome], dtype: torch.dtype, norm: bool = True) -> list[float]:
    est = estimator_from_verl(name, norm_adv_by_std_in_grpo=norm, dtype=dtype)
    if isinstance(est, ArrivalEstimator):
        return est.advantages(outcomes)
    out = []
    for gid in dict.fromkeys(o.group for o in outcomes):
        out += est.advantages([o.reward for o in outcomes if o.group == gid])
    return out


reward_st = st.one_of(st.sampled_from([0.0, 1.0, 0.5, -1.0]), st.floats(-10, 10, allow_nan=False, width=32))
batch_st = st.lists(
    st.lists(st.tuples(reward_st, st.integers(1, 7)), min_size=1, max_size=6), min_size=1, max_size=5
)


def _outcomes(groups, dtype, min_size: int = 1) -> list[Outcome]:
    groups = [g if len(g) >= min_size else g + g[:1] * (min_size - len(g)) for g in groups]
    return [Outcome(gi, ti, float(torch.tensor(r, dtype=dtype)), n) for gi, g in enumerate(groups) for ti, (r, n) in enumerate(g)]


def _ulp32(values: list[float]) -> float:
    return float(np.spacing(np.float32(max(abs(v) for v in values) or 1.0)))


def _whitened_tol32(outcomes: list[Outcome], expected: list[float]) -> float:
    """8 ulps of the output, or of the input scale amplified by 1/sqrt(var + eps) when that is larger.

    The whitened input is the return (the outcome reward on every valid token) or, with the baseline,
    the reward minus its group mean, so it is at most twice the largest reward in magnitude.
    """
    tokens = np.concatenate([np.full(o.length, o.reward) for o in outcomes])
    amplified = _ulp32([2 * float(np.max(np.abs(tokens)))]) / np.sqrt(np.var(tokens) + 1e-8)
    return 8 * max(_ulp32(expected), float(amplified))


@settings(max_examples=60, deadline=None)
@given(groups=batch_st, name=st.sampled_from(NEW), fp32=st.booleans(), norm=st.booleans())
@example(groups=[[(0.8, 7)]], name="reinforce_plus_plus", fp32=True, norm=False)
def test_matches_verl_in_stream_row_order(groups, name, fp32, norm):
    """Same rows in the same order: equal bit for bit (group statistics) or within the stated bound."""
    dtype = torch.float32 if fp32 else torch.float64
    outcomes = _outcomes(groups, dtype, min_size=2 if name == "grpo_passk" else 1)
    if name in WHITENED and sum(o.length for o in outcomes) < 2:
        return
    expected = verl_advantages(name, outcomes, dtype, norm)
    got = core_advantages(name, outcomes, dtype, norm)
    if name not in WHITENED:
        assert got == expected
    elif fp32:
        assert np.max(np.abs(np.subtract(got, expected))) <= _whitened_tol32(outcomes, expected)
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(groups=batch_st, name=st.sampled_from(NEW), perm_seed=st.integers(0, 10_000))
def test_any_row_order_float64(groups, name, perm_seed):
    """verl's batch in any row order: the same advantages per trajectory to 1e-12 (float64)."""
    outcomes = _outcomes(groups, torch.float64, min_size=2 if name == "grpo_passk" else 1)
    if name in WHITENED and sum(o.length for o in outcomes) < 2:
        return
    perm = np.random.default_rng(perm_seed).permutation(len(outcomes))
    shuffled = [outcomes[i] for i in perm]
    expected = dict(zip(((o.group, o.traj) for o in shuffled), verl_advantages(name, shuffled, torch.float64)))
    got = dict(zip(((o.group, o.traj) for o in outcomes), core_advantages(name, outcomes, torch.float64)))
    np.testing.assert_allclose([got[k] for k in expected], list(expected.values()), rtol=1e-12, atol=1e-12)


def test_hand_computed_cases():
    """Ties, all-equal groups and token weighting on numbers worked by hand."""
    est = estimator_from_verl("grpo_passk", norm_adv_by_std_in_grpo=False)
    assert est.advantages([0.0, 3.0, 1.0]) == [0.0, 2.0, 0.0]  # only the best: 3 - 1
    assert est.advantages([3.0, 3.0, 1.0]) == [0.0, 0.0, 0.0]  # tie at the top: gap 0
    opo = estimator_from_verl("opo")
    got = opo.advantages([Outcome(0, 0, 1.0, 3), Outcome(0, 1, 0.0, 1)])  # baseline (3*1 + 1*0) / 4
    assert got == [0.25, -0.75]
    rpp = estimator_from_verl("reinforce_plus_plus")
    same = rpp.advantages([Outcome(0, t, 1.0, 2) for t in range(3)])  # all equal: var 0 -> A = 0 * 1e4
    assert same == [0.0, 0.0, 0.0]
    # tokens weigh: rewards 1 (3 tokens) and 0 (1 token): mu = 0.75, var = (3*.0625 + .5625)/4 * 4/3, with
    # verl's Bessel factor 4/3 rounded to float32 (int64 / int64)
    two = rpp.advantages([Outcome(0, 0, 1.0, 3), Outcome(1, 0, 0.0, 1)])
    var = 0.1875 * float(np.float32(4.0 / 3.0))
    np.testing.assert_allclose(two, [0.25 / np.sqrt(var + 1e-8), -0.75 / np.sqrt(var + 1e-8)], rtol=1e-14)
    gpg = estimator_from_verl("gpg")  # alpha = 4 rows / 2 nonzero = 2
    outs = [Outcome(0, 0, 1.0, 1), Outcome(0, 1, 0.0, 1), Outcome(1, 0, 2.0, 1), Outcome(1, 1, 0.0, 1)]
    assert gpg.advantages(outs) == [1.0, -1.0, 2.0, -2.0]
    assert gpg.coefficients(outs[:2]) == [0.5, -0.5] and gpg.barrier_factor(outs) == 2.0


def test_stream_coefficients_times_barrier_factor_equal_advantages():
    """GPG folds s - mean_g and scales at the barrier: the product equals verl's A within one rounding."""
    rng = np.random.default_rng(3)
    outs = [Outcome(g, t, float(rng.choice([0.0, 1.0, 0.5])), 2) for g in range(4) for t in range(int(rng.integers(1, 5)))]
    est = estimator_from_verl("gpg", dtype=torch.float32)
    factor = est.barrier_factor(outs)
    streamed = []
    for g in range(4):
        streamed += [factor * c for c in est.coefficients([o for o in outs if o.group == g])]
    np.testing.assert_allclose(streamed, verl_advantages("gpg", outs, torch.float32), rtol=2e-7, atol=0)


def test_every_verl_estimator_is_streamed_or_refused():
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, AdvantageEstimator

    names = {e.value for e in AdvantageEstimator}
    assert len(names) == 14 and names <= set(ADV_ESTIMATOR_REGISTRY)
    assert set(STREAMED) | set(REFUSED) == names and not set(STREAMED) & set(REFUSED)
    assert len(STREAMED) >= 9


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refusal_names_key_reason_and_fix(name):
    with pytest.raises(StreamingConfigError) as err:
        estimator_from_verl(name)
    text = str(err.value)
    assert f"algorithm.adv_estimator={name!r}" in text
    assert REFUSED[name] in text  # the reason
    assert "set algorithm.adv_estimator to one of" in text and "reinforce_plus_plus" in text  # the fix


def test_discounted_reinforce_plus_plus_and_singleton_passk_are_refused():
    with pytest.raises(StreamingConfigError, match="algorithm.gamma=1.0"):
        estimator_from_verl("reinforce_plus_plus", gamma=0.99)
    with pytest.raises(StreamingConfigError, match="rollout.n >= 2"):
        estimator_from_verl("grpo_passk").advantages([1.0])
