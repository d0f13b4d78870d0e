"""Streaming in Megatron's per-token-loss regime (``calculate_per_token_loss``), TP=1, one gloo process.

verl 0.9.1 runs the regime where Megatron-Bridge turns it on: context parallel > 1 and dynamic CP. CP > 1 cannot
run here: megatron-core's local ``DotProductAttention`` asserts ``context_parallel_size == 1`` ("Context
parallelism is only supported by TEDotProductAttention!") and megatron-bridge (the bridge that turns the regime on)
imports TransformerEngine. verl requires THD packing (``use_remove_padding=True``) in the regime, which the local
attention refuses ("Packed sequence is not supported by DotProductAttention"): the CPU layer spec runs it with a
block-diagonal causal mask (``backends/megatron/cpu_spec.py`` point 4; checked here against the HF model). So
CP > 1 stays unverified on the CPU: the regime is forced on at CP = 1 (``thundersync_harness.megatron_per_token``),
which is everything the regime changes (loss tuple, no division by the micro-batch count, DDP sum, division by the
token total at finalize) except the per-CP-rank token count, and verl's own Megatron update in the regime is the
reference. TP=2 x PP=2 and DP=2 run in their own modules (``test_megatron_per_token_loss_*_on_cpu.py``).
"""

from __future__ import annotations

import random
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from thundersync_verl import verl_adapter as va

GROUPS = 2


def _verl_postprocess(routed: int, dp: int):
    """verl's own ``postprocess_micro_batch_func`` in the regime, on a stand-in engine (dense, static CP 1)."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    engine = SimpleNamespace(
        prepare_model_outputs=lambda output, data: output, get_data_parallel_group=lambda: None,
        engine_config=SimpleNamespace(dynamic_context_parallel=False, use_remove_padding=True, context_parallel_size=1),
        tf_config=SimpleNamespace(calculate_per_token_loss=True),
        _routed_num_tokens=lambda data: torch.tensor(routed))
    engine.postprocess_micro_batch_func = partial(MegatronEngineWithLMHead.postprocess_micro_batch_func, engine)
    return engine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_streamed_loss_reaches_the_backward_with_seed_exactly_one(dtype):
    # verl multiplies the loss by routed_num_tokens / dp_size of the CALL; under megatron_unit_seed_losses the
    # gradient that reaches the loss is exactly what it would be without the regime (x 1), bit for bit
    from tensordict import TensorDict

    rng = random.Random(0)
    cases = [(rng.randint(1, 200_000), rng.choice([1, 2, 3, 4, 6, 8])) for _ in range(200)] + [(1, 1), (7, 3)]
    for routed, dp in cases:
        engine = _verl_postprocess(routed, dp)
        x = torch.randn(5, dtype=dtype, requires_grad=True)
        w = torch.randn(5, dtype=dtype)
        data = TensorDict({"input_ids": torch.zeros(1, 3, dtype=torch.long)}, batch_size=[1])
        va.assign_non_tensor(data, num_micro_batch=2, routed_num_tokens=routed, dp_size=dp)

        def loss_fn(model_output, data, dp_group=None):
            return (w * model_output["log_probs"]).sum() * dp, {}

        with va.megatron_unit_seed_losses(engine):
            local_sum, tokens, _ = engine.postprocess_micro_batch_func(
                {"log_probs": x}, data, forward_only=False, loss_function=loss_fn)
        assert "postprocess_micro_batch_func" in vars(engine)  # the stand-in's own attribute is back
        local_sum.backward()
        assert torch.equal(x.grad, w * dp), (routed, dp)  # d(loss)/dx: seeded with exactly 1
        assert int(tokens) == routed  # verl's token count is untouched (the barrier finalises without it)
        want = (w * x.detach()).sum() * dp * routed / dp
        assert torch.equal(local_sum.detach(), want)  # the value verl reports is unchanged too


def test_forward_only_calls_and_other_engines_pass_through():
    engine = SimpleNamespace(postprocess_micro_batch_func=lambda output, data, forward_only, loss_function: (
        output, forward_only, loss_function))
    with va.megatron_unit_seed_losses(engine):
        assert engine.postprocess_micro_batch_func(1, None, forward_only=True, loss_function=None) == (1, True, None)
    assert va.megatron_per_token_loss(SimpleNamespace(tf_config=SimpleNamespace(calculate_per_token_loss=True)))
    assert not va.megatron_per_token_loss(SimpleNamespace(tf_config=None))


@pytest.fixture(scope="module")
def group(start_megatron):
    return start_megatron(groups=GROUPS, per_token_loss=True)


@pytest.mark.slow  # one Ray launch of verl's Megatron engine
def test_packed_thd_forward_matches_the_hf_model(group):
    from megatron_checks import forward_matches_hf

    forward_matches_hf(group)  # verl's THD path (the regime requires it) through the CPU spec's packed attention


@pytest.mark.slow
def test_per_token_regime_streamed_step_equals_verls_update_in_the_regime(group):
    from megatron_checks import streamed_vs_verl

    out = streamed_vs_verl(group, GROUPS, control="probe_raw_per_token", key="raw")
    assert float(out["sync"].norm()) > 1e-4  # verl's step in the regime moved the weights
    assert out["gap"] < 1e-5, out["gap"]  # fp32 summation order, the floor of the other Megatron tests
    assert out["info"]["grad_norm"] == pytest.approx(out["info_sync"]["grad_norm"], rel=1e-5)
    info = out["info"]
    assert info["ops/bucket"] > 0 and info["ops/fold"] > 0 and info["ops/direct"] > 0  # every route ran
    # without the compensation each call keeps its own routed_num_tokens / dp factor: far from verl's update
    assert out["gap_raw"] > 1e-3 > 100 * out["gap"], out["gap_raw"]
