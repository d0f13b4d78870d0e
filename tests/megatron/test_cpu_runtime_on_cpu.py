"""The pieces of Megatron's CPU runtime (``backends/megatron``) and the learner choice, in one process.

No process group and no launch: what a multi-rank run needs is checked in ``test_megatron_*_on_cpu.py``.
The device mode is pushed for a thread's lifetime, so every check that enters it runs in its own thread.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

import verl  # noqa: F401  (the plugin installs the CPU patches, as in every verl process)
from thundersync_verl.backends.megatron import cpu_device
from thundersync_verl.backends.megatron.cpu_spec import TorchNorm, causal_padding_mask, packed_causal_mask
from thundersync_verl.core import StreamingConfigError


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_padded_causal_mask_blocks_the_future_and_the_padding():
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)  # [b, s], right padding
    mask = causal_padding_mask(valid)  # [b, 1, s, s], True = may not attend
    assert mask.shape == (2, 1, 4, 4)
    allowed = ~mask[:, 0]
    assert allowed[0, 2].tolist() == [True, True, True, False]  # token 2 sees 0..2
    assert allowed[0, 1].tolist() == [True, True, False, False]  # not the future
    assert allowed[1, 3].tolist() == [True, True, False, False]  # a padded query sees only real keys
    assert not allowed[:, :, 3][0].any() and not allowed[1, :, 2:].any()  # no one attends to padding


def test_packed_causal_mask_keeps_each_sequence_to_itself_and_its_past():
    mask = packed_causal_mask(torch.tensor([0, 3, 5]), total=7)  # two packed sequences, then 2 alignment tokens
    assert mask.shape == (1, 1, 7, 7)
    allowed = (~mask[0, 0]).int().tolist()
    assert allowed[2] == [1, 1, 1, 0, 0, 0, 0]  # the first sequence: its own past
    assert allowed[4] == [0, 0, 0, 1, 1, 0, 0]  # the second starts over: it never sees the first
    assert allowed[6] == [0, 0, 0, 0, 0, 1, 1]  # the tail is one more segment (no query left without a key)
    with pytest.raises(ValueError, match="cover 7 tokens"):
        packed_causal_mask(torch.tensor([0, 3, 7]), total=5)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_torch_norm_marks_its_weights_for_the_tensor_parallel_all_reduce(sequence_parallel):
    config = SimpleNamespace(normalization="RMSNorm", sequence_parallel=sequence_parallel)
    norm = TorchNorm(config, 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert all(p.sequence_parallel is sequence_parallel for p in norm.parameters())


def test_device_mode_maps_cuda_to_the_cpu_only_in_threads_that_entered_it():
    if torch.cuda.is_available():
        pytest.skip("the CPU runtime is not installed where torch sees an accelerator")
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()  # torch's own function outside the mode: no CUDA here

    def inside():
        cpu_device.ensure_active()
        a = torch.zeros(3, device="cuda")
        b = torch.ones(2, device=torch.cuda.current_device()).cuda().to("cuda:0")
        torch.cuda.synchronize()
        return a.device.type, b.device.type, torch.cuda.current_device()

    assert _in_thread(inside) == ("cpu", "cpu", 0)
    assert not cpu_device.is_active()  # this (the test's) thread never entered it


class _AllocatesOnCudaInBackward(torch.autograd.Function):
    """Like Megatron's sequence-parallel gathers: the backward allocates on ``current_device()``."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty(grad.shape, dtype=grad.dtype, device=torch.cuda.current_device())
        return out.copy_(grad * 2)


def test_backward_runs_inside_the_mode_too():
    if torch.cuda.is_available():
        pytest.skip("the CPU runtime is not installed where torch sees an accelerator")

    def run():
        cpu_device.ensure_active()
        x = torch.ones(3, requires_grad=True)
        torch.autograd.backward([_AllocatesOnCudaInBackward.apply(x).sum()])
        y = torch.ones(2, requires_grad=True)
        (_AllocatesOnCudaInBackward.apply(y) * 3).sum().backward()
        return x.grad.tolist(), y.grad.tolist()

    assert _in_thread(run) == ([2.0, 2.0, 2.0], [6.0, 6.0])


def test_type_string_says_cuda_only_to_megatrons_optimizer():
    code = "result = param.type()"

    def run():
        cpu_device.ensure_active()
        param = torch.zeros(2)
        seen = {}
        for module in ("megatron.core.optimizer.distrib_optimizer", "somebody.else"):
            scope = {"__name__": module, "param": param}
            exec(code, scope)
            seen[module] = scope["result"]
        return seen

    seen = _in_thread(run)
    assert seen == {"megatron.core.optimizer.distrib_optimizer": "torch.cuda.FloatTensor", "somebody.else": "torch.FloatTensor"}


def test_megatron_engine_config_accepts_float32_on_the_cpu_platform():
    from verl.workers.config import McoreEngineConfig

    assert McoreEngineConfig(dtype="float32").dtype == "float32"
    assert McoreEngineConfig(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(AssertionError):
        McoreEngineConfig(dtype="int8")  # verl's own check still refuses the rest


def test_local_spec_norm_names_map_to_the_hf_weights():
    from mbridge.models.qwen2 import Qwen2Bridge

    bridge = object.__new__(Qwen2Bridge)
    assert bridge._weight_name_mapping_mcore_to_hf("decoder.layers.3.input_layernorm.weight") == [
        "model.layers.3.input_layernorm.weight"]
    assert bridge._weight_name_mapping_mcore_to_hf("decoder.layers.0.pre_mlp_layernorm.weight") == [
        "model.layers.0.post_attention_layernorm.weight"]
    assert bridge._weight_name_mapping_mcore_to_hf("decoder.layers.1.mlp.linear_fc2.weight") == [
        "model.layers.1.mlp.down_proj.weight"]  # names that need no translation are unchanged


# ----- the learner choice and the Megatron refusals -------------------------------------------
def _worker(strategy: str, **engine):
    ddp = SimpleNamespace(overlap_grad_reduce=engine.pop("overlap_grad_reduce", False), use_distributed_optimizer=False)
    config = SimpleNamespace(strategy=strategy, virtual_pipeline_model_parallel_size=engine.pop("vpp", None),
                             use_megatron_fsdp=engine.pop("use_megatron_fsdp", False),
                             dynamic_context_parallel=engine.pop("dcp", False))
    tf_config = SimpleNamespace(calculate_per_token_loss=engine.pop("per_token", False),
                                num_moe_experts=engine.pop("moe", None), moe_aux_loss_coeff=engine.pop("aux", 0.0),
                                moe_z_loss_coeff=engine.pop("z_loss", None))
    eng = SimpleNamespace(engine_config=config, module=[SimpleNamespace(ddp_config=ddp)],
                          is_param_offload_enabled=engine.pop("param_offload", False), tf_config=tf_config)
    return SimpleNamespace(actor=SimpleNamespace(engine=eng, engine_config=config))


def test_the_learner_follows_verls_engine_key():
    from thundersync_verl.learner.engines import make_learner
    from thundersync_verl.learner.engines.fsdp import FSDPLearner
    from thundersync_verl.learner.engines.megatron import MegatronLearner

    assert isinstance(make_learner(_worker("fsdp2")), FSDPLearner)
    assert isinstance(make_learner(_worker("fsdp")), FSDPLearner)
    assert isinstance(make_learner(_worker("megatron")), MegatronLearner)
    with pytest.raises(StreamingConfigError, match="no streaming learner for actor engine 'veomni'"):
        make_learner(_worker("veomni"))


@pytest.mark.parametrize("setting, match", [
    ({"vpp": 2}, "virtual pipeline stages"),
    ({"param_offload": True}, "param_offload=false"),
    ({"overlap_grad_reduce": True}, "overlap_grad_reduce=false"),
    ({"use_megatron_fsdp": True}, "use_megatron_fsdp"),
    ({"per_token": True, "dcp": True}, "dynamic_context_parallel"),
    ({"moe": 8, "aux": 0.01}, r"moe_aux_loss_coeff=0.01"),
    ({"per_token": True, "moe": 8, "z_loss": 0.001}, r"moe_z_loss_coeff=0.001"),
])
def test_megatron_learner_refuses_what_it_cannot_stream_exactly(setting, match):
    from thundersync_verl.learner.engines.megatron import MegatronLearner

    MegatronLearner(_worker("megatron")).check()  # the plain layout streams
    with pytest.raises(StreamingConfigError, match=match) as info:
        MegatronLearner(_worker("megatron", **setting)).check()
    assert "\n  why: " in str(info.value) and "\n  fix: " in str(info.value)


@pytest.mark.parametrize("setting", [{"per_token": True}, {"moe": 8}, {"per_token": True, "moe": 8}])
def test_megatron_learner_streams_the_per_token_regime_and_moe_without_router_losses(setting):
    # Megatron's per-token-loss regime streams (the learner compensates it, learner/engines/megatron.py point 6);
    # an MoE model streams as long as no router aux / z loss is scaled by the schedule
    from thundersync_verl.learner.engines.megatron import MegatronLearner

    MegatronLearner(_worker("megatron", **setting)).check()
