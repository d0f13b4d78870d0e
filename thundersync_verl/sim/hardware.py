"""Physical parameters -> the learner's per-token costs, weight-sync time and accumulator memory.

Why this module exists:
1. Calibration must come from meaningful quantities (FLOPs per token, GPU throughput, link
   bandwidth), not from per-mode fudge factors, so every cost the simulator uses can be
   traced back to a model size, a GPU and a cluster shape.
2. The learner is one lane: the data-parallel replicas act together on a chunk. A replica
   is tp * pp * cp GPUs; a chunk's time is bounded by its total work spread over the dp
   replicas and by its largest single sequence (one sequence is not split across replicas).
3. Training cost of a sequence of n tokens with activation recomputation is ~8 * P * n FLOPs
   (forward 2P, backward 4P, recompute 2P) plus causal attention ~8 * layers * hidden * n^2.
4. ThunderSync keeps fp32 accumulators: one batch buffer plus two per open GRPO group,
   4 * (2k + 1) * P / shards bytes per learner rank, where shards counts the ranks that split
   the parameters (tp * pp * cp, times dp when gradients are sharded as in FSDP/ZeRO-2). Bucket bytes
   and placement come from ``core/bucket_memory.py`` (``group_buckets``), as on the learner.
5. On one CPU machine the rollout engine's decoding and the learner's compute share the same
   cores (`SharedCores`): while both compute, each runs slower (processor sharing). On GPUs
   they run on separate devices and the resource is off (None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from thundersync_verl.core.bucket_memory import BucketMemory

TRAIN_FLOPS_PER_PARAM_TOKEN = 8.0  # forward 2 + backward 4 + activation recompute 2
ATTN_TRAIN_FLOPS_FACTOR = 8.0  # x layers x hidden x n^2 for a causal sequence, fwd+bwd+recompute
BYTES_FP32 = 4
BYTES_BF16 = 2
SPARSE_BYTES_PER_CHANGE = 6  # int32 index + bf16 value


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float  # trainable parameters
    layers: int
    hidden: int


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_gb: float
    host_mem_gb: float  # host memory per GPU available to the learner process


B200 = GpuSpec("B200", peak_flops=2.25e15, hbm_gb=180.0, host_mem_gb=500.0)
H100 = GpuSpec("H100", peak_flops=0.99e15, hbm_gb=80.0, host_mem_gb=250.0)


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs split between the learner and the rollout engines, and the learner's parallelism."""

    gpus: int
    learner_gpus: int
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context / sequence parallel (Ulysses or ring attention)
    grad_sharded_over_dp: bool = True  # FSDP / ZeRO-2 style gradient sharding

    def __post_init__(self) -> None:
        if not 0 < self.learner_gpus < self.gpus:
            raise ValueError(
                f"learner_gpus={self.learner_gpus} must be in 1..gpus-1={self.gpus - 1}: the simulated "
                "pipeline keeps separate learner and rollout GPUs; give both sides at least one GPU"
            )
        if self.learner_gpus % self.replica_gpus:
            raise ValueError(
                f"learner_gpus={self.learner_gpus} is not a multiple of tp*pp*cp={self.replica_gpus}: each "
                "data-parallel replica needs a full model copy; change the GPU split or the parallel sizes"
            )

    @property
    def rollout_gpus(self) -> int:
        return self.gpus - self.learner_gpus

    @property
    def replica_gpus(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.learner_gpus // self.replica_gpus

    @property
    def shards(self) -> int:
        return self.replica_gpus * (self.dp if self.grad_sharded_over_dp else 1)


@dataclass(frozen=True)
class LearnerCosts:
    """Lane-level primitives the simulator consumes (seconds)."""

    s_per_token: float  # training cost per token on ONE replica
    s_per_token_sq: float = 0.0  # causal-attention cost per position^2 on one replica
    chunk_overhead_s: float = 0.1  # host-side cost of each streamed chunk
    optimizer_s: float = 1.0  # barrier: fold, reduce, clip, optimizer step
    weight_sync_s: float = 10.0  # push weights to the rollout engines
    step_overhead_s: float = 0.0  # other fixed learner work per step
    dp: int = 1  # data-parallel replicas acting together on each chunk
    prefix_recompute: bool = False  # OPD: per-turn backward recomputes the prefix with grad
    # A separate forward over each landed trajectory (old log-probs), when the learner streams OPD turns;
    # otherwise that work is part of s_per_token and chunk_overhead_s. Seconds per token / per chunk.
    forward_s_per_token: float = 0.0
    forward_overhead_s: float = 0.0
    step_gap_s: float = 0.0  # driver time between a weight push and the next step (data loading, bookkeeping)
    s_per_row: float = 0.0  # host work per trained row (one micro-batch of one sequence: dispatch, loss, bookkeeping)

    def sequence_cost(self, lo, hi):
        """Seconds on one replica to train positions [lo, hi) of a sequence (arrays allowed)."""
        if self.prefix_recompute:
            lo = 0 * lo
        return self.s_per_row + self.s_per_token * (hi - lo) + self.s_per_token_sq * (hi * hi - lo * lo)


@dataclass(frozen=True)
class SharedCores:
    """Rollout decoding and learner compute on the same cores: how much slower each runs while both do.

    Processor sharing: `from_threads` gives the factors when C cores are shared fairly by the threads
    of the rollout engine (r) and of the learner (l): alone each runs at min(1, C / own threads) of its
    speed, together at min(1, C / (r + l)); a factor is the ratio. Tool calls and reward or teacher
    latencies are not compute here (they do not slow down, nor slow the others).
    """

    rollout_slowdown: float = 1.0  # decoding takes this factor longer while the learner computes
    learner_slowdown: float = 1.0  # learner compute takes this factor longer while the engine decodes

    def __post_init__(self) -> None:
        if self.rollout_slowdown < 1.0 or self.learner_slowdown < 1.0:
            raise ValueError(f"SharedCores slowdowns must be >= 1 (got {self.rollout_slowdown}, "
                             f"{self.learner_slowdown}): sharing cores never makes anything faster")

    @classmethod
    def from_threads(cls, cores: float, rollout_threads: float, learner_threads: float) -> "SharedCores":
        if min(cores, rollout_threads, learner_threads) <= 0:
            raise ValueError("cores and thread counts must be > 0")
        both = min(1.0, cores / (rollout_threads + learner_threads))
        return cls(min(1.0, cores / rollout_threads) / both, min(1.0, cores / learner_threads) / both)

    @property
    def active(self) -> bool:
        return self.rollout_slowdown > 1.0 or self.learner_slowdown > 1.0


def learner_costs_from_hardware(model: ModelSpec, gpu: GpuSpec, cluster: ClusterSpec, mfu: float, *,
                                chunk_overhead_s: float, optimizer_s: float, weight_sync_s: float,
                                step_overhead_s: float = 0.0, prefix_recompute: bool = False) -> LearnerCosts:
    """Per-token costs from FLOPs: one replica delivers peak_flops * mfu * replica_gpus."""
    if not 0.0 < mfu <= 1.0:
        raise ValueError(f"mfu={mfu} must be in (0, 1]: it is the achieved share of peak FLOP/s")
    replica_flops = gpu.peak_flops * mfu * cluster.replica_gpus
    return LearnerCosts(
        s_per_token=TRAIN_FLOPS_PER_PARAM_TOKEN * model.params / replica_flops,
        s_per_token_sq=ATTN_TRAIN_FLOPS_FACTOR * model.layers * model.hidden / replica_flops,
        chunk_overhead_s=chunk_overhead_s, optimizer_s=optimizer_s, weight_sync_s=weight_sync_s,
        step_overhead_s=step_overhead_s, dp=cluster.dp, prefix_recompute=prefix_recompute)


def weight_sync_seconds(model: ModelSpec, bandwidth_gb_s: float, fixed_s: float = 0.0,
                        changed_fraction: float | None = None) -> float:
    """Dense: all bf16 weights. Sparse: (int32 index, bf16 value) pairs for the changed ones."""
    if changed_fraction is None:
        payload = BYTES_BF16 * model.params
    else:
        if not 0.0 <= changed_fraction <= 1.0:
            raise ValueError(f"changed_fraction={changed_fraction} must be a share of weights in [0, 1]")
        payload = min(SPARSE_BYTES_PER_CHANGE * changed_fraction, BYTES_BF16) * model.params
    return fixed_s + payload / (bandwidth_gb_s * 1e9)


def rank_numel(model: ModelSpec, cluster: ClusterSpec) -> int:
    """Gradient values one learner rank holds: the size of one of its buckets, in values."""
    return int(-(-model.params // cluster.shards))


def group_buckets(model: ModelSpec, cluster: ClusterSpec, open_groups: int, bucket_device: str = "auto",
                  per_group: int = 2) -> BucketMemory:
    """Placement and bytes of ``per_group`` buckets per open group on a (GPU) learner rank (2: binary rewards;
    the trainer's budget reserves ``rollout.n``): ``core/bucket_memory.py``'s function, the learner pool's."""
    from thundersync_verl.core.bucket_memory import bucket_memory  # on call: importing the simulator pulls no torch

    return bucket_memory(rank_numel(model, cluster), bucket_device=bucket_device, accelerator=True,
                         buckets=per_group * int(open_groups))


def accumulator_bytes_per_rank(model: ModelSpec, cluster: ClusterSpec, open_groups: float) -> float:
    """fp32 accumulators: one batch buffer plus two per open GRPO group, per learner rank."""
    return (2 * open_groups + 1) * group_buckets(model, cluster, 0).bucket_bytes


def open_groups_within(model: ModelSpec, cluster: ClusterSpec, budget_bytes_per_rank: float) -> int:
    """Largest k whose accumulators fit the per-rank budget (-1 if not even the batch buffer fits)."""
    per_buffer = group_buckets(model, cluster, 0).bucket_bytes
    return max(-1, int((budget_bytes_per_rank / per_buffer - 1) // 2))


TRAIN_STATE_BYTES_PER_PARAM = 16  # bf16 weights + fp32 master + two Adam moments, fully sharded


def training_state_fits(model: ModelSpec, gpu: GpuSpec, cluster: ClusterSpec) -> bool:
    """Whether fully sharded weights + optimizer state fit the learner GPUs' memory (70% usable)."""
    return TRAIN_STATE_BYTES_PER_PARAM * model.params / cluster.learner_gpus <= 0.7 * gpu.hbm_gb * 1e9
