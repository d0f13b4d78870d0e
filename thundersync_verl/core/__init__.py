"""The exactness core: streamed gradients equal to verl's batch-synchronous update.

Why:
1. With one optimizer step per batch every PPO ratio is 1, so the batch gradient is linear in
   the advantages: g = c_batch * sum_i (-A_i) H_i. Each H_i can be backpropagated as soon as
   trajectory i finishes; only scalars wait (the group's advantages, the batch normaliser).
2. This package holds that math and nothing else: it imports torch and the standard library
   only (a test enforces it), so it runs and is tested on any CPU without verl or Ray.
3. Entry points: ``StreamingGradientAccumulator`` (a facade over ``BatchLedger``, the
   tensor-free bookkeeping and memory budget, and ``GradientBuffers``, the tensors),
   ``validate_streaming_config`` (refuses verl settings that break exactness), the
   estimators, normalisers, corrections and objectives it relies on. See README.md.
"""

_EXPORTS = {  # name -> the submodule that defines it (imported on first use: ``__getattr__`` below)
    "StreamingGradientAccumulator": "accumulator",
    "BarrierReport": "barrier",
    "MemoryBudget": "budget",
    "BufferPool": "buffers",
    "GradLayout": "buffers",
    "StreamingSettings": "config_validation",
    "validate_streaming_config": "config_validation",
    "check_sign_independent": "corrections",
    "double_sided_token_mask": "corrections",
    "ppo_clip_token_weights": "corrections",
    "ratio_and_gate": "corrections",
    "rollout_is_weights": "corrections",
    "AccumulatorBudgetError": "errors",
    "StreamingConfigError": "errors",
    "StreamingError": "errors",
    "StreamingInputError": "errors",
    "StreamingStateError": "errors",
    "FunctionEstimator": "estimators",
    "GroupEstimator": "estimators",
    "GRPOEstimator": "estimators",
    "RLOOEstimator": "estimators",
    "estimator_from_verl": "estimators",
    "GradientBuffers": "gradients",
    "ANY": "groups",
    "NEG": "groups",
    "POS": "groups",
    "BatchLedger": "ledger",
    "LOSS_AGG_MODES": "normalizers",
    "BatchCounts": "normalizers",
    "batch_scale": "normalizers",
    "token_weight": "normalizers",
    "token_weights": "normalizers",
    "check_opd_turn_mode": "objectives",
    "entropy_from_logits": "objectives",
    "distillation_token_loss": "objectives",
    "kl_per_token": "objectives",
    "opd_token_advantages": "objectives",
    "opd_turn_loss": "objectives",
    "policy_surrogate": "objectives",
    "ChunkPlan": "scheduling",
    "ScheduleHint": "scheduling",
}


def __getattr__(name: str):
    """``from thundersync_verl.core import X`` imports X's submodule only now (PEP 562): the framework-free users
    of one light submodule (the simulator and ``tail_policy``, ``errors``) do not pay for torch."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ANY",
    "NEG",
    "POS",
    "LOSS_AGG_MODES",
    "AccumulatorBudgetError",
    "BarrierReport",
    "BatchCounts",
    "BatchLedger",
    "BufferPool",
    "ChunkPlan",
    "FunctionEstimator",
    "GRPOEstimator",
    "GradLayout",
    "GradientBuffers",
    "GroupEstimator",
    "MemoryBudget",
    "RLOOEstimator",
    "ScheduleHint",
    "StreamingConfigError",
    "StreamingError",
    "StreamingGradientAccumulator",
    "StreamingInputError",
    "StreamingSettings",
    "StreamingStateError",
    "batch_scale",
    "check_opd_turn_mode",
    "check_sign_independent",
    "double_sided_token_mask",
    "entropy_from_logits",
    "estimator_from_verl",
    "distillation_token_loss",
    "kl_per_token",
    "opd_token_advantages",
    "opd_turn_loss",
    "policy_surrogate",
    "ppo_clip_token_weights",
    "ratio_and_gate",
    "rollout_is_weights",
    "token_weight",
    "token_weights",
    "validate_streaming_config",
]
