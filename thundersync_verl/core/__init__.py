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

from thundersync_verl.core.accumulator import StreamingGradientAccumulator
from thundersync_verl.core.barrier import BarrierReport
from thundersync_verl.core.budget import MemoryBudget
from thundersync_verl.core.buffers import BufferPool, GradLayout
from thundersync_verl.core.config_validation import StreamingSettings, validate_streaming_config
from thundersync_verl.core.corrections import (
    check_sign_independent,
    double_sided_token_mask,
    ppo_clip_token_weights,
    ratio_and_gate,
    rollout_is_weights,
)
from thundersync_verl.core.errors import (
    AccumulatorBudgetError,
    StreamingConfigError,
    StreamingError,
    StreamingInputError,
    StreamingStateError,
)
from thundersync_verl.core.estimators import FunctionEstimator, GroupEstimator, GRPOEstimator, RLOOEstimator, estimator_from_verl
from thundersync_verl.core.gradients import GradientBuffers
from thundersync_verl.core.groups import ANY, NEG, POS
from thundersync_verl.core.ledger import BatchLedger
from thundersync_verl.core.normalizers import LOSS_AGG_MODES, BatchCounts, batch_scale, token_weight, token_weights
from thundersync_verl.core.objectives import (
    check_opd_turn_mode,
    entropy_from_logits,
    distillation_token_loss,
    kl_per_token,
    opd_token_advantages,
    opd_turn_loss,
    policy_surrogate,
)
from thundersync_verl.core.scheduling import ChunkPlan, ScheduleHint

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
