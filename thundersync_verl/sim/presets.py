"""Calibrated settings: the published ThunderSyncRL run, and a scale-out family.

Why this module exists:
1. A simulator is only believable if its parameters are physical and sourced. Every value
   below is a token rate, a latency, a FLOP count or a distribution, tagged as published
   (a number from the ThunderSyncRL paper or the NeMo-RL port), vendor (a hardware data
   sheet) or assumed (chosen for a typical 30B agentic SWE run, with the reason).
2. No parameter depends on the mode: the same workload, rollout speed and learner costs
   produce Sync, Async, fully-async and ThunderSync step times; only the pipeline differs.
3. The published figures pin down two balances that the assumptions must respect:
   Sync spends 49.5% of 1313.6 s waiting for rewards (~650 s of rollout + reward), so the
   learner's work plus the barrier is the other ~660 s; the overlapped modes all land near
   690 s, i.e. learner work ~ rollout time. The rest is ordinary sizing arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from thundersync_verl.sim.sim_config import SimConfig
from thundersync_verl.sim.dists import lognormal, pareto
from thundersync_verl.sim.hardware import (B200, ClusterSpec, GpuSpec, LearnerCosts, ModelSpec, learner_costs_from_hardware,
                       TRAIN_STATE_BYTES_PER_PARAM, group_buckets, open_groups_within, training_state_fits, weight_sync_seconds)
from thundersync_verl.sim.workload import RolloutSpec, WorkloadSpec

PUBLISHED = "published"
VENDOR = "vendor"
ASSUMED = "assumed"
DERIVED = "derived"

PUBLISHED_STEP_S = {
    "grpo": {"sync_s": 1313.6, "thundersync_s": 687.7, "async_s": 695.0, "fully_async_s": 690.0},
    "opd": {"sync_s": 1330.3, "thundersync_s": 685.7},
}
PUBLISHED_SYNC_LEARNER_WAIT = 0.495


@dataclass(frozen=True)
class Param:
    name: str
    value: object
    unit: str
    source: str
    note: str


@dataclass(frozen=True)
class Setting:
    """Everything one simulated deployment needs."""

    name: str
    model: ModelSpec
    gpu: GpuSpec
    cluster: ClusterSpec
    workload: WorkloadSpec
    rollout: RolloutSpec
    costs: LearnerCosts
    mfu: float
    table: tuple = ()
    budget_groups: int | None = None  # thundersync open-group cap

    def sim_config(self, mode: str, algo: str = "grpo", steps: int = 24, **kw) -> SimConfig:
        """A SimConfig for this deployment (slots, GPUs, accumulator size, budget)."""
        kw.setdefault("budget_groups", self.budget_groups)
        return SimConfig(mode=mode, algo=algo, steps=steps, rollout_slots=self.rollout.slots,
                         gpus=self.cluster.gpus, bytes_per_buffer=self.bytes_per_buffer, **kw)

    @property
    def bytes_per_buffer(self) -> float:
        return float(group_buckets(self.model, self.cluster, 0).bucket_bytes)  # core/bucket_memory.py, as the learner


# ------------------------------------------------------------------ the paper run
PAPER_MODEL = ModelSpec("30B dense", params=30e9, layers=64, hidden=5120)
PAPER_CLUSTER = ClusterSpec(gpus=8, learner_gpus=4, tp=1, pp=1, cp=4, grad_sharded_over_dp=True)
PAPER_MFU = 0.39
PAPER_WEIGHT_SYNC_GBPS = 10.0
PAPER_WEIGHT_SYNC_FIXED_S = 2.0
PAPER_OPTIMIZER_S = 4.0
PAPER_CHUNK_OVERHEAD_S = 0.1
PAPER_STEPS = 600  # long enough to average the heavy tail (the published run is ~80 steps)
PAPER_BUDGET_GROUPS = 5  # 4(2k+1)P = 1.3-1.5 TB over 4 ranks at P = 30B gives k = 5

PAPER_WORKLOAD = WorkloadSpec(
    groups_per_step=32, group_size=8,
    turns=lognormal(30, 0.8), icc=0.72, max_turns=300, max_context=131_072,
    prompt_tokens=lognormal(2500, 0.3),
    gen_tokens=lognormal(110, 0.6), obs_tokens=lognormal(260, 1.0),
    tool_s=lognormal(0.75, 1.0), reward_s=lognormal(8.5, 0.5), detail="full")
PAPER_ROLLOUT = RolloutSpec(slots=256, decode_s_per_token=0.013, prefill_s_per_token=2e-5,
                            teacher_fixed_s=0.3, teacher_s_per_token=1e-5)


def paper_setting(**workload_overrides) -> Setting:
    """The ThunderSyncRL run: 8 B200 (4 learner + 4 rollout), 32 x 8 trajectories, ~30B, SWE agent."""
    workload = replace(PAPER_WORKLOAD, **workload_overrides)
    wsync = weight_sync_seconds(PAPER_MODEL, PAPER_WEIGHT_SYNC_GBPS, PAPER_WEIGHT_SYNC_FIXED_S)
    costs = learner_costs_from_hardware(PAPER_MODEL, B200, PAPER_CLUSTER, PAPER_MFU,
                                        chunk_overhead_s=PAPER_CHUNK_OVERHEAD_S, optimizer_s=PAPER_OPTIMIZER_S,
                                        weight_sync_s=wsync)
    return Setting("paper", PAPER_MODEL, B200, PAPER_CLUSTER, workload, PAPER_ROLLOUT, costs, PAPER_MFU,
                   _paper_table(workload, costs), PAPER_BUDGET_GROUPS)


def _paper_table(w: WorkloadSpec, c: LearnerCosts) -> tuple:
    r, m = PAPER_ROLLOUT, PAPER_MODEL
    rows = [
        Param("GPUs (learner + rollout)", "8 B200 (4 + 4)", "", PUBLISHED, "ThunderSyncRL setup"),
        Param("trajectories per step", f"{w.groups_per_step} x {w.group_size}", "", PUBLISHED, "32 prompts x 8"),
        Param("max turns / context", f"{w.max_turns} / {w.max_context}", "turns / tokens", PUBLISHED,
              "SWE-smith agent limits"),
        Param("model parameters", f"{m.params:.3g}", "", PUBLISHED, "~27-31B models, full fine-tuning"),
        Param("within-group correlation (ICC)", w.icc, "", PUBLISHED, "NeMo-RL port, completion times"),
        Param("host overhead per streamed chunk", c.chunk_overhead_s, "s", PUBLISHED, "NeMo-RL port"),
        Param("accumulator bytes per rank", "4(2k+1)P/shards", "B", PUBLISHED, "fp32 host buffers"),
        Param("open-group budget k", PAPER_BUDGET_GROUPS, "groups", DERIVED,
              "published 1.3-1.5 TB across 4 ranks = 4(2k+1)P at P=30B"),
        Param("GPU peak (dense bf16)", f"{B200.peak_flops:.3g}", "FLOP/s", VENDOR, "B200 data sheet"),
        Param("layers x hidden", f"{m.layers} x {m.hidden}", "", ASSUMED, "a typical 30B dense shape"),
        Param("learner parallelism", "1 replica: context-parallel 4, FSDP", "", ASSUMED,
              "131k-token sequences need sequence parallelism on 4 GPUs"),
        Param("learner MFU", PAPER_MFU, "", ASSUMED, "long-sequence full fine-tuning with recompute"),
        Param("training FLOPs per token", "8P + 8*layers*hidden*n", "FLOP", DERIVED,
              "fwd 2P + bwd 4P + recompute 2P, causal attention"),
        Param("learner cost per token", f"{c.s_per_token:.3g}", "s", DERIVED, "8P / (peak*MFU*4 GPUs)"),
        Param("learner cost per position^2", f"{c.s_per_token_sq:.3g}", "s", DERIVED, "attention term"),
        Param("optimizer + reduce + clip", c.optimizer_s, "s", ASSUMED, "host accumulators -> GPU, AdamW on shards"),
        Param("weight push (dense bf16)", f"{c.weight_sync_s:.1f}", "s", DERIVED,
              f"2P bytes at {PAPER_WEIGHT_SYNC_GBPS} GB/s effective + {PAPER_WEIGHT_SYNC_FIXED_S} s fixed (assumed)"),
        Param("rollout slots", r.slots, "sequences", ASSUMED, "the whole batch in flight, 64 per GPU"),
        Param("decode time per token per sequence", r.decode_s_per_token, "s", ASSUMED,
              "~77 tok/s per sequence, 64 sequences per B200"),
        Param("prefill time per new token", r.prefill_s_per_token, "s", ASSUMED,
              "prefix-cached prefill of tool output"),
        Param("turns per trajectory", w.turns.describe(), "turns", ASSUMED, "heavy tail, capped by max turns/context"),
        Param("prompt tokens", w.prompt_tokens.describe(), "tokens", ASSUMED, "issue text + repo context"),
        Param("generated tokens per turn", w.gen_tokens.describe(), "tokens", ASSUMED, "short tool-calling actions"),
        Param("tool output tokens per turn", w.obs_tokens.describe(), "tokens", ASSUMED, "file views, test logs"),
        Param("tool latency per turn", w.tool_s.describe(), "s", ASSUMED, "sandboxed shell commands"),
        Param("reward (verifier) latency", w.reward_s.describe(), "s", ASSUMED, "running the repo's tests"),
        Param("OPD teacher latency per turn", f"{r.teacher_fixed_s} + {r.teacher_s_per_token}/token", "s", ASSUMED,
              "teacher server scores each turn's new tokens"),
        Param("OPD per-turn backward", "keeps the prefix graph (no recompute)", "", ASSUMED,
              "the published system's; this project recomputes prefixes (simulate_opd_rows.py)"),
        Param("fully-async pipeline", "threshold 1, mini-batch 64, optimizer per mini-batch", "", ASSUMED,
              "verl fully_async style: one PPO update per mini-batch, weights pushed per 256"),
        Param("steps simulated", PAPER_STEPS, "steps", ASSUMED, "averages the heavy tail; the paper ran ~80"),
    ]
    return tuple(rows)


def param_table_rows(setting: Setting) -> list[list]:
    return [[p.name, p.value, p.unit, p.source, p.note] for p in setting.table]


# ------------------------------------------------------------------ scale-out family
SCALE_HOST_MEM_FRACTION = 0.8  # share of host memory per learner rank given to accumulators
SCALE_MAX_BATCH = 16_384  # trajectories per step stop growing here (64 per rollout GPU below it)
SCALE_SYNC_PARALLELISM = 8  # weight push bandwidth grows with nodes (one stream per node), up to 8x
SCALE_LARGE_DECODE_FACTOR = 1.6  # assumed slower decode per sequence for a 235B model on TP-8 engines
SCALE_MODELS = {
    "30B": ModelSpec("30B dense", params=30e9, layers=64, hidden=5120),
    "235B": ModelSpec("235B dense-equivalent", params=235e9, layers=94, hidden=12288),
}


def scale_setting(gpus: int, model_key: str, tail: str, mfu: float = PAPER_MFU, *, learner_gpus: int | None = None,
                  batch: int | None = None, slots: int | None = None) -> Setting:
    """A cluster of `gpus` B200 split half learner / half rollout, for a model and tail shape.

    The batch grows with the rollout fleet (64 sequences per rollout GPU, capped at 16k per
    step); the learner replica grows with the model (tensor x context parallel within a node).
    tail: "lognormal" (the paper's shape) or "pareto" (a heavier, power-law tail).
    Keyword overrides (the tail study, benchmarks/simulate_tail.py): `learner_gpus` moves the
    split (a multiple of the replica, tp x 4 GPUs once there are that many), `batch` sets the
    trajectories per step (a multiple of the group size) and `slots` the sequences the rollout
    engines hold at once (default: the batch, as above).
    """
    model = SCALE_MODELS[model_key]
    learner = gpus // 2 if learner_gpus is None else int(learner_gpus)
    tp = 1 if model.params < 100e9 else 8
    if not 0 < learner < gpus:
        raise ValueError(f"learner_gpus={learner} must be in 1..{gpus - 1}: both sides need GPUs")
    if learner % tp:
        raise ValueError(f"{model.name} needs tensor parallel {tp} but has only {learner} learner GPUs; "
                         "use a larger cluster for this model")
    cp = min(4, learner // tp)
    cluster = ClusterSpec(gpus=gpus, learner_gpus=learner, tp=tp, cp=cp, grad_sharded_over_dp=True)
    if not training_state_fits(model, B200, cluster):
        raise ValueError(f"{model.name} training state ({TRAIN_STATE_BYTES_PER_PARAM} B/param) does not fit "
                         f"{learner} learner GPUs; use a larger cluster for this model")
    size = PAPER_WORKLOAD.group_size
    n = min(64 * (gpus - learner), SCALE_MAX_BATCH) if batch is None else int(batch)
    if n < size or n % size:
        raise ValueError(f"batch={n} must be a positive multiple of the group size {size}")
    workload = replace(PAPER_WORKLOAD, groups_per_step=n // size, turns=scale_turns(tail),
                       detail="aggregate" if n > 512 else "full")  # per-turn draws only where cheap
    decode = PAPER_ROLLOUT.decode_s_per_token * (1.0 if model.params < 100e9 else SCALE_LARGE_DECODE_FACTOR)
    rollout = replace(PAPER_ROLLOUT, slots=n if slots is None else int(slots), decode_s_per_token=decode)
    streams = max(1, min(SCALE_SYNC_PARALLELISM, gpus // 8))
    wsync = weight_sync_seconds(model, PAPER_WEIGHT_SYNC_GBPS * streams, PAPER_WEIGHT_SYNC_FIXED_S)
    costs = learner_costs_from_hardware(model, B200, cluster, mfu, chunk_overhead_s=PAPER_CHUNK_OVERHEAD_S,
                                        optimizer_s=PAPER_OPTIMIZER_S, weight_sync_s=wsync)
    budget = open_groups_within(model, cluster, SCALE_HOST_MEM_FRACTION * B200.host_mem_gb * 1e9)
    return Setting(f"{gpus}gpu-{model_key}-{tail}", model, B200, cluster, workload, rollout, costs, mfu,
                   budget_groups=max(budget, 0))


def scale_turns(tail: str):
    """The paper's lognormal turn count, or a Pareto (alpha 1.6) with the same median."""
    base = PAPER_WORKLOAD.turns
    if tail == "lognormal":
        return base
    if tail == "pareto":
        return pareto(base.median / 2 ** (1 / 1.6), 1.6)
    raise ValueError(f"tail {tail!r} must be 'lognormal' or 'pareto'")
