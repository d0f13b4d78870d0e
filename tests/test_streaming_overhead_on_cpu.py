"""benchmarks/streaming_overhead.py: the product's split of a streamed step (the driver's ``StreamPlanner``, a
learner running its ops as the FSDP2 worker does) reproduces the batched gradient, and the coalescing policy
gives a busy learner fewer, larger calls."""

from __future__ import annotations

import pytest
import torch

from thundersync_harness import tiny_lm as C
from thundersync_harness.benchmarks import load_benchmark

S = load_benchmark("streaming_overhead")


@pytest.fixture(scope="module")
def setting():
    torch.manual_seed(0)
    model = C.tiny_qwen2(0, torch.float32, hidden=32, layers=1, vocab=64)
    spec = C.LossSpec(estimator="grpo", loss_agg_mode="token-mean")
    trajs = C.make_batch(0, [4] * 4, "binary", prompt_len=(3, 6), response_len=(2, 9), vocab=64)
    S.batched(model, spec, trajs)
    return model, spec, trajs, [p.grad.clone() for p in model.parameters()]


def _grad_error(model, reference) -> float:
    return C.relative_error([p.grad for p in model.parameters()], reference)


@pytest.mark.parametrize("wake_every", [1, 3, 16])
def test_the_worker_split_reproduces_the_batched_gradient(setting, wake_every):
    model, spec, trajs, reference = setting
    out = S.worker_stream(model, spec, trajs, S.arrival_order(trajs, seed=1), wake_every, 4)
    assert _grad_error(model, reference) <= 1e-5
    assert out["calls"] >= 16 // 4 and out["learner"] > 0.0 and out["planner"] > 0.0


def test_a_busy_learner_coalesces_and_an_idle_one_streams(setting):
    model, spec, trajs, reference = setting
    fractions = S.arrival_fractions(trajs, seed=1)
    at_once = S.coalescing_stream(model, spec, trajs, fractions, 0.0, 8)
    assert _grad_error(model, reference) <= 1e-5
    assert at_once["calls"] == 2  # everything landed: closed groups, chunks of 8
    assert at_once["tail"] > 0.0  # all of it after the (only) landing
    spread = S.coalescing_stream(model, spec, trajs, fractions, 1e6, 8)  # landings far apart: a call each
    assert _grad_error(model, reference) <= 1e-5
    assert spread["calls"] > at_once["calls"] and spread["tail"] < at_once["tail"]
