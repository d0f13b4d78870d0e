"""ThunderSync with verify overlap: a trajectory's backward may start when it completes, before its verifier answers.

Why this module exists:
1. ThunderSync trains a GRPO trajectory when its reward lands, so with SWE verifiers (test
   runs of seconds to minutes) the last rewards' latency stays on the step's critical path. A
   group's gradient is (G1 - mu G2) / (sigma + eps) with G2 = sum of the score gradients H_i
   (no reward needed) and G1 = the sum over the passes (binary rewards). A trajectory trained
   before its reward lands ("early") adds H_i to an early bucket X; once the group's early
   outcomes fix which class is smaller, only that class is backpropagated again (passes: +1
   into G1; fails F: G1 = L1 + X - F), so a group needs min(early passes, early fails) second
   backwards, at most min(p, 1 - p) of its trajectories for a pass rate p.
2. What the lane trains next: work whose reward is known comes first, in ThunderSync's order
   (second backwards and trajectories of closed groups, then landed trajectories of open
   groups, then of new groups within the open-group budget); a trajectory whose reward is still
   out is trained early only when the lane would otherwise idle. A zero-latency verifier thus
   gives exactly plain ThunderSync, and early work only fills time the lane would have idled.
3. The decision is causal and exact: with a early passes and b early fails landed and u group
   members whose reward is still out (trained early or not yet trained: either may still be
   early), the fails are the smaller class once b + u <= a, the passes once a + u <= b; later
   landings cannot change it. An early member of the smaller class is backpropagated again once
   its reward and the decision are both known.
4. Costs modelled: a second backward costs `SimConfig.verify_second_cost` x the first (1.0: a
   full forward, recompute and backward; activations of 131k-token sequences cannot be kept
   for the minutes a verifier runs), and an open group holds three fp32 buffers instead of two
   (X beside G1 and G2 of its landed trajectories) from its first backward to its close. At
   close the buffers fold; a later second backward goes straight into the batch gradient with
   the group's final coefficient, as a landed trajectory of a closed group does.
5. General (non-binary) rewards (`SimConfig.verify_rewards = "general"`): the reward-weighted
   sum needs every early trajectory backpropagated again once its reward lands (no smaller
   class), so each early trajectory costs two backwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from thundersync_verl.sim.sim_config import SimConfig
from thundersync_verl.sim.events import Placement, Recorder, count_tokens, lane_policy, place_rollouts, reward_times
from thundersync_verl.sim.hardware import LearnerCosts
from thundersync_verl.sim.lane import IDLE_BUDGET, IDLE_ROLLOUT, LanePolicy, LaneRun, chunk_seconds
from thundersync_verl.sim.metrics import SimResult
from thundersync_verl.sim.workload import Batch

VERIFY_OVERLAP_MODE = "thundersync+verify_overlap"  # the label of its results
NOT_DONE, WAITING, EARLY, LATE = 0, 1, 2, 3  # a trajectory's first backward: not completed, pending, run
COMPLETE, LAND, CLOSE = 0, 1, 2  # event kinds, in the order they apply at equal times


@dataclass
class VerifyWork:
    """One step's trajectories as the verify-overlap lane sees them."""

    done: np.ndarray  # [N] wall time the trajectory completes (its first backward may start)
    land: np.ndarray  # [N] wall time its reward lands (>= done)
    passed: np.ndarray  # [N] bool, the verifier's outcome
    group: np.ndarray  # [N] group index in 0..n_groups-1
    cost: np.ndarray  # [N] seconds of one forward + backward on one replica
    tokens: np.ndarray  # [N] sequence tokens
    n_groups: int
    second_cost: float = 1.0  # a second backward's cost / the first's
    rewards: str = "binary"  # binary: the smaller class again; general: every early trajectory again

    def close(self) -> np.ndarray:
        """[G] wall time each group's last reward lands."""
        close = np.full(self.n_groups, -np.inf)
        np.maximum.at(close, self.group, self.land)
        return close


@dataclass
class VerifyStats:
    """What the policy did in one step."""

    n_groups: int
    early: int = 0  # first backwards run before the trajectory's reward landed
    late: int = 0  # first backwards run after it (plain ThunderSync's)
    second: int = 0  # second backwards (the smaller class of each group's early members)
    second_tokens: int = 0
    second_lane_s: float = 0.0  # lane seconds (compute and chunk overhead) spent on second backwards
    second_by_group: np.ndarray = field(default=None)  # [G]
    early_passed: np.ndarray = field(default=None)  # [G] early members that passed
    early_failed: np.ndarray = field(default=None)  # [G]

    def __post_init__(self) -> None:
        for name in ("second_by_group", "early_passed", "early_failed"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(self.n_groups, dtype=np.int64))


class VerifyLane:
    """The learner lane of one step under verify overlap (module docstring, points 2-4)."""

    def __init__(self, work: VerifyWork, policy: LanePolicy, t_free: float, record: bool = False):
        n, n_groups = len(work.done), work.n_groups
        if np.any(work.land < work.done):
            raise ValueError("a reward lands before its trajectory completes; verifier latencies must be >= 0")
        self.work, self.policy, self.record, self.n = work, policy, record, n
        self.general = work.rewards == "general"
        budget = policy.budget_groups
        self.budget = budget if (budget is not None and budget < n_groups) else None
        self.group, self.passed = work.group.tolist(), work.passed.astype(bool).tolist()
        self.land, self.cost, self.tokens = work.land.tolist(), work.cost.tolist(), work.tokens.tolist()
        times = np.concatenate([work.done, work.land, work.close()])  # [2N + G]
        kinds = np.concatenate([np.full(n, COMPLETE), np.full(n, LAND), np.full(n_groups, CLOSE)])
        ids = np.concatenate([np.arange(n), np.arange(n), np.arange(n_groups)])
        order = np.lexsort((kinds, times))
        self.events = list(zip(times[order].tolist(), kinds[order].tolist(), ids[order].tolist()))
        self.next_event = 0
        self.state = [NOT_DONE] * n
        self.outstanding = np.bincount(work.group, minlength=n_groups).tolist()  # members whose reward is out
        self.n_pass, self.n_fail = [0] * n_groups, [0] * n_groups  # early members whose reward landed
        self.minority: list = [None] * n_groups  # True: passes are the smaller class, False: fails
        self.landed_early: list[list[int]] = [[] for _ in range(n_groups)]
        self.is_open, self.open_count = [False] * n_groups, 0
        self.free: list[int] = []  # need no new buffer: second backwards (unit n + i), closed groups' members
        self.late: dict[int, list[int]] = {}  # group -> landed, untrained members (group not closed)
        self.early: dict[int, list[int]] = {}  # group -> completed members whose reward is out
        self.run = LaneRun(start=t_free, finish=t_free)
        self.stats = VerifyStats(n_groups)

    # ------------------------------------------------------------------ events
    def admit(self, t: float) -> None:
        """Apply every completion, landing and close up to time t."""
        while self.next_event < len(self.events) and self.events[self.next_event][0] <= t:
            _, kind, i = self.events[self.next_event]
            self.next_event += 1
            if kind == COMPLETE:
                self.state[i] = WAITING
                self.early.setdefault(self.group[i], []).append(i)
            elif kind == LAND:
                self._land(i)
            else:
                self._close(i)

    def _land(self, i: int) -> None:
        g = self.group[i]
        self.outstanding[g] -= 1
        if self.state[i] == EARLY and self.general:
            self.free.append(self.n + i)
        elif self.state[i] == EARLY:
            if self.passed[i]:
                self.n_pass[g] += 1
            else:
                self.n_fail[g] += 1
            self.landed_early[g].append(i)
            if self.minority[g] is not None and self.passed[i] == self.minority[g]:
                self.free.append(self.n + i)
        else:  # still waiting: it will be trained with its reward known
            pending = self.early[g]
            pending.remove(i)
            if not pending:
                del self.early[g]
            self.late.setdefault(g, []).append(i)
        if self.minority[g] is None and not self.general:
            self._decide(g)

    def _decide(self, g: int) -> None:
        a, b, u = self.n_pass[g], self.n_fail[g], self.outstanding[g]
        if a + u <= b:
            self.minority[g] = True
        elif b + u <= a:
            self.minority[g] = False
        else:
            return
        self.free.extend(self.n + i for i in self.landed_early[g] if self.passed[i] == self.minority[g])

    def _close(self, g: int) -> None:
        if self.is_open[g]:
            self.is_open[g] = False
            self.open_count -= 1
        self.free.extend(self.late.pop(g, []))

    # --------------------------------------------------------------- choosing
    def _select(self, pool: dict, take_free: bool) -> tuple[list[int], list[int], list[int], bool]:
        """(units, groups taken from the pool, groups opened by them, whether the budget held work back)."""
        cap = self.policy.max_chunk if self.policy.max_chunk is not None else 1 << 62
        units = self.free[:cap] if take_free else []
        taken, opened = [], []
        for g, members in pool.items():
            if len(units) >= cap:
                break
            if self.is_open[g]:
                units.extend(members)
                taken.append(g)
        room = self.budget - self.open_count if self.budget is not None else 1 << 62
        blocked = False
        for g, members in pool.items():
            if self.is_open[g]:
                continue
            if len(units) >= cap:
                break
            if room <= 0:
                blocked = True
                break
            units.extend(members)
            taken.append(g)
            opened.append(g)
            room -= 1
        return units, taken, opened, blocked

    def next_chunk(self) -> tuple[list[int], bool]:
        """Known work first; otherwise early work; commits the choice. -> (units, budget held work back)."""
        units, taken, opened, blocked = self._select(self.late, True)
        pool, n_free = self.late, min(len(self.free), len(units))
        if not units:
            units, taken, opened, held = self._select(self.early, False)
            pool, n_free, blocked = self.early, 0, blocked or held
        min_chunk = max(self.policy.min_chunk if self.policy.min_chunk is not None else self.policy.dp, 1)
        if len(units) < min_chunk and self.next_event < len(self.events):
            return [], blocked
        del self.free[:n_free]
        for g in taken:
            del pool[g]
        for g in opened:
            self.is_open[g] = True
        self.open_count += len(opened)
        self.run.peak_open_groups = max(self.run.peak_open_groups, self.open_count)
        return units, blocked

    # ---------------------------------------------------------------- running
    def book(self, units: list[int], t: float) -> float:
        """Train one chunk starting at t; returns its end."""
        n, st = self.n, self.stats
        first_s, second_s, first_tok, max_cost = 0.0, 0.0, 0, 0.0
        for u in units:
            if u >= n:
                i = u - n
                c = self.cost[i] * self.work.second_cost
                second_s += c
                st.second += 1
                st.second_tokens += self.tokens[i]
                st.second_by_group[self.group[i]] += 1
            else:
                c = self.cost[u]
                first_s += c
                first_tok += self.tokens[u]
                self.state[u] = EARLY if self.land[u] > t else LATE
            max_cost = max(max_cost, c)
        over, compute = chunk_seconds(self.policy, first_s + second_s, max_cost, False)
        t1 = t + over + compute
        total = first_s + second_s
        share = second_s / total if total > 0 else sum(u >= n for u in units) / len(units)
        st.second_lane_s += share * (over + compute)
        run = self.run
        run.chunks.append((t, t1, len(units), first_tok))
        run.compute_s += compute
        run.overhead_s += over
        run.tokens += first_tok
        run.units += len(units)
        return t1

    def idle(self, t: float, blocked: bool) -> float:
        """Wait for the next event; returns its time."""
        if self.next_event >= len(self.events):
            raise RuntimeError("verify-overlap lane stalled with untrained work and no future event; this is a bug")
        t_next = self.events[self.next_event][0]
        reason = IDLE_BUDGET if blocked else IDLE_ROLLOUT
        self.run.idle[reason] += t_next - t
        if self.record:
            self.run.idle_spans.append((t, t_next, reason))
        return t_next

    def finished(self) -> bool:
        return self.next_event >= len(self.events) and not self.free and not self.late and not self.early

    def simulate(self) -> tuple[LaneRun, VerifyStats]:
        t = self.run.start
        while True:
            self.admit(t)
            if self.finished():
                break
            units, blocked = self.next_chunk()
            t = self.book(units, t) if units else self.idle(t, blocked)
        if any(s not in (EARLY, LATE) for s in self.state):
            raise RuntimeError("verify-overlap lane ended with an untrained trajectory; this is a bug")
        early = np.asarray(self.state) == EARLY  # [N]
        passed = self.work.passed.astype(bool)
        self.stats.early, self.stats.late = int(early.sum()), int((~early).sum())
        self.stats.early_passed = np.bincount(self.work.group[early & passed], minlength=self.work.n_groups)
        self.stats.early_failed = np.bincount(self.work.group[early & ~passed], minlength=self.work.n_groups)
        self.run.finish = t
        return self.run, self.stats


def run_verify_lane(work: VerifyWork, policy: LanePolicy, t_free: float,
                    record: bool = False) -> tuple[LaneRun, VerifyStats]:
    """Train every trajectory of `work` (and the second backwards it needs) from t_free."""
    return VerifyLane(work, policy, t_free, record).simulate()


def verify_work(batch: Batch, place: Placement, costs: LearnerCosts, cfg: SimConfig) -> VerifyWork:
    if batch.passed is None:
        raise ValueError("verify_overlap needs each trajectory's binary outcome, but the batch has none "
                         "(Batch.passed is None): its second backwards depend on which class is smaller; wrap "
                         "the source in verifier.VerifiedSource")
    seq = batch.seq_tokens.astype(np.float64)
    return VerifyWork(place.done, reward_times(batch, place, "grpo"), np.asarray(batch.passed, dtype=bool),
                      batch.group, costs.sequence_cost(0.0 * seq, seq), batch.seq_tokens, batch.n_groups,
                      cfg.verify_second_cost, cfg.verify_rewards)


def simulate_verify_overlap(cfg: SimConfig, source, costs: LearnerCosts) -> SimResult:
    """ThunderSync's barrier (rollout -> streamed learner -> optimizer -> push) with the verify-overlap lane."""
    policy = lane_policy(cfg, costs, "trajectory")
    rec = Recorder(cfg)
    starts, ends = [], []
    extra = {k: [] for k in ("early_backwards", "second_backwards", "second_lane_s", "min_class",
                             "step_lower_bound_s")}
    t = 0.0
    for k in range(cfg.steps):
        batch = source.batch(k)
        place = place_rollouts(batch.dur_s, t, cfg.rollout_slots)
        work = verify_work(batch, place, costs, cfg)
        run, stats = run_verify_lane(work, policy, t, record=cfg.record_timeline)
        t_opt = run.finish + costs.step_overhead_s + costs.optimizer_s
        t_end = t_opt + costs.weight_sync_s
        rec.learner_run(k, run, t_opt, t_opt, t_end, costs)
        rec.rollout(k, k, place, t, t_end)
        rec.trained(k, batch.size, k)
        count_tokens(rec, batch, run, int(batch.seq_tokens.sum()) + stats.second_tokens)
        _step_extra(extra, work, stats, costs, t)
        starts.append(t)
        ends.append(t_end)
        t = t_end + costs.step_gap_s
    res = rec.result(cfg, starts, ends, {k: np.asarray(v) for k, v in extra.items()})
    res.mode = VERIFY_OVERLAP_MODE
    return res


def _step_extra(extra: dict, work: VerifyWork, stats: VerifyStats, costs: LearnerCosts, t0: float) -> None:
    """Per-step figures: the policy's choices, and a lower bound on the step time from completions and landings."""
    passes = np.bincount(work.group[work.passed], minlength=work.n_groups)
    sizes = np.bincount(work.group, minlength=work.n_groups)
    extra["early_backwards"].append(stats.early)
    extra["second_backwards"].append(stats.second)
    extra["second_lane_s"].append(stats.second_lane_s)
    extra["min_class"].append(int(np.minimum(passes, sizes - passes).sum()))
    barrier = costs.step_overhead_s + costs.optimizer_s + costs.weight_sync_s
    first = work.done + costs.chunk_overhead_s + work.cost  # [N] no first backward ends earlier
    extra["step_lower_bound_s"].append(float(first.max()) - t0 + barrier)
