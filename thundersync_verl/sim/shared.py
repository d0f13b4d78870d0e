"""Rollout and learner on the same cores: sync, ThunderSync and one-step-off async with processor sharing.

Why this module exists:
1. On one CPU machine the rollout engine's decoding and the learner's compute divide the same
   cores, so each runs slower while the other computes (`hardware.SharedCores`). Whether they
   overlap depends on the schedule, and the schedule depends on how fast each runs, so the two
   sides are simulated together, event by event, instead of one after the other (engine.py).
2. Two virtual clocks carry the work: decoding advances on a rollout clock that runs
   1 / rollout_slowdown as fast while the learner computes; learner chunks and the optimizer
   advance on a learner clock that runs 1 / learner_slowdown as fast while at least one
   sequence decodes. Tool calls, verifier and teacher latencies and weight pushes are wall
   time. A phase's end is fixed on its clock when it starts, so rate changes never reorder it.
3. The lane follows lane.py's rule (closed groups, open groups, new groups within the budget,
   `min_chunk`, `max_chunk`), decided at each event. With both slowdowns 1 the result equals
   engine.py's (a test checks it); engine.py keeps the fast path for GPUs.
"""

from __future__ import annotations

import heapq

import numpy as np

from thundersync_verl.sim.sim_config import SimConfig
from thundersync_verl.sim.events import Placement, Recorder, count_tokens, landing_delay, lane_policy, lane_work, one_step_off
from thundersync_verl.sim.hardware import LearnerCosts
from thundersync_verl.sim.lane import IDLE_BUDGET, IDLE_ROLLOUT, LaneRun, LaneWork, PendingUnits, chunk_seconds
from thundersync_verl.sim.workload import Batch


class _Clock:
    """Virtual time advancing at a piecewise-constant rate (work seconds per wall second)."""

    def __init__(self, t: float):
        self.t, self.v, self.rate = t, 0.0, 1.0

    def advance(self, t: float, rate: float) -> None:
        self.v += (t - self.t) * self.rate
        self.t, self.rate = t, rate

    def wall(self, v_end: float) -> float:
        return self.t + (v_end - self.v) / self.rate


class _Rollout:
    """One batch's trajectories on slots: decode phases on the rollout clock, tool phases on the wall."""

    def __init__(self, batch: Batch | None, t0: float, slots: int, algo: str):
        if batch is not None and not batch.has_turns:
            raise ValueError("shared cores need per-turn rollouts (decode vs tool time); draw the workload at "
                             "detail='full' or replay a trace")
        self.batch, self.algo, self.t0 = batch, algo, t0
        n = batch.size if batch is not None else 0
        self.start, self.done, self.slot = np.full(n, np.nan), np.full(n, np.nan), np.zeros(n, dtype=np.int64)
        self.free = [(t0, s) for s in range(min(slots, n))]
        heapq.heapify(self.free)
        self.next_traj, self.finished = 0, 0
        self.decode: list = []  # (rollout-clock end, traj, turn)
        self.tool: list = []  # (wall end, traj, turn)
        if n:
            self.land = landing_delay(batch, algo)

    @property
    def decoding(self) -> bool:
        return bool(self.decode)

    @property
    def all_done(self) -> bool:
        return self.finished == len(self.start)

    def start_ready(self, t: float, clock: _Clock) -> None:
        while self.next_traj < len(self.start) and self.free and self.free[0][0] <= t:
            _, s = heapq.heappop(self.free)
            i = self.next_traj
            self.next_traj += 1
            self.start[i], self.slot[i] = t, s
            self._turn(i, int(self.batch.turn_ptr[i]), clock)

    def _turn(self, i: int, m: int, clock: _Clock) -> None:
        heapq.heappush(self.decode, (clock.v + float(self.batch.turn_gen_s[m]), i, m))

    def next_time(self, clock: _Clock) -> float:
        t_dec = clock.wall(self.decode[0][0]) if self.decode else np.inf
        return min(t_dec, self.tool[0][0] if self.tool else np.inf)

    def pop(self, t: float, clock: _Clock, tol: float) -> list:
        """Phases ending by t; returns events ("turn", m) and ("landed", i) with their wall times."""
        events = []
        while self.decode and clock.wall(self.decode[0][0]) <= t + tol:
            _, i, m = heapq.heappop(self.decode)
            events.append((t, "turn", m))
            heapq.heappush(self.tool, (t + float(self.batch.turn_tool_s[m]), i, m))
        while self.tool and self.tool[0][0] <= t + tol:
            t_end, i, m = heapq.heappop(self.tool)
            if m + 1 < self.batch.turn_ptr[i + 1]:
                self._turn(i, m + 1, clock)
                continue
            self.done[i] = t_end
            self.finished += 1
            heapq.heappush(self.free, (t_end, int(self.slot[i])))
            events.append((t_end + float(self.land[i]), "landed", i))
        return events

    def placement(self) -> Placement:
        return Placement(self.start, self.done, self.slot)


class _Lane:
    """lane.py's chunking rule, fed one arrival at a time."""

    def __init__(self, work: LaneWork, policy):
        self.work, self.policy = work, policy
        n_groups = len(work.close)
        self.budget = policy.budget_groups if (policy.budget_groups is not None
                                               and policy.budget_groups < n_groups) else None
        self.pend = PendingUnits(n_groups)
        self.min_chunk = max(policy.min_chunk if policy.min_chunk is not None else policy.dp, 1)
        self.arrived = self.trained = self.closed = 0
        self.n, self.n_groups = work.size, n_groups
        self.fwd = work.forward if work.forward is not None else np.zeros(work.size, dtype=bool)

    def arrive(self, u: int) -> None:
        self.pend.add(u, int(self.work.group[u]))
        self.arrived += 1

    def close(self, g: int) -> None:
        self.pend.close(g)
        self.closed += 1

    def decide(self) -> tuple[list | None, str]:
        """A chunk to train now, or None and why the lane waits."""
        eligible = self.pend.eligible(self.budget, self.min_chunk)
        blocked = bool(self.pend.new_groups)
        more = self.arrived < self.n or (blocked and self.closed < self.n_groups)
        if eligible == 0 or (eligible < self.min_chunk and more):
            return None, IDLE_BUDGET if (eligible == 0 and blocked) else IDLE_ROLLOUT
        return self.pend.take(self.budget, self.policy.max_chunk), ""

    def chunk_work(self, chunk: list) -> tuple[float, float, int]:
        cost = self.work.cost[chunk]
        over, compute = chunk_seconds(self.policy, float(cost.sum()), float(cost.max()), bool(self.fwd[chunk].any()))
        return over, compute, int(self.work.tokens[chunk].sum())


class _Feed:
    """Turns this batch's rollout events into lane arrivals, as lane_work's ready times would."""

    def __init__(self, batch: Batch, algo: str, gran: str, work: LaneWork, lane: _Lane):
        self.batch, self.lane, self.gran = batch, lane, gran
        self.turns = algo == "opd" and gran == "turn"
        self.forward_base = len(batch.turn_lo) if self.turns and work.size > len(batch.turn_lo) else None
        self.closes = algo == "grpo" and gran == "trajectory"
        self.left = np.bincount(batch.group, minlength=batch.n_groups)
        self.landed = 0

    def turn_scored(self, m: int) -> None:
        if self.turns:
            self.lane.arrive(m)

    def landed_traj(self, i: int) -> None:
        self.landed += 1
        g = int(self.batch.group[i])
        self.left[g] -= 1
        if self.turns:
            if self.forward_base is not None:  # the trajectory's forward (old log-probs)
                self.lane.arrive(self.forward_base + i)
        elif self.gran == "batch":
            if self.landed == self.batch.size:
                for u in range(self.batch.size):
                    self.lane.arrive(u)
        elif self.gran == "group":
            if self.left[g] == 0:
                for u in np.flatnonzero(self.batch.group == g):
                    self.lane.arrive(int(u))
        else:
            self.lane.arrive(i)
            if self.closes and self.left[g] == 0:
                self.lane.close(g)


class _LearnerSide:
    """The learner's side of a cosimulation: its task (a chunk or the optimizer) on the learner clock, its waits."""

    def __init__(self, ln: _Lane, clock: _Clock, t_learn: float, record: bool):
        self.ln, self.clock, self.t_learn, self.record = ln, clock, t_learn, record
        self.run = LaneRun(start=t_learn, finish=t_learn)
        self.task = None  # (learner-clock end, kind, start, overhead share, chunk)
        self.opt_done = np.nan
        self.idle_since, self.idle_reason = t_learn, IDLE_ROLLOUT

    @property
    def optimized(self) -> bool:
        return not np.isnan(self.opt_done)

    def finish_task(self, t: float, tol: float) -> None:
        """Account the task that ends by t: a chunk's compute, overhead and tokens, or the optimizer's end."""
        if self.task is not None and self.clock.wall(self.task[0]) <= t + tol:
            _, kind, t0, share, chunk = self.task
            self.task = None
            if kind == "opt":
                self.opt_done = t
                return
            run = self.run
            tokens = self.ln.chunk_work(chunk)[2]
            run.chunks.append((t0, t, len(chunk), tokens))
            run.overhead_s += (t - t0) * share
            run.compute_s += (t - t0) * (1.0 - share)
            run.tokens += tokens
            self.ln.trained += len(chunk)
            self.idle_since = t

    def start_task(self, t: float, costs: LearnerCosts) -> None:
        """When idle: the optimizer once every unit is trained, else the lane's next chunk, else note why it waits."""
        if self.task is not None or self.optimized or t < self.t_learn:
            return
        ln, run = self.ln, self.run
        if ln.trained == ln.n:  # every unit trained: the step's fixed work and optimizer step
            run.finish = t
            self.task = (self.clock.v + costs.step_overhead_s + costs.optimizer_s, "opt", t, 0.0, None)
            _idle(run, self.idle_since, t, self.idle_reason, self.record)
            return
        chunk, reason = ln.decide()
        if chunk is not None:
            _idle(run, self.idle_since, t, self.idle_reason, self.record)
            run.peak_open_groups = max(run.peak_open_groups, ln.pend.open_count)
            over, compute, _ = ln.chunk_work(chunk)
            share = over / (over + compute) if over + compute else 0.0
            self.task = (self.clock.v + over + compute, "chunk", t, share, chunk)
        elif reason != self.idle_reason:
            _idle(run, self.idle_since, t, self.idle_reason, self.record)
            self.idle_since, self.idle_reason = t, reason

    def next_time(self) -> float:
        return self.clock.wall(self.task[0]) if self.task is not None else np.inf


def cosimulate(cfg: SimConfig, costs: LearnerCosts, rollout: Batch | None, t_roll: float, lane: LaneWork,
               fixed: bool, t_learn: float, policy, gran: str, record: bool = False
               ) -> tuple[Placement | None, LaneRun, float, float]:
    """Roll `rollout` out from t_roll while the learner trains `lane` from t_learn, then the optimizer.

    fixed: the lane's ready/close times are known (async trains the previous batch); otherwise they
    come from this rollout's events (the lane is this batch's). Returns the placement, the lane run,
    the optimizer's end and the rollout's end.
    """
    slow = cfg.shared_cores
    roll = _Rollout(rollout, t_roll, cfg.rollout_slots, cfg.algo)
    ln = _Lane(lane, policy)
    t = min(t_roll, t_learn)
    rclock = _Clock(t)
    learner = _LearnerSide(ln, _Clock(t), t_learn, record)
    arrivals: list = []  # (wall time, kind, index): 0 unit ready, 1 group closed, 2 turn scored, 3 trajectory landed
    feed = None
    if fixed:
        arrivals = [(float(r), 0, int(u)) for u, r in enumerate(lane.ready)]
        arrivals += [(float(c), 1, int(g)) for g, c in enumerate(lane.close)]
        heapq.heapify(arrivals)
    else:
        feed = _Feed(rollout, cfg.algo, gran, lane, ln)
    handle = {0: ln.arrive, 1: ln.close, **({2: feed.turn_scored, 3: feed.landed_traj} if feed else {})}
    while True:
        tol = 1e-12 * max(1.0, abs(t))
        for t_ev, kind, idx in roll.pop(t, rclock, tol) if rollout is not None else []:
            if feed is not None and kind == "turn":
                heapq.heappush(arrivals, (t_ev + float(rollout.turn_score_s[idx]), 2, int(idx)))
            elif feed is not None:
                heapq.heappush(arrivals, (t_ev, 3, int(idx)))
        while arrivals and arrivals[0][0] <= t + tol:
            _, kind, idx = heapq.heappop(arrivals)
            handle[kind](idx)
        learner.finish_task(t, tol)
        if rollout is not None:
            roll.start_ready(t, rclock)
        learner.start_task(t, costs)
        if learner.optimized and (rollout is None or roll.all_done):
            break
        # who computes decides both clocks' rates until the next event
        lclock = learner.clock
        rclock.advance(t, 1.0 / slow.rollout_slowdown if learner.task is not None else 1.0)
        lclock.advance(t, 1.0 / slow.learner_slowdown if roll.decoding else 1.0)
        waiting = rollout is not None and roll.free and roll.next_traj < len(roll.start) and roll.free[0][0] > t
        t_next = min(roll.next_time(rclock) if rollout is not None else np.inf,
                     arrivals[0][0] if arrivals else np.inf,
                     learner.next_time(),
                     t_learn if t < t_learn else np.inf,
                     roll.free[0][0] if waiting else np.inf)
        if t_next == np.inf:
            raise RuntimeError("shared-cores simulation stalled with work left and no future event; this is a bug")
        rclock.advance(t_next, rclock.rate)
        lclock.advance(t_next, lclock.rate)
        t = t_next
    learner.run.units = ln.trained
    place = roll.placement() if rollout is not None else None
    t_roll_end = float(np.max(roll.done)) if rollout is not None and roll.done.size else t_roll
    return place, learner.run, float(learner.opt_done), t_roll_end


def _idle(run: LaneRun, a: float, b: float, reason: str, record: bool) -> None:
    if b > a:
        run.idle[reason] += b - a
        if record:
            run.idle_spans.append((a, b, reason))


def simulate_shared(cfg: SimConfig, source, costs: LearnerCosts):
    """sync / thundersync / async with rollout and learner sharing cores (engine.simulate dispatches here)."""
    gran = cfg.resolved_granularity()
    policy = lane_policy(cfg, costs, gran)
    if cfg.mode == "async":
        empty = LaneWork(np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0),
                         np.zeros(0, dtype=np.int64))

        def first_rollout(batch: Batch) -> Placement:
            idle = LearnerCosts(s_per_token=0.0, optimizer_s=0.0)
            return cosimulate(cfg, idle, batch, 0.0, empty, True, 0.0, policy, "batch")[0]

        def overlap(nxt: Batch, t_roll: float, work: LaneWork, t_learn: float):
            return cosimulate(cfg, costs, nxt, t_roll, work, True, t_learn, policy, "batch", record=cfg.record_timeline)

        return one_step_off(cfg, source, costs, first_rollout, overlap)
    rec = Recorder(cfg)
    starts, ends = [], []
    t = 0.0
    for k in range(cfg.steps):
        batch = source.batch(k)
        # the units and their costs, as events.lane_work builds them (ready times come from events here)
        dummy = Placement(np.zeros(batch.size), np.zeros(batch.size), np.zeros(batch.size, dtype=np.int64))
        work, computed = lane_work(batch, dummy, cfg.algo, gran, costs)
        place, run, t_opt, _ = cosimulate(cfg, costs, batch, t, work, False, t, policy, gran,
                                          record=cfg.record_timeline)
        t_end = t_opt + costs.weight_sync_s
        rec.learner_run(k, run, t_opt, t_opt, t_end, costs)
        rec.rollout(k, k, place, t, t_end)
        rec.trained(k, batch.size, k)
        count_tokens(rec, batch, run, computed)
        starts.append(t)
        ends.append(t_end)
        t = t_end + costs.step_gap_s
    return rec.result(cfg, starts, ends)
