"""Streamed gradient vs verl's batch-synchronous gradient on a real tiny transformer.

Qwen2ForCausalLM (hidden 32, 2 layers, vocab 128); the oracle is ONE padded forward through
verl's GRPO / Dr.GRPO / RLOO estimator, vanilla policy loss, entropy and KL terms and
agg_loss; the streamed side runs one forward/backward per trajectory (or per chunk) in a
shuffled arrival order. Acceptance: relative error <= 1e-6 in float32, <= 1e-12 in float64.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import random

import pytest
import torch

ESTIMATORS = ("grpo", "grpo_no_std", "rloo")
AGG = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("low_var_kl", "k1", "k2", "k3+", "abs")
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}

pytestmark = pytest.mark.slow  # tiny Qwen2 forward/backward per case, dozens of cases (about a minute on 2 cores)


@pytest.fixture(scope="module")
def models(harness):
    return {dt: (harness.tiny_qwen2(0, dt), harness.tiny_qwen2(1, dt)) for dt in TOL}


@pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "fp64"])
@pytest.mark.parametrize("agg", AGG)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_streamed_matches_verl_on_tiny_qwen2(harness, models, estimator, agg, dtype):
    model, ref = models[dtype]
    case = ESTIMATORS.index(estimator) * len(AGG) + AGG.index(agg)
    spec = harness.LossSpec(
        estimator=estimator,
        loss_agg_mode=agg,
        loss_scale_factor=16 if agg == "seq-mean-token-sum-norm" else None,
        entropy_coeff=0.01,
        kl_coef=0.05,
        kl_type=KL_TYPES[case % len(KL_TYPES)],
    )
    trajs = harness.make_batch(case, [4, 3, 1, 4], ("binary", "ties", "continuous")[case % 3])
    expected = harness.oracle_gradient(model, ref, spec, trajs)
    order = list(range(len(trajs)))
    for mode in harness.STREAM_MODES:
        random.Random(case).shuffle(order)
        acc = harness.make_accumulator(model, spec, mode)
        harness.stream_batch(acc, model, ref, spec, trajs, order, mode)
        err = harness.relative_error(acc.compute_batch_gradient(), expected)
        assert err <= TOL[dtype], (mode, err)
