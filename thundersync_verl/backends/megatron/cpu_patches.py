"""verl's Megatron engine on the CPU platform: the runtime patches, applied only on verl's ``cpu`` platform.

Why:
1. verl 0.9.1's ``MegatronEngine`` (megatron-core 0.16, the mbridge path) assumes CUDA and
   TransformerEngine. Each patch below removes one such assumption without changing what the
   engine computes; ``patches/README.md`` lists each with the upstream fix that would remove it.
2. They are applied from the CPU platform path (``verl_patches.apply_cpu_patches``) through
   post-import hooks, so a process that never imports Megatron pays nothing, and a GPU machine
   never runs any of them.
3. The patches (names as recorded in ``patch_hooks.APPLIED``):
   ``mcore_engines_on_cpu``  register verl's Megatron engines for device ``cpu``; every engine
                             entry point runs with the CUDA->CPU device mode (``cpu_device``)
   ``mcore_cuda_shims``      ``torch.cuda.current_device`` / ``synchronize`` get CPU meanings
   ``mcore_rng_on_cpu``      Megatron's CUDA RNG tracker keeps CPU generator states
   ``mcore_fp32_dtype``      ``megatron.dtype=float32`` accepted (verl asserts bf16/fp16): fp32
                             is what tight equivalence checks need
   ``mbridge_cpu_config``    fusions off, CPU initialisation, ``batch_p2p_comm=False`` (gloo pairs
                             a batched send/recv to one peer in the wrong order: wrong gradients)
   ``mbridge_local_spec``    the local layer spec (``cpu_spec``) instead of TransformerEngine's,
                             with sequence-parallel norms and the [b, 1, s, s] padded causal mask
   ``mbridge_local_names``   the local spec's ``input_layernorm`` / ``pre_mlp_layernorm`` names
                             mapped to the HF weights mbridge maps TransformerEngine's fused names to
                             (only where the bridge's own map does not know the name: an MoE layer's
                             ``pre_mlp_layernorm`` is its own module in both specs); the local MoE
                             experts (``SequentialMLP``: ``experts.local_experts.<i>.linear_fc1.weight``)
                             named as TransformerEngine's grouped experts (``experts.linear_fc1.weight<e>``,
                             e the global expert id under expert parallelism)
   ``mcore_moe_cpu_dispatch`` the MoE all-to-all dispatcher's device-to-host side stream is
                             ``cpu_device.CPU_STREAM`` (a CPU build cannot create a CUDA stream), and its
                             split sizes become numpy arrays on the CPU too: its ``maybe_move_tensor_to_cpu``
                             converts only CUDA tensors, and ``all_to_all_single`` takes no tensor of sizes
                             ("incompatible function arguments" with expert parallel > 1)
   ``mcore_moe_router_gemm`` megatron-core 0.16.1's router gating reads ``te_general_gemm``, which its
                             ``moe_utils`` defines only when TransformerEngine imports (NameError without
                             it): defined as None, so the router takes its own torch ``mm`` path
4. MoE on the CPU: ``moe_grouped_gemm`` and ``moe_permute_fusion`` are off (the grouped GEMM needs the
   ``grouped_gemm`` CUDA package or TransformerEngine, the fused permutation TransformerEngine): the experts
   run one by one (``SequentialMLP``), the same function.
"""

from __future__ import annotations

import torch

from thundersync_verl.backends.cpu.platform import cpu_platform_active
from thundersync_verl.backends.megatron import cpu_device
from thundersync_verl.backends.megatron.cpu_spec import local_layer_spec

ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
ENGINE_ENTRY_POINTS = ("__init__", "initialize", "forward_backward_batch", "optimizer_zero_grad", "optimizer_step",
                       "lr_scheduler_step", "to", "save_checkpoint", "load_checkpoint", "get_per_tensor_param")
CPU_TRANSFORMER_SETTINGS = {  # kernels with no CPU build, and the p2p mode gloo gets wrong
    "masked_softmax_fusion": False, "bias_activation_fusion": False, "bias_dropout_fusion": False,
    "gradient_accumulation_fusion": False, "apply_rope_fusion": False, "persist_layer_norm": False,
    "use_cpu_initialization": True, "batch_p2p_comm": False,
    "moe_grouped_gemm": False, "moe_permute_fusion": False,  # point 4: no grouped GEMM / fused permute on a CPU
}
# the local spec's separate norms, named as mbridge's TransformerEngine map knows them
LOCAL_TO_TE_NAMES = {".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
                     ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight"}


def _record(name: str) -> None:
    from thundersync_verl.verl_adapter.patch_hooks import APPLIED

    if name not in APPLIED:
        APPLIED.append(name)


def _once(owner, attr: str, make) -> bool:
    """Replace ``owner.attr`` by ``make(original)`` unless already done; True if replaced now."""
    original = getattr(owner, attr)
    if getattr(original, "_thundersync_patched", False):
        return False
    patched = make(original)
    patched._thundersync_patched = True
    patched.__wrapped__ = original
    setattr(owner, attr, patched)
    return True


# ----- engine registration and device mode ---------------------------------------------------
def _engines_on_cpu(module) -> None:
    from verl.workers.engine.base import EngineRegistry

    for model_type, cls in (("language_model", module.MegatronEngineWithLMHead),
                            ("value_model", module.MegatronEngineWithValueHead)):
        EngineRegistry._engines.setdefault(model_type, {}).setdefault("megatron", {}).setdefault("cpu", cls)
    for name in ENGINE_ENTRY_POINTS:
        _once(module.MegatronEngine, name, cpu_device.in_cpu_mode)
    _record("mcore_engines_on_cpu")


# ----- RNG tracker ---------------------------------------------------------------------------
def _rng_on_cpu(random_module) -> None:
    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def make_add(_original):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        return add

    for attr, fn in (("_get_cuda_rng_state", get_state), ("_set_cuda_rng_state", set_state)):
        _once(random_module, attr, lambda _original, fn=fn: fn)
    _once(random_module.CudaRNGStatesTracker, "add", make_add)
    _record("mcore_rng_on_cpu")


# ----- fp32 engine dtype ---------------------------------------------------------------------
def _fp32_dtype(config_module) -> None:
    def make(original):
        def __post_init__(self):
            wanted = self.dtype
            if wanted in ("float32", "fp32"):
                self.__dict__["dtype"] = "bfloat16"  # verl's check allows bf16/fp16 only; fp32 is restored below
            try:
                original(self)
            finally:
                self.__dict__["dtype"] = wanted

        return __post_init__

    _once(config_module.McoreEngineConfig, "__post_init__", make)
    _record("mcore_fp32_dtype")


# ----- mbridge: CPU settings, local spec, weight names ---------------------------------------
def _mbridge_on_cpu(llm_bridge_module) -> None:
    cls = llm_bridge_module.LLMBridge

    def make_config(original):
        def _build_base_config(self, *args, **kwargs):
            self.extra_args = {**getattr(self, "extra_args", {}), **CPU_TRANSFORMER_SETTINGS}
            return original(self, *args, **kwargs)

        return _build_base_config

    def make_spec(_original):
        def _get_transformer_layer_spec(self, vp_stage=None):
            self.has_vp_stage = True  # megatron-core 0.16 takes vp_stage; the provider passes it on
            return local_layer_spec(self.config, vp_stage=vp_stage)

        return _get_transformer_layer_spec

    def make_names(original):
        def _weight_name_mapping_mcore_to_hf(self, name):
            try:
                return original(self, name)
            except NotImplementedError:  # a local-spec name the bridge's map does not know
                for local, te in LOCAL_TO_TE_NAMES.items():
                    if name.endswith(local):
                        return original(self, name[: -len(local)] + te)
                raise

        return _weight_name_mapping_mcore_to_hf

    def make_global(original):
        def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep=True):
            names = original(self, model, consider_ep=consider_ep)
            ep_size, ep_rank = (self.mpu.ep_size, self.mpu.ep_rank) if consider_ep else (1, 0)
            per_rank = (self.config.num_moe_experts or 0) // max(ep_size, 1)
            return {k: grouped_expert_name(v, offset=per_rank * ep_rank) for k, v in names.items()}

        return _weight_name_mapping_mcore_local_to_global

    _once(cls, "_build_base_config", make_config)
    _record("mbridge_cpu_config")
    _once(cls, "_get_transformer_layer_spec", make_spec)
    _record("mbridge_local_spec")
    _once(llm_bridge_module.Bridge, "_weight_name_mapping_mcore_to_hf", make_names)
    _once(llm_bridge_module.Bridge, "_weight_name_mapping_mcore_local_to_global", make_global)
    _record("mbridge_local_names")


def grouped_expert_name(name: str, offset: int = 0) -> str:
    """``...mlp.experts.local_experts.<i>.linear_fc1.weight`` -> ``...mlp.experts.linear_fc1.weight<offset + i>``
    (the name TransformerEngine's grouped experts have, which mbridge maps); any other name unchanged."""
    head, sep, tail = name.partition(".mlp.experts.local_experts.")
    if not sep:
        return name
    index, _, rest = tail.partition(".")
    param, _, suffix = rest.rpartition(".")  # linear_fc1 / weight
    return f"{head}.mlp.experts.{param}.{suffix}{offset + int(index)}"


# ----- MoE: router gating and token dispatch --------------------------------------------------
def _moe_cpu_dispatch(dispatcher_module) -> None:
    dispatcher_module.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = cpu_device.CPU_STREAM  # set once, read by all

    def make(original):
        def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
            if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
                return tensor.numpy()  # what the CUDA path hands the all-to-all: sizes as a numpy array
            return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

        return maybe_move_tensor_to_cpu

    _once(dispatcher_module, "maybe_move_tensor_to_cpu", make)
    _record("mcore_moe_cpu_dispatch")


def _moe_router_gemm(moe_utils) -> None:
    if not hasattr(moe_utils, "te_general_gemm"):  # defined only in its TransformerEngine import branch
        moe_utils.te_general_gemm = None
    _record("mcore_moe_router_gemm")


def apply() -> None:
    """Install every patch (post-import hooks; no-op on any platform but ``cpu``, whatever CUDA shows)."""
    if not cpu_platform_active():
        return
    from thundersync_verl.verl_adapter.patch_hooks import when_imported

    if cpu_device.install_cuda_shims():
        _record("mcore_cuda_shims")
    when_imported("megatron.core.tensor_parallel.random", _rng_on_cpu)
    when_imported("verl.workers.config.engine", _fp32_dtype)
    when_imported("mbridge.core.llm_bridge", _mbridge_on_cpu)
    when_imported("megatron.core.transformer.moe.token_dispatcher", _moe_cpu_dispatch)
    when_imported("megatron.core.transformer.moe.moe_utils", _moe_router_gemm)
    when_imported(ENGINE_MODULE, _engines_on_cpu)
