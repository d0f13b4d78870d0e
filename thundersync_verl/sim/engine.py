"""Discrete-event simulation of one RL pipeline mode over a sequence of steps.

Why this module exists:
1. The four pipelines differ only in WHEN the learner may train which trajectory and WHEN
   the rollout engines may start the next batch:
   - sync: all rollouts, all rewards, then the learner over the whole batch, then the
     optimizer and the weight push; the next batch starts on the new weights (staleness 0).
   - thundersync: same barrier, but each trajectory (GRPO) or turn (OPD) is trained as soon
     as its inputs are fixed (group granularity: when its group closes), under an open-group
     memory budget; one optimizer step after the last backward (staleness 0).
   - async (one-step off-policy): batch k+1 is generated on the old weights while the
     learner trains batch k; the weight push waits for both (staleness <= 1).
   - fully_async: see fully_async.py (streaming with a staleness gate, partial rollout).
2. A batch's trajectories are placed on rollout slots (all at once when slots suffice,
   otherwise earliest-free slot first); the learner is one lane (lane.py).
3. Batch k comes from the source by index only, so every mode trains the same data.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

import numpy as np

from .hardware import LearnerCosts, SharedCores
from .lane import IDLE_BUDGET, IDLE_ROLLOUT, LanePolicy, LaneRun, LaneWork, run_lane
from .metrics import Ledger, SimResult
from .workload import Batch

MODES = ("sync", "async", "fully_async", "thundersync")
ALGOS = ("grpo", "opd")
GRANULARITIES = ("turn", "trajectory", "group", "batch")


@dataclass(frozen=True)
class SimConfig:
    mode: str
    algo: str = "grpo"
    granularity: str | None = None  # thundersync only: trajectory (GRPO) / turn (OPD) by default
    steps: int = 8
    warmup_steps: int = 1
    rollout_slots: int = 256
    budget_groups: int | None = None  # thundersync: most GRPO groups holding buffers at once
    staleness_threshold: float = 1.0  # fully_async: extra batches the rollout may run ahead
    mini_batch: int | None = None  # fully_async: trajectories per learner chunk (default batch / 4)
    min_chunk: int | None = None  # lane: smallest chunk while more work can arrive (default dp)
    max_chunk: int | None = None
    gpus: int = 8  # learner + rollout GPUs, for GPU-hours
    bytes_per_buffer: float = 0.0  # fp32 accumulator bytes per learner rank (4 P / shards)
    record_timeline: bool = False
    shared_cores: SharedCores | None = None  # rollout and learner on the same cores (CPU); None on GPUs

    def resolved_granularity(self) -> str:
        if self.mode in ("sync", "async"):
            return "batch"
        if self.mode == "fully_async":
            return "mini_batch"
        return self.granularity or ("turn" if self.algo == "opd" else "trajectory")

    def validate(self, batch_size: int) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is unknown; the simulator models {MODES}")
        if self.algo not in ALGOS:
            raise ValueError(f"algo {self.algo!r} is unknown; the simulator models {ALGOS}")
        gran = self.resolved_granularity()
        if self.mode == "thundersync" and gran not in GRANULARITIES:
            raise ValueError(f"granularity {gran!r} is unknown; thundersync streams at {GRANULARITIES}")
        if self.algo == "grpo" and gran == "turn":
            raise ValueError("GRPO cannot stream per turn: a turn's advantage needs the trajectory's reward; "
                             "use granularity trajectory, group or batch")
        if self.steps <= self.warmup_steps:
            raise ValueError(f"steps={self.steps} must exceed warmup_steps={self.warmup_steps}: the "
                             "steady-state window starts after warm-up; run more steps")
        if self.mode in ("async", "fully_async") and self.warmup_steps < 1:
            raise ValueError(f"{self.mode} needs warmup_steps >= 1: its first step fills the pipeline and is "
                             "not representative of the steady state")
        if self.rollout_slots < 1 or batch_size < 1:
            raise ValueError("rollout_slots and the batch size must be >= 1")


@dataclass
class Placement:
    start: np.ndarray  # [N] wall start of each trajectory
    done: np.ndarray  # [N] wall end of its last turn (slot freed)
    slot: np.ndarray  # [N]


def place_rollouts(dur: np.ndarray, t0: float, slots: int) -> Placement:
    """All trajectories are available at t0; each takes the earliest free slot, in order."""
    n = len(dur)
    if n <= slots:
        start = np.full(n, float(t0))
        return Placement(start, start + dur, np.arange(n))
    free = [(float(t0), s) for s in range(slots)]
    start, slot = np.empty(n), np.empty(n, dtype=np.int64)
    for i, d in enumerate(dur.tolist()):
        t, s = heapq.heappop(free)
        start[i], slot[i] = t, s
        heapq.heappush(free, (t + d, s))
    return Placement(start, start + dur, slot)


def landing_delay(batch: Batch, algo: str) -> np.ndarray:
    """[N] slot end -> the trainer has the trajectory: a replayed landing, else the reward / last turn's score."""
    if batch.land_s is not None:
        return batch.land_s
    return batch.reward_s if algo == "grpo" else batch.last_score_s


def reward_times(batch: Batch, place: Placement, algo: str) -> np.ndarray:
    """[N] wall time each trajectory's final signal lands (reward, or teacher score of the last turn)."""
    return place.done + landing_delay(batch, algo)


def lane_work(batch: Batch, place: Placement, algo: str, gran: str, costs: LearnerCosts) -> tuple[LaneWork, int]:
    """Trainable units of one batch and when each becomes ready; also the compute token count."""
    land = reward_times(batch, place, algo)  # [N]
    close = np.full(batch.n_groups, -np.inf)
    np.maximum.at(close, batch.group, land)  # [G]
    no_group = np.full(batch.size, -1, dtype=np.int64)
    if algo == "opd" and gran == "turn":
        if not batch.has_turns:
            raise ValueError("OPD turn streaming needs per-turn data, but the workload was drawn at "
                             "detail='aggregate'; use detail='full' or granularity='trajectory'")
        traj = np.repeat(np.arange(batch.size), batch.n_turns)  # [M]
        ready = place.start[traj] + batch.turn_end_s + batch.turn_score_s  # [M]
        lo, hi = batch.turn_lo.astype(np.float64), batch.turn_hi.astype(np.float64)
        cost = costs.sequence_cost(lo, hi)  # [M]
        computed = int((hi - (0 if costs.prefix_recompute else lo)).sum())
        tokens = batch.turn_hi - batch.turn_lo
        if costs.forward_s_per_token or costs.forward_overhead_s:  # log-probs of each landed trajectory
            ready = np.concatenate([ready, land])
            cost = np.concatenate([cost, costs.forward_s_per_token * batch.seq_tokens])
            forward = np.concatenate([np.zeros(len(tokens), dtype=bool), np.ones(batch.size, dtype=bool)])
            tokens = np.concatenate([tokens, np.zeros(batch.size, dtype=np.int64)])
            return LaneWork(ready, np.full(len(ready), -1, dtype=np.int64), np.zeros(0), cost, tokens,
                            forward), computed
        return LaneWork(ready, np.full(len(ready), -1, dtype=np.int64), np.zeros(0), cost, tokens), computed
    seq = batch.seq_tokens.astype(np.float64)
    cost = costs.sequence_cost(0.0 * seq, seq)  # [N]
    if gran == "batch":
        ready = np.full(batch.size, land.max())
    elif gran == "group":
        ready = close[batch.group]
    else:
        ready = land
    group = batch.group if (algo == "grpo" and gran == "trajectory") else no_group
    work = LaneWork(ready, group, close if algo == "grpo" else np.zeros(0), cost, batch.seq_tokens)
    return work, int(batch.seq_tokens.sum())


class _Recorder:
    """Collects steady-state accounting and, optionally, the full timeline."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.ledger = Ledger(cfg.rollout_slots)
        self.timeline = {"rollout": [], "learner": [], "trained": []} if cfg.record_timeline else None
        self.staleness: Counter = Counter()
        self.peak_open = 0
        self.tokens = {"generated": 0, "trained": 0, "compute": 0}

    def learner_run(self, k: int, run: LaneRun, t_opt: float, t_sync: float, t_end: float, costs: LearnerCosts) -> None:
        self.peak_open = max(self.peak_open, run.peak_open_groups)
        if self.timeline is not None:
            tl = self.timeline["learner"]
            tl.extend((c[0], c[1], "compute", c[3]) for c in run.chunks)
            tl.extend((a, b, kind, 0) for a, b, kind in run.idle_spans)
            tl.append((t_opt - costs.optimizer_s - costs.step_overhead_s, t_opt, "optimizer", 0))
            tl.append((t_sync, t_end, "weight_sync", 0))
        if k < self.cfg.warmup_steps:
            return
        led = self.ledger
        led.add_learner("compute", run.compute_s)
        led.add_learner("chunk_overhead", run.overhead_s)
        led.add_learner("wait_rollout", run.idle[IDLE_ROLLOUT])
        led.add_learner("wait_budget", run.idle[IDLE_BUDGET])
        led.add_learner("optimizer", costs.optimizer_s)
        led.add_learner("step_overhead", costs.step_overhead_s + costs.step_gap_s)
        led.add_learner("weight_sync", costs.weight_sync_s)

    def rollout(self, k: int, batch_index: int, place: Placement, a: float, b: float) -> None:
        if self.timeline is not None:
            n = len(place.start)
            self.timeline["rollout"].extend(zip(place.slot.tolist(), place.start.tolist(), place.done.tolist(),
                                                [batch_index] * n, range(n)))
        if k >= self.cfg.warmup_steps:
            self.ledger.add_rollout_window(a, b, place.start, place.done)

    def trained(self, k: int, size: int, policy_version: int) -> None:
        """Batch k trained in step k (learner version k) from weights of `policy_version`."""
        self.staleness[k - policy_version] += size
        if self.timeline is not None:
            self.timeline["trained"].extend((k, i, k, policy_version) for i in range(size))

    def result(self, cfg: SimConfig, starts, ends, extra=None) -> SimResult:
        window = ends[-1] - (ends[cfg.warmup_steps - 1] if cfg.warmup_steps else 0.0)
        self.ledger.close_window(window)
        gran = cfg.resolved_granularity()
        buffers = 2 * self.peak_open + 1 if cfg.algo == "grpo" else 1
        return SimResult(cfg.mode, cfg.algo, gran, np.asarray(starts), np.asarray(ends), cfg.warmup_steps,
                         self.ledger, self.staleness, self.peak_open, buffers * cfg.bytes_per_buffer, cfg.gpus,
                         self.tokens["generated"], self.tokens["trained"], self.tokens["compute"],
                         self.timeline, extra or {})


def lane_policy(cfg: SimConfig, costs: LearnerCosts, gran: str) -> LanePolicy:
    budget = cfg.budget_groups if (cfg.mode == "thundersync" and gran == "trajectory") else None
    return LanePolicy(dp=costs.dp, chunk_overhead_s=costs.chunk_overhead_s, min_chunk=cfg.min_chunk,
                      max_chunk=cfg.max_chunk, budget_groups=budget, forward_overhead_s=costs.forward_overhead_s)


def simulate(cfg: SimConfig, source, costs: LearnerCosts) -> SimResult:
    """Run cfg.steps steps of cfg.mode on batches from `source` with learner `costs`."""
    cfg.validate(source.batch_size)
    if cfg.budget_groups is not None and cfg.budget_groups < 0:
        raise ValueError(f"budget_groups={cfg.budget_groups} must be >= 0 (0 = only closed groups, no buffers)")
    if cfg.mode == "fully_async":
        from .fully_async import simulate_fully_async

        return simulate_fully_async(cfg, source, costs)
    if cfg.shared_cores is not None and cfg.shared_cores.active:
        from .shared import simulate_shared

        return simulate_shared(cfg, source, costs)
    if cfg.mode == "async":
        return _one_step_off(cfg, source, costs)
    return _barrier(cfg, source, costs)


def _barrier(cfg: SimConfig, source, costs: LearnerCosts) -> SimResult:
    """sync and thundersync: rollout -> (streamed) learner -> optimizer -> weight push."""
    gran = cfg.resolved_granularity()
    policy = lane_policy(cfg, costs, gran)
    rec = _Recorder(cfg)
    starts, ends, bounds = [], [], []
    t = 0.0
    for k in range(cfg.steps):
        batch = source.batch(k)
        place = place_rollouts(batch.dur_s, t, cfg.rollout_slots)
        work, computed = lane_work(batch, place, cfg.algo, gran, costs)
        run = run_lane(work, policy, t, record=cfg.record_timeline)
        t_opt = run.finish + costs.step_overhead_s + costs.optimizer_s
        t_end = t_opt + costs.weight_sync_s
        rec.learner_run(k, run, t_opt, t_opt, t_end, costs)
        rec.rollout(k, k, place, t, t_end)
        rec.trained(k, batch.size, k)
        _count_tokens(rec, batch, run, computed)
        last = work.ready.max()
        tail = costs.chunk_overhead_s + work.cost[work.ready == last].max()
        bounds.append(last - t + tail + costs.step_overhead_s + costs.optimizer_s + costs.weight_sync_s)
        starts.append(t)
        ends.append(t_end)
        t = t_end + costs.step_gap_s
    return rec.result(cfg, starts, ends, {"step_lower_bound_s": np.asarray(bounds)})


def _one_step_off(cfg: SimConfig, source, costs: LearnerCosts) -> SimResult:
    """async on dedicated rollout engines: rollouts and learner run side by side without slowing each other."""
    policy = lane_policy(cfg, costs, "batch")

    def overlap(nxt: Batch, t_roll: float, work: LaneWork, t_learn: float):
        nxt_place = place_rollouts(nxt.dur_s, t_roll, cfg.rollout_slots)
        run = run_lane(work, policy, t_learn, record=cfg.record_timeline)
        t_opt = run.finish + costs.step_overhead_s + costs.optimizer_s
        return nxt_place, run, t_opt, nxt_place.done.max()

    return one_step_off(cfg, source, costs, lambda batch: place_rollouts(batch.dur_s, 0.0, cfg.rollout_slots), overlap)


def one_step_off(cfg: SimConfig, source, costs: LearnerCosts, first_rollout, overlap) -> SimResult:
    """async: batch k+1 is generated on the weights before step k while the learner trains batch k.

    The schedule and its accounting; how the two sides share the machine is the caller's:
    ``first_rollout(batch)`` places batch 0 from t = 0 with the learner idle, and
    ``overlap(next_batch, t_roll, work, t_learn)`` runs batch k+1's rollouts from ``t_roll`` and step k's
    lane from ``t_learn`` -> (next placement, LaneRun, optimizer end, last rollout end).
    """
    rec = _Recorder(cfg)
    batch = source.batch(0)
    place = first_rollout(batch)
    rec.rollout(0, 0, place, 0.0, 0.0)
    starts, ends = [], []
    s_prev = 0.0  # end of the previous weight push
    for k in range(cfg.steps):
        next_start = float(place.done.max()) if k == 0 else s_prev
        nxt = source.batch(k + 1)
        work, computed = lane_work(batch, place, cfg.algo, "batch", costs)
        nxt_place, run, t_opt, roll_end = overlap(nxt, next_start, work, s_prev + (costs.step_gap_s if k else 0.0))
        t_sync = max(t_opt, roll_end)  # the push needs idle rollout engines
        t_end = t_sync + costs.weight_sync_s
        rec.learner_run(k, run, t_opt, t_sync, t_end, costs)
        rec.rollout(k, k + 1, nxt_place, s_prev, t_end)
        rec.trained(k, batch.size, max(k - 1, 0))
        _count_tokens(rec, batch, run, computed)
        starts.append(s_prev)
        ends.append(t_end)
        s_prev, batch, place = t_end, nxt, nxt_place
    return rec.result(cfg, starts, ends)


def _count_tokens(rec: _Recorder, batch: Batch, run: LaneRun, computed: int) -> None:
    rec.tokens["generated"] += int(batch.seq_tokens.sum())
    rec.tokens["trained"] += int(run.tokens)
    rec.tokens["compute"] += computed
