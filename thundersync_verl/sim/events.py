"""The events every schedule is built from: where a batch's rollouts run, when its learner units become ready.

Why this module exists:
1. The schedules (engine.py on dedicated rollout engines, shared.py on shared cores,
   fully_async.py streaming) differ in WHEN things happen, not in what a batch's events
   are: a trajectory's slot and start (`place_rollouts`), when its reward or last teacher
   score lands (`landing_delay`, `reward_times`), and which learner units it yields and
   when each is ready (`lane_work`, under the run's `lane_policy`). They are defined once,
   here, so each schedule imports them instead of importing another schedule.
2. `Recorder` keeps one run's accounting (ledger, staleness, tokens, optional timeline)
   the same way for every schedule, and `one_step_off` is the async schedule itself, shared
   by dedicated engines (engine.py) and shared cores (shared.py), which differ only in how
   the two sides share the machine.
3. This module imports no schedule, so the schedules form no import cycle.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

import numpy as np

from thundersync_verl.sim.sim_config import SimConfig
from thundersync_verl.sim.hardware import LearnerCosts
from thundersync_verl.sim.lane import IDLE_BUDGET, IDLE_ROLLOUT, LanePolicy, LaneRun, LaneWork
from thundersync_verl.sim.metrics import Ledger, SimResult
from thundersync_verl.sim.workload import Batch


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
    # With no zero-length trajectory among them, the first `slots` take slots 0.. at t0 (the free list pops
    # them in that order); only the rest wait for a slot to free.
    first = slots if float(dur[:slots].min()) > 0 else 0
    start, slot = np.empty(n), np.empty(n, dtype=np.int64)
    start[:first], slot[:first] = float(t0), np.arange(first)
    free = list(zip((float(t0) + dur[:first]).tolist(), range(first))) + [(float(t0), s) for s in range(first, slots)]
    heapq.heapify(free)
    for i, d in enumerate(dur[first:].tolist(), start=first):
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
        # recomputed prefixes: ready turns of one trajectory in one chunk share a row (lane.py point 6)
        row, own = (traj, batch.turn_hi.astype(np.int64)) if costs.prefix_recompute else (None, None)
        if costs.forward_s_per_token or costs.forward_overhead_s:  # log-probs of each landed trajectory
            ready = np.concatenate([ready, land])
            cost = np.concatenate([cost, costs.forward_s_per_token * batch.seq_tokens])
            forward = np.concatenate([np.zeros(len(tokens), dtype=bool), np.ones(batch.size, dtype=bool)])
            tokens = np.concatenate([tokens, np.zeros(batch.size, dtype=np.int64)])
            if row is not None:  # a forward is a row of its own
                row = np.concatenate([row, -1 - np.arange(batch.size)])
                own = np.concatenate([own, np.zeros(batch.size, dtype=np.int64)])
            return LaneWork(ready, np.full(len(ready), -1, dtype=np.int64), np.zeros(0), cost, tokens,
                            forward, row=row, computed=own), computed
        return LaneWork(ready, np.full(len(ready), -1, dtype=np.int64), np.zeros(0), cost, tokens,
                        row=row, computed=own), computed
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


class Recorder:
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
        buffers = cfg.buffers_per_open_group * self.peak_open + 1 if cfg.algo == "grpo" else 1
        return SimResult(cfg.mode, cfg.algo, gran, np.asarray(starts), np.asarray(ends), cfg.warmup_steps,
                         self.ledger, self.staleness, self.peak_open, buffers * cfg.bytes_per_buffer, cfg.gpus,
                         self.tokens["generated"], self.tokens["trained"], self.tokens["compute"],
                         self.timeline, extra or {})


def lane_policy(cfg: SimConfig, costs: LearnerCosts, gran: str) -> LanePolicy:
    budget = cfg.budget_groups if (cfg.streams and gran == "trajectory") else None
    return LanePolicy(dp=costs.dp, chunk_overhead_s=costs.chunk_overhead_s, min_chunk=cfg.min_chunk,
                      max_chunk=cfg.max_chunk, budget_groups=budget, forward_overhead_s=costs.forward_overhead_s)


def one_step_off(cfg: SimConfig, source, costs: LearnerCosts, first_rollout, overlap) -> SimResult:
    """async: batch k+1 is generated on the weights before step k while the learner trains batch k.

    The schedule and its accounting; how the two sides share the machine is the caller's:
    ``first_rollout(batch)`` places batch 0 from t = 0 with the learner idle, and
    ``overlap(next_batch, t_roll, work, t_learn)`` runs batch k+1's rollouts from ``t_roll`` and step k's
    lane from ``t_learn`` -> (next placement, LaneRun, optimizer end, last rollout end).
    """
    rec = Recorder(cfg)
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
        count_tokens(rec, batch, run, computed)
        starts.append(s_prev)
        ends.append(t_end)
        s_prev, batch, place = t_end, nxt, nxt_place
    return rec.result(cfg, starts, ends)


def count_tokens(rec: Recorder, batch: Batch, run: LaneRun, computed: int) -> None:
    rec.tokens["generated"] += int(batch.seq_tokens.sum())
    rec.tokens["trained"] += int(run.tokens)
    rec.tokens["compute"] += computed if run.computed_tokens is None else run.computed_tokens  # lane.py point 6
