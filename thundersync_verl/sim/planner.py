"""Sizing advice: which mode, which granularity and how much accumulator memory to give.

Why this module exists:
1. The right streaming setting depends on the deployment: with a fast learner the tail of
   the rollout dominates and streaming gains little; with a slow learner the batch barrier
   wastes half the step. The planner simulates the candidates instead of guessing.
2. Memory is the constraint that differs most across clusters: each open GRPO group costs
   two fp32 buffers of 4 * P / shards bytes per learner rank. The budget caps open groups,
   and the planner picks the smallest cap that keeps the step time within 1% of unbounded. Where
   the buckets live (``--bucket-device``; host on GPUs by default) and what they cost is
   ``core/bucket_memory.py``'s one function, the learner's: the recommendation prints the
   ``thundersync.memory_budget_bytes`` / ``bucket_device`` that hold the plan's peak.
3. Off-policy modes may be faster but train on stale data; the planner reports that trade
   (speed vs staleness) explicitly instead of silently preferring either.
4. How many GPUs train and how many generate is a choice per mode, not a constant: a pipeline
   bound by its rollout tail wants rollout GPUs, one bound by the learner wants learner GPUs.
   `plan_split` searches the learner share on a ladder (whole replicas) for the lowest score
   the caller measures (a simulated step time), coarse to fine, as step time is close to
   unimodal in the split (too few learner GPUs: learner-bound; too many: rollout-bound).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from thundersync_verl.sim.sim_config import SimConfig
from thundersync_verl.sim.sim_engine import simulate
from thundersync_verl.sim.hardware import (TRAIN_STATE_BYTES_PER_PARAM, accumulator_bytes_per_rank, group_buckets,
                                           open_groups_within)
from thundersync_verl.sim.metrics import format_table
from thundersync_verl.sim.presets import Setting

if TYPE_CHECKING:  # the simulator imports no torch (core/bucket_memory.py is reached through sim/hardware.py on call)
    from thundersync_verl.core.bucket_memory import BucketMemory

BUDGET_LADDER = (1, 2, 4, 8, 16, 32, 64)
SPLIT_LADDER = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 7 / 8)  # learner share of the GPUs (point 4)
NEAR_BEST = 0.01  # a smaller budget / simpler granularity wins if within 1% of the best step time
OFF_POLICY_WORTH_IT = 0.10  # mention an off-policy mode when it is >10% faster


@dataclass
class Candidate:
    mode: str
    granularity: str
    budget_groups: int | None
    step_time_s: float
    staleness_max: int
    peak_open_groups: int
    accum_gb_per_rank: float
    learner_util: float


@dataclass
class Plan:
    mode: str
    granularity: str
    budget_groups: int | None
    budget_gb_per_rank: float
    step_time_s: float
    speedup_vs_sync: float
    reasons: list = field(default_factory=list)
    candidates: list = field(default_factory=list)
    buckets: BucketMemory | None = None  # the learner's group buckets at the plan's peak (core/bucket_memory.py)

    def render(self) -> str:
        rows = [[c.mode, c.granularity, "-" if c.budget_groups is None else c.budget_groups, c.step_time_s,
                 c.staleness_max, c.peak_open_groups, c.accum_gb_per_rank, f"{100 * c.learner_util:.0f}%"]
                for c in self.candidates]
        table = format_table(rows, ["mode", "granularity", "budget", "step_s", "stale_max", "open_grp",
                                    "accum_GB/rank", "learner_util"])
        budget = "unbounded" if self.budget_groups is None else f"{self.budget_groups} open groups"
        head = (f"Recommendation: mode={self.mode} granularity={self.granularity} budget={budget} "
                f"({self.budget_gb_per_rank:.1f} GB/rank), {self.step_time_s:,.1f} s/step, "
                f"{self.speedup_vs_sync:.2f}x over sync")
        return "\n".join([table, "", head, *self.bucket_lines(), "Why:"] + [f"  - {r}" for r in self.reasons])

    def bucket_lines(self) -> list[str]:
        """The learner settings that hold the plan's buckets (what the recipes write)."""
        b = self.buckets
        if b is None or not b.buckets:
            return []
        return [f"Buckets (rollout.n reserved per open group): {b.buckets} x {b.bucket_bytes:,} B = {b.peak_bytes:,} B per learner rank in {b.storage} memory"
                f" (host {b.host_bytes:,} B, device {b.device_bytes:,} B): thundersync.memory_budget_bytes="
                f"{b.peak_bytes} thundersync.bucket_device={b.storage}"]


def _run(setting: Setting, source, algo: str, steps: int, mode: str, gran=None, budget=None) -> Candidate:
    cfg = SimConfig(mode=mode, algo=algo, granularity=gran, steps=steps, rollout_slots=setting.rollout.slots,
                    budget_groups=budget, gpus=setting.cluster.gpus, bytes_per_buffer=setting.bytes_per_buffer)
    res = simulate(cfg, source, setting.costs)
    return Candidate(mode, res.granularity, budget, res.step_time_s, res.staleness_summary()["max"],
                     res.peak_open_groups, res.accum_peak_bytes_per_rank / 1e9, res.learner_util)


def bucket_room_bytes(setting: Setting, storage: str, host_gb: float, mem_fraction: float) -> float:
    """Bytes per learner rank the buckets may take where they live: a share of the host memory, or of the
    accelerator memory the fully sharded training state leaves (70% of HBM usable, as ``training_state_fits``)."""
    if storage == "host":
        return mem_fraction * host_gb * 1e9
    state = TRAIN_STATE_BYTES_PER_PARAM * setting.model.params / setting.cluster.learner_gpus
    return max(0.0, mem_fraction * (0.7 * setting.gpu.hbm_gb * 1e9 - state))


def plan(setting: Setting, source, algo: str = "grpo", steps: int = 24, host_mem_gb_per_rank: float | None = None,
         mem_fraction: float = 0.8, bucket_device: str = "auto") -> Plan:
    """Simulate the candidate settings for this deployment and pick one, with reasons."""
    host = host_mem_gb_per_rank if host_mem_gb_per_rank is not None else setting.gpu.host_mem_gb
    where = group_buckets(setting.model, setting.cluster, 0, bucket_device)  # the learner's own placement rule
    budget_bytes = bucket_room_bytes(setting, where.storage, host, mem_fraction)
    k_max = open_groups_within(setting.model, setting.cluster, budget_bytes)
    buf_gb = setting.bytes_per_buffer / 1e9
    room = f"{host:.0f} GB host memory" if where.storage == "host" else f"the {setting.gpu.hbm_gb:.0f} GB HBM left by training"
    reasons = [f"one fp32 buffer is 4*P/shards = {buf_gb:.1f} GB per learner rank "
               f"(P={setting.model.params:.3g}, shards={setting.cluster.shards}), buckets in {where.storage} memory; "
               f"{mem_fraction:.0%} of {room} per rank holds {max(k_max, 0)} open groups"]
    cands = [_run(setting, source, algo, steps, m) for m in ("sync", "async", "fully_async")]
    sync_s = cands[0].step_time_s
    if k_max < 0:
        reasons.append("even the batch accumulator does not fit: raise tp/pp/cp or shard gradients over dp, "
                       "or give the learner more host memory; falling back to sync")
        return Plan("sync", "batch", None, 0.0, sync_s, 1.0, reasons, cands)
    zero = _streaming_candidates(setting, source, algo, steps, k_max)
    cands += zero
    best = _pick(zero, reasons)
    budget_gb = accumulator_bytes_per_rank(setting.model, setting.cluster, best.peak_open_groups) / 1e9
    if best.step_time_s >= sync_s * (1 - NEAR_BEST):
        reasons.append("streaming does not beat sync here (the rollout tail dominates); sync is simpler")
        best = cands[0]
    off = min(cands[1:3], key=lambda c: c.step_time_s)
    gain = best.step_time_s / off.step_time_s - 1
    if gain > OFF_POLICY_WORTH_IT:
        reasons.append(f"{off.mode} would be {100 * gain:.0f}% faster per step but trains on data up to "
                       f"{off.staleness_max} policy versions old; {best.mode} keeps staleness 0")
    else:
        reasons.append(f"the off-policy modes are at most {100 * max(gain, 0):.0f}% faster, not worth their staleness "
                       f"(up to {off.staleness_max} versions)")
    # the trainer reserves rollout.n buckets per open group (any reward pattern), so the budget is priced that way
    buckets = group_buckets(setting.model, setting.cluster, max(best.peak_open_groups, 1), bucket_device,
                            per_group=setting.workload.group_size)
    return Plan(best.mode, best.granularity, best.budget_groups, budget_gb, best.step_time_s,
                sync_s / best.step_time_s, reasons, cands, buckets)


def _streaming_candidates(setting: Setting, source, algo: str, steps: int, k_max: int) -> list[Candidate]:
    if algo == "opd":
        grans = ("turn", "trajectory") if source.batch(0).has_turns else ("trajectory",)
        return [_run(setting, source, algo, steps, "thundersync", g) for g in grans]
    out = [_run(setting, source, algo, steps, "thundersync", "group")]
    free = _run(setting, source, algo, steps, "thundersync", "trajectory", None)
    if free.peak_open_groups <= k_max:
        out.append(free)
    for k in BUDGET_LADDER:
        if k > k_max or k >= free.peak_open_groups:
            break
        out.append(_run(setting, source, algo, steps, "thundersync", "trajectory", k))
    if k_max < free.peak_open_groups and k_max not in BUDGET_LADDER and k_max > 0:
        out.append(_run(setting, source, algo, steps, "thundersync", "trajectory", k_max))
    return out


def _pick(cands: list[Candidate], reasons: list) -> Candidate:
    """Fastest, then the simplest / smallest-memory candidate within NEAR_BEST of it."""
    fastest = min(cands, key=lambda c: c.step_time_s)
    near = [c for c in cands if c.step_time_s <= fastest.step_time_s * (1 + NEAR_BEST)]
    pick = min(near, key=lambda c: (c.peak_open_groups, c.granularity != "group", c.step_time_s))
    if pick is not fastest:
        reasons.append(f"{pick.granularity} granularity with {pick.peak_open_groups} open groups is within "
                       f"{100 * NEAR_BEST:.0f}% of the fastest setting ({fastest.step_time_s:,.1f} s) and needs less "
                       "memory / fewer chunks")
    else:
        reasons.append(f"{pick.granularity} granularity is the fastest zero-staleness setting")
    if pick.granularity == "group":
        reasons.append("group granularity needs no per-group buffers (one batch accumulator): completion times "
                       "within a group correlate, so waiting for the group costs little")
    return pick



@dataclass
class SplitChoice:
    learner_gpus: int
    score: float
    tried: dict  # learner GPUs -> score (inf where the deployment is refused, e.g. the model does not fit)


def split_candidates(gpus: int, replica: int, ladder=SPLIT_LADDER) -> list[int]:
    """Learner GPU counts on the ladder, rounded to whole replicas, leaving both sides GPUs."""
    out = {max(replica, round(f * gpus / replica) * replica) for f in ladder}
    return sorted(n for n in out if 0 < n < gpus)


def plan_split(score: Callable[[int], float], candidates: list[int]) -> SplitChoice:
    """The candidate learner GPU count with the lowest score (point 4): the quartiles first, then downhill.

    `score(learner_gpus)` may raise ValueError for a split the deployment refuses (scored inf).
    """
    if not candidates:
        raise ValueError("no learner/rollout split to choose from: the cluster has no GPU count that holds whole "
                         "learner replicas and leaves rollout GPUs; give more GPUs")
    tried: dict[int, float] = {}

    def at(i: int) -> float:
        n = candidates[i]
        if n not in tried:
            try:
                tried[n] = float(score(n))
            except ValueError:
                tried[n] = float("inf")
        return tried[n]

    m = len(candidates)
    best = min(sorted({m // 4, m // 2, (3 * m) // 4} & set(range(m))), key=at)
    while True:
        step = min((i for i in (best - 1, best + 1) if 0 <= i < m), key=at, default=best)
        if at(step) >= at(best):
            break
        best = step
    return SplitChoice(candidates[best], at(best), dict(sorted(tried.items())))
