"""Canonical reduction order: the update is bitwise identical for any arrival order.

Real tiny transformer in float32 (where summation order shows in the last bits), per-
trajectory backward run in the arrival order itself, KL and entropy terms included, rewards
arriving late; 20 random permutations must give identical bits. The default (arrival-order)
summation is shown to differ on the same data, so the check has teeth.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import random

import pytest
import torch

N_PERMUTATIONS = 20


def _bits(grads):
    return [g.view(torch.int32).clone() for g in grads]


@pytest.mark.slow  # backward passes over many permutations (about 6 s of CPU)
def test_canonical_order_is_bitwise_identical_across_permutations(harness):
    model, ref = harness.tiny_qwen2(0, torch.float32), harness.tiny_qwen2(1, torch.float32)
    spec = harness.LossSpec(estimator="grpo", loss_agg_mode="token-mean", entropy_coeff=0.01, kl_coef=0.05)
    trajs = harness.make_batch(7, [4, 4, 2, 3], "continuous")
    expected = harness.oracle_gradient(model, ref, spec, trajs)
    rng = random.Random(0)
    canonical, arrival = [], []
    for _ in range(N_PERMUTATIONS):
        order = list(range(len(trajs)))
        rng.shuffle(order)
        acc = harness.make_accumulator(model, spec, "canonical")
        harness.stream_batch(acc, model, ref, spec, trajs, order, "canonical")
        grads = acc.compute_batch_gradient()
        assert harness.relative_error(grads, expected) <= 1e-6
        canonical.append(_bits(grads))
        plain = harness.make_accumulator(model, spec, "affine")
        harness.stream_batch(plain, model, ref, spec, trajs, order, "affine")
        arrival.append(_bits(plain.compute_batch_gradient()))
    for other in canonical[1:]:
        assert all(torch.equal(a, b) for a, b in zip(canonical[0], other))
    differs = [any(not torch.equal(a, b) for a, b in zip(arrival[0], o)) for o in arrival[1:]]
    assert any(differs), "arrival-order summation was expected to differ in some bits"
