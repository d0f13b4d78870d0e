"""Fully asynchronous streaming: rollouts never wait for a batch barrier, only for a staleness gate.

Why this module exists:
1. In a fully asynchronous pipeline every rollout slot is refilled as soon as it frees, the
   learner trains mini-batches as soon as enough complete groups (GRPO needs the whole group
   for its advantages) or trajectories (OPD) are ready, takes one optimizer step per
   mini-batch (as an off-policy PPO trainer does), and pushes weights after each batch's
   worth of trajectories. Weight versions count pushes.
2. Partial rollout: a weight push pauses every in-flight trajectory for its duration, and the
   trajectory resumes on the new weights. This is modelled with a rollout clock that stops
   during pushes: a trajectory's end on the rollout clock is fixed at its start, and wall
   time = rollout time + pauses so far, so pauses never reorder the event heap.
3. Staleness is bounded by a gate: a trajectory may start only while the number started is
   below (rollout weight version + 1 + staleness_threshold) x batch size. A trajectory's
   staleness is the learner version it updates minus the version it started on.
4. Accounting streams (O(in-flight) memory), so long runs at thousands of slots fit in RAM.
5. Shared cores (a CPU run, `hardware.SharedCores`): a trajectory is then its turns, decode
   phases on a decode clock (stopped during pushes, 1 / rollout_slowdown as fast while the
   learner computes) and tool phases on the pause clock; learner work advances 1 /
   learner_slowdown as fast while any sequence decodes.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque

import numpy as np

from thundersync_verl.sim.sim_config import SimConfig
from thundersync_verl.sim.events import landing_delay
from thundersync_verl.sim.hardware import LearnerCosts
from thundersync_verl.sim.metrics import Ledger, SimResult, clip_sum


class _Stream:
    """The endless sequence of trajectories: batch b, trajectory i -> global id b * N + i.

    Each batch is turned into plain lists once (numpy scalar indexing is slow per event).
    """

    def __init__(self, source, algo: str):
        self.source, self.n, self.algo = source, source.batch_size, algo
        self.batches: dict[int, tuple] = {}
        self.turns: dict[int, tuple] = {}  # batch -> (turn offsets, decode s, tool s) lists (shared cores)
        self.trained: dict[int, int] = {}

    def get(self, tid: int) -> tuple:
        """(dur, lag, seq, global group id, group size) lists of tid's batch, and its index."""
        b = tid // self.n
        if b not in self.batches:
            batch = self.source.batch(b)
            sizes = np.bincount(batch.group, minlength=batch.n_groups)
            lag = landing_delay(batch, self.algo)
            self.batches[b] = (batch.dur_s.tolist(), lag.tolist(), batch.seq_tokens.tolist(),
                               (batch.group + b * batch.n_groups).tolist(), sizes[batch.group].tolist())
            if batch.has_turns:
                self.turns[b] = (batch.turn_ptr.tolist(), batch.turn_gen_s.tolist(), batch.turn_tool_s.tolist())
        return self.batches[b], tid % self.n

    def turn(self, tid: int, j: int) -> tuple[int, float, float]:
        """(turns of tid, decode s, tool s) of its turn j (shared cores)."""
        b, i = tid // self.n, tid % self.n
        if b not in self.turns:
            raise ValueError("shared cores need per-turn rollouts (decode vs tool time); draw the workload at "
                             "detail='full' or replay a trace")
        ptr, gen, tool = self.turns[b]
        m = ptr[i] + j
        return ptr[i + 1] - ptr[i], gen[m], tool[m]

    def release(self, tid: int) -> None:
        """Count one trained trajectory; forget a batch once all of it is trained."""
        b = tid // self.n
        self.trained[b] = self.trained.get(b, 0) + 1
        if self.trained[b] == self.n:
            del self.batches[b], self.trained[b]
            self.turns.pop(b, None)


class _RolloutMeter:
    """Streaming slot accounting inside the window [a, end); a is known after warm-up."""

    def __init__(self):
        self.a: float | None = None
        self.occupied = self.paused = self.no_work = 0.0
        self.in_flight, self.zero_since = 0, 0.0

    def _clip(self, t0: float, t1: float) -> float:
        return 0.0 if self.a is None else max(t1 - max(t0, self.a), 0.0)

    def start(self, t: float) -> None:
        if self.in_flight == 0:
            self.no_work += self._clip(self.zero_since, t)
        self.in_flight += 1

    def done(self, t0: float, t1: float) -> None:
        self.occupied += self._clip(t0, t1)
        self.in_flight -= 1
        if self.in_flight == 0:
            self.zero_since = t1

    def pause(self, t0: float, t1: float, count: int) -> None:
        self.paused += self._clip(t0, t1) * count


class _State:
    def __init__(self, cfg: SimConfig, source, costs: LearnerCosts):
        self.cfg, self.costs, self.stream = cfg, costs, _Stream(source, cfg.algo)
        self.n = source.batch_size
        mb = cfg.mini_batch or max(source.group_size, self.n // 4)
        self.mini_batch = max(1, min(mb, self.n))
        self.slots_free = list(range(cfg.rollout_slots))
        self.roll_heap: list = []  # (rollout-clock end, tid)
        self.land_heap: list = []  # (wall land, tid)
        self.pause_acc = 0.0
        self.started = self.rollout_version = self.version = 0
        self.retired = 0  # trajectories rejected before training (sim/sim_pace.py): regenerated, so out of the gate
        self.live: dict[int, tuple[float, int]] = {}  # in-flight tid -> (wall start, slot)
        self.version_of: dict[int, int] = {}  # tid -> weight version it started on
        self.group_left: dict[int, int] = {}
        self.group_members: dict[int, list[int]] = {}
        self.ready: deque = deque()  # blocks of trajectory ids (a whole group, or one OPD trajectory)
        self.n_ready = self.consumed = self.tokens = self.trained = 0
        self.meter = _RolloutMeter()
        self.learner_log: list = []  # (t0, t1, kind, tokens, chunk overhead inside it)
        self.learner_phase: str | None = None
        self.learner_until, self.learner_idle_since = np.inf, 0.0
        self.chunk_ids: list[int] = []
        self.staleness: Counter = Counter()
        self.step_ends: list[float] = []
        self.timeline = {"rollout": [], "learner": [], "trained": []} if cfg.record_timeline else None
        shared = cfg.shared_cores
        self.shared = shared if (shared is not None and shared.active) else None
        self.dec_heap: list = []  # shared cores: (decode-clock end, tid, turn)
        self.turn_of: dict[int, int] = {}
        self.rv = self.lv = self.clock_t = 0.0  # decode clock, learner clock, when both were last advanced
        self.rrate = self.lrate = 1.0
        self.learner_end_v = np.inf  # learner-clock end of the current chunk / optimizer step
        self.phase_log: tuple = ()  # (start, kind, tokens, chunk overhead, work) of the running compute

    # ------------------------------------------------------------------ rollout
    def try_start(self, t: float) -> None:
        limit = (self.rollout_version + 1 + self.cfg.staleness_threshold) * self.n
        while self.slots_free and self.started - self.retired < limit and self.learner_phase != "sync":
            tid = self.started
            (dur, _lag, _seq, gids, sizes), i = self.stream.get(tid)
            slot = self.slots_free.pop()
            if self.shared is None:
                heapq.heappush(self.roll_heap, (t - self.pause_acc + dur[i], tid))
            else:
                self.turn_of[tid] = 0
                heapq.heappush(self.dec_heap, (self.rv + self.stream.turn(tid, 0)[1], tid))
            self.live[tid] = (t, slot)
            self.version_of[tid] = self.rollout_version
            gid, size = gids[i], sizes[i]
            if gid not in self.group_left:  # a group is ready only when ALL its members landed
                self.group_left[gid] = size
            self.group_members.setdefault(gid, []).append(tid)
            self.meter.start(t)
            self.started += 1

    def on_done(self, t: float, tid: int) -> None:
        (_dur, lag, _seq, _gids, _sizes), i = self.stream.get(tid)
        t0, slot = self.live.pop(tid)
        self.meter.done(t0, t)
        if self.timeline is not None:
            self.timeline["rollout"].append((slot, t0, t, tid // self.n, tid % self.n))
        self.slots_free.append(slot)
        heapq.heappush(self.land_heap, (t + lag[i], tid))
        self.try_start(t)

    def on_land(self, t: float, tid: int) -> None:
        (_dur, _lag, _seq, gids, _sizes), i = self.stream.get(tid)
        gid = gids[i]
        self.group_left[gid] -= 1
        if self.cfg.algo == "opd":
            self.ready.append([tid])
            self.n_ready += 1
        if self.group_left[gid] == 0:
            del self.group_left[gid]
            members = self.group_members.pop(gid)
            if self.cfg.algo == "grpo":
                self.ready.append(members)
                self.n_ready += len(members)
        self.try_learn(t)

    # ------------------------------------------------------------------ learner
    def try_learn(self, t: float) -> None:
        need = min(self.mini_batch, self.n - self.consumed)
        if self.learner_phase is not None or self.n_ready < need:
            return
        chunk: list[int] = []
        while self.ready and len(chunk) < need:
            chunk.extend(self.ready.popleft())
        self.n_ready -= len(chunk)
        seq = np.asarray([float(self._seq(tid)) for tid in chunk])  # [C]
        cost = self.costs.sequence_cost(0.0 * seq, seq)  # [C]
        over = self.costs.chunk_overhead_s
        dur = over + max(cost.sum() / self.costs.dp, cost.max())
        self._log(self.learner_idle_since, t, "wait_rollout")
        self.chunk_ids = chunk
        self._busy(t, dur, "chunk")
        self.phase_log = (t, "compute", int(seq.sum()), over, dur)

    def on_learner(self, t: float) -> None:
        """chunk -> optimizer step (one per mini-batch) -> weight push after a batch's worth."""
        costs = self.costs
        if self.learner_phase in ("chunk", "optimizer"):  # book the finished compute (its end moved if shared)
            t0, kind, tokens, over, dur = self.phase_log
            self._log(t0, t, kind, tokens, over if self.shared is None else over * (t - t0) / dur)
        if self.learner_phase == "chunk":
            for tid in self.chunk_ids:
                self._train(tid)
            self.consumed += len(self.chunk_ids)
            opt = costs.step_overhead_s * len(self.chunk_ids) / self.n + costs.optimizer_s
            self._busy(t, opt, "optimizer")
            self.phase_log = (t, "optimizer", 0, 0.0, opt)
        elif self.learner_phase == "optimizer" and self.consumed < self.n:
            self._idle(t)
        elif self.learner_phase == "optimizer":
            self.version += 1
            w = costs.weight_sync_s
            self.pause_acc += w  # partial rollout: every in-flight trajectory waits for the push
            self.meter.pause(t, t + w, len(self.live))
            self._log(t, t + w, "weight_sync")
            self.learner_phase, self.learner_until = "sync", t + w
        elif self.learner_phase == "gap":
            self._idle(t)
        else:
            self.rollout_version, self.consumed = self.version, 0
            self.step_ends.append(t)
            if len(self.step_ends) == self.cfg.warmup_steps:
                self.meter.a = t
            if costs.step_gap_s > 0:  # driver work between steps; rollouts go on
                self._log(t, t + costs.step_gap_s, "step_overhead")
                self.learner_phase, self.learner_until = "gap", t + costs.step_gap_s
            else:
                self._idle(t)
            self.try_start(t)

    def _busy(self, t: float, work: float, phase: str) -> None:
        """Start learner compute of `work` seconds (alone); on shared cores its end moves with decoding."""
        self.learner_phase = phase
        if self.shared is None:
            self.learner_until = t + work
        else:
            self.learner_end_v = self.lv + work
            self.set_rates(t)

    # ------------------------------------------------------------------ shared cores
    def set_rates(self, t: float) -> None:
        """Advance both clocks to t, then set their rates from who computes now."""
        dt = t - self.clock_t
        self.rv += dt * self.rrate
        self.lv += dt * self.lrate
        self.clock_t = t
        computing = self.learner_phase in ("chunk", "optimizer")
        self.rrate = 0.0 if self.learner_phase == "sync" else (1.0 / self.shared.rollout_slowdown if computing
                                                                else 1.0)
        self.lrate = 1.0 / self.shared.learner_slowdown if self.dec_heap else 1.0
        if computing:
            self.learner_until = t + (self.learner_end_v - self.lv) / self.lrate

    def next_decode(self) -> float:
        if not self.dec_heap or self.rrate == 0.0:
            return np.inf
        return self.clock_t + (self.dec_heap[0][0] - self.rv) / self.rrate

    def on_decoded(self, t: float) -> None:
        """A turn's generation ended: its tool call (on the pause clock) follows."""
        _, tid = heapq.heappop(self.dec_heap)
        _n, _gen, tool = self.stream.turn(tid, self.turn_of[tid])
        heapq.heappush(self.roll_heap, (t - self.pause_acc + tool, tid))

    def on_tool(self, t: float, tid: int) -> None:
        """A turn's tool call ended: the next turn decodes, or the trajectory is done."""
        j = self.turn_of[tid] + 1
        n_turns = self.stream.turn(tid, j - 1)[0]
        if j < n_turns:
            self.turn_of[tid] = j
            heapq.heappush(self.dec_heap, (self.rv + self.stream.turn(tid, j)[1], tid))
            return
        del self.turn_of[tid]
        self.on_done(t, tid)

    def _seq(self, tid: int) -> int:
        (_dur, _lag, seq, _gids, _sizes), i = self.stream.get(tid)
        return seq[i]

    def _train(self, tid: int) -> None:
        born = self.version_of.pop(tid)
        self.staleness[self.version - born] += 1
        if self.timeline is not None:
            self.timeline["trained"].append((tid // self.n, tid % self.n, self.version, born))
        self.tokens += self._seq(tid)
        self.trained += 1
        self.stream.release(tid)

    def _idle(self, t: float) -> None:
        self.learner_phase, self.learner_until, self.learner_idle_since = None, np.inf, t
        self.try_learn(t)

    def _log(self, t0: float, t1: float, kind: str, tokens: int = 0, overhead: float = 0.0) -> None:
        """Learner interval (t0, t1, kind, tokens, chunk overhead included in it)."""
        if t1 > t0:
            self.learner_log.append((t0, t1, kind, tokens, overhead))


def simulate_fully_async(cfg: SimConfig, source, costs: LearnerCosts, state: _State | None = None) -> SimResult:
    """The event loop; ``state`` swaps in a policy built on ``_State`` (sim/sim_pace.py)."""
    st = state or _State(cfg, source, costs)
    st.try_start(0.0)
    shared = st.shared is not None
    while len(st.step_ends) < cfg.steps:
        t_dec = st.next_decode() if shared else np.inf
        t_roll = st.roll_heap[0][0] + st.pause_acc if st.roll_heap else np.inf
        t_land = st.land_heap[0][0] if st.land_heap else np.inf
        t_next = min(t_dec, t_roll, t_land, st.learner_until)
        if t_next == np.inf:
            raise RuntimeError("fully_async simulation stalled: no event can happen; this is a bug")
        if shared:
            st.set_rates(t_next)  # advance the clocks with the rates of the interval that ends here
        if t_dec == t_next:
            st.on_decoded(t_next)
        elif t_roll == t_next:  # rollouts first: a trajectory ending at a push's start is not paused
            _, tid = heapq.heappop(st.roll_heap)
            if shared:
                st.on_tool(t_roll, tid)
            else:
                st.on_done(t_roll, tid)
        elif t_land == t_next:
            _, tid = heapq.heappop(st.land_heap)
            st.on_land(t_land, tid)
        else:
            st.on_learner(t_next)
        if shared:
            st.set_rates(t_next)  # who computes may have changed
    return _result(cfg, st)


def _result(cfg: SimConfig, st: _State) -> SimResult:
    ends = np.asarray(st.step_ends)
    starts = np.concatenate([[0.0], ends[:-1]])
    a, b = (ends[cfg.warmup_steps - 1] if cfg.warmup_steps else 0.0), ends[-1]
    meter = st.meter
    if meter.a is None:
        meter.a = a
    for t0, _slot in st.live.values():  # still in flight at the end of the window
        meter.occupied += meter._clip(t0, b)
    if meter.in_flight == 0:
        meter.no_work += meter._clip(meter.zero_since, b)
    ledger = Ledger(cfg.rollout_slots)
    for t0, t1, kind, _tokens, over in st.learner_log:
        inside = clip_sum([t0], [t1], a, b)
        share = over / (t1 - t0) if kind == "compute" else 0.0
        ledger.add_learner(kind, inside * (1.0 - share))
        ledger.add_learner("chunk_overhead", inside * share)
    ledger.add_rollout_totals(b - a, meter.occupied, (b - a) - meter.no_work, meter.paused)
    ledger.close_window(b - a)
    timeline = None
    if st.timeline is not None:
        live = [(s, t0, b, tid // st.n, tid % st.n) for tid, (t0, s) in st.live.items()]
        timeline = {"rollout": st.timeline["rollout"] + live, "learner": [x[:4] for x in st.learner_log],
                    "trained": st.timeline["trained"]}
    return SimResult(cfg.mode, cfg.algo, "mini_batch", starts, ends, cfg.warmup_steps, ledger, st.staleness,
                     0, cfg.bytes_per_buffer, cfg.gpus, st.tokens, st.tokens, st.tokens, timeline,
                     {"trained_trajectories": st.trained, "started_trajectories": st.started})
