"""The learner lane: which ready work it trains next, in chunks, under a memory budget.

Why this module exists:
1. A streamed backward starts when its inputs are fixed: a GRPO trajectory when its reward
   lands (group granularity: when its whole group closes), an OPD turn when the teacher has
   scored it. The lane turns those ready times into chunks on one serial resource.
2. Open groups cost memory (two fp32 buffers each), so the scheduling rule is:
   trajectories of closed groups first (no buffer), then of groups that already hold
   buffers, then of new groups while the open-group budget allows. A group's buffers are
   folded and freed when it closes.
3. Each chunk pays a fixed host overhead, and its compute is max(work / dp, largest unit):
   the dp replicas share a chunk but one sequence is not split across replicas.
   `min_chunk` (default dp) makes the lane wait until every replica has a sequence, unless
   no more work can arrive.
4. Everything here is plain Python over pre-sorted lists: thousands of units per step for
   thousands of steps must run in seconds.
5. A group may be aborted (the tail policy, tail.py: launched but not in the batch): from its
   `drop_at` time its untrained units are dropped and its buffers freed; units of it trained
   before then were speculative and are booked as wasted learner work.
6. OPD turns with their prefix recomputed (``LaneWork.row``): ready turns of one trajectory that go in one chunk
   run as ONE row, the latest turn's prefix, which trains the earlier turns' tokens too (the product's planner,
   ``algos/opd/opd_stream.py`` point 7). A busy learner thus finds several turns of a trajectory ready and pays
   for one prefix; ``LaneRun.computed_tokens`` counts the rows' prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IDLE_ROLLOUT = "wait_rollout"  # nothing trainable has arrived yet
IDLE_BUDGET = "wait_budget"  # ready work exists but its group cannot open a buffer


@dataclass
class LaneWork:
    """One step's trainable units."""

    ready: np.ndarray  # [U] wall time the unit's inputs are fixed
    group: np.ndarray  # [U] group index, -1 when the unit needs no group buffer
    close: np.ndarray  # [G] wall time each group closes (its last reward lands)
    cost: np.ndarray  # [U] seconds on one replica
    tokens: np.ndarray  # [U] sequence tokens the unit trains
    forward: np.ndarray | None = None  # [U] True for a trajectory's separate forward pass (OPD turn streaming)
    drop_at: np.ndarray | None = None  # [G] when each group is aborted (inf: never); point 5
    # point 6: OPD turns whose prefix the learner recomputes. ``row``: [U] the trajectory each turn belongs to
    # (distinct negative values never share); ``computed``: [U] the tokens the turn's own row computes (its prefix)
    row: np.ndarray | None = None
    computed: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(self.ready.shape[0])


@dataclass(frozen=True)
class LanePolicy:
    dp: int = 1
    chunk_overhead_s: float = 0.0
    min_chunk: int | None = None  # default: dp
    max_chunk: int | None = None  # default: unbounded
    budget_groups: int | None = None  # open-group cap; None = unbounded
    forward_overhead_s: float = 0.0  # extra per chunk that contains forward units (a separate op)


@dataclass
class LaneRun:
    start: float
    finish: float
    compute_s: float = 0.0
    overhead_s: float = 0.0
    tokens: int = 0
    units: int = 0
    peak_open_groups: int = 0
    chunks: list = field(default_factory=list)  # (t0, t1, n_units, tokens)
    idle: dict = field(default_factory=lambda: {IDLE_ROLLOUT: 0.0, IDLE_BUDGET: 0.0})
    idle_spans: list = field(default_factory=list)  # (t0, t1, reason) when recorded
    dropped_units: int = 0  # units of aborted groups never trained (point 5)
    wasted_units: int = 0  # units of aborted groups trained before the abort
    wasted_tokens: int = 0
    wasted_s: float = 0.0  # their share of the lane's compute (cost / dp each)
    computed_tokens: int | None = None  # the rows' tokens where turns merge (point 6), else None


class PendingUnits:
    """Ready-but-untrained units bucketed by the state of their group (O(1) counters)."""

    def __init__(self, n_groups: int):
        self.closed_units: list[int] = []
        self.open_units: dict[int, list[int]] = {}
        self.new_groups: dict[int, list[int]] = {}  # insertion order = first arrival
        self.is_closed = [False] * n_groups
        self.is_open = [False] * n_groups
        self.open_count = 0  # groups holding buffers
        self.n_open_units = 0
        self.n_new_units = 0

    def add(self, u: int, g: int) -> None:
        if g < 0 or self.is_closed[g]:
            self.closed_units.append(u)
        elif self.is_open[g]:
            self.open_units.setdefault(g, []).append(u)
            self.n_open_units += 1
        else:
            self.new_groups.setdefault(g, []).append(u)
            self.n_new_units += 1

    def close(self, g: int) -> None:
        self.is_closed[g] = True
        if self.is_open[g]:
            self.open_count -= 1
        moved = self.open_units.pop(g, None)
        if moved:
            self.n_open_units -= len(moved)
            self.closed_units.extend(moved)
        moved = self.new_groups.pop(g, None)
        if moved:
            self.n_new_units -= len(moved)
            self.closed_units.extend(moved)

    def drop(self, g: int) -> int:
        """Abort group g: forget its pending units, free its buffers; returns how many units it forgot."""
        if self.is_open[g]:
            self.is_open[g] = False
            self.open_count -= 1
        removed = 0
        units = self.open_units.pop(g, None)
        if units:
            self.n_open_units -= len(units)
            removed += len(units)
        units = self.new_groups.pop(g, None)
        if units:
            self.n_new_units -= len(units)
            removed += len(units)
        return removed

    def eligible(self, budget: int | None, enough: int) -> int:
        """Units trainable now (closed, open, new groups within the budget), counted up to `enough`."""
        total = len(self.closed_units) + self.n_open_units
        if budget is None:
            return total + self.n_new_units
        room = budget - self.open_count
        if room >= len(self.new_groups):
            return total + self.n_new_units
        for units in self.new_groups.values():
            if room <= 0 or total >= enough:
                break
            total += len(units)
            room -= 1
        return total

    def take(self, budget: int | None, cap: int | None) -> list[int]:
        """Closed-group units, then open-group units, then new groups while the budget allows."""
        cap = cap if cap is not None else 1 << 62
        chunk = self.closed_units[:cap]
        self.closed_units = self.closed_units[cap:]
        while self.open_units and len(chunk) < cap:
            units = self.open_units.pop(next(iter(self.open_units)))
            self.n_open_units -= len(units)
            chunk.extend(units)
        while self.new_groups and len(chunk) < cap and (budget is None or self.open_count < budget):
            g = next(iter(self.new_groups))
            units = self.new_groups.pop(g)
            self.n_new_units -= len(units)
            chunk.extend(units)
            self.is_open[g] = True
            self.open_count += 1
        return chunk


def run_lane(work: LaneWork, policy: LanePolicy, t_free: float, record: bool = False,
             fast: bool = True) -> LaneRun:
    """Train every unit of `work`, starting no earlier than t_free; returns when and how.

    Without a binding budget or chunk cap every arrived unit is eligible, and the vectorised
    path (one iteration per chunk) gives the same schedule as the general one.
    """
    n_groups = len(work.close)
    budget = policy.budget_groups if (policy.budget_groups is not None and policy.budget_groups < n_groups) else None
    if fast and budget is None and policy.max_chunk is None and work.drop_at is None and work.row is None:
        return _run_unbounded(work, policy, t_free, record)
    return _run_general(work, policy, t_free, budget, record)


def chunk_seconds(policy: LanePolicy, work_s: float, max_cost: float, has_forward: bool) -> tuple[float, float]:
    """(host overhead, compute) of one chunk."""
    over = policy.chunk_overhead_s + (policy.forward_overhead_s if has_forward else 0.0)
    return over, max(work_s / policy.dp, max_cost)


def _chunk(run: LaneRun, policy: LanePolicy, t: float, work_s: float, max_cost: float, n: int, ntok: int,
           has_forward: bool = False) -> float:
    """Book one chunk starting at t; returns its end."""
    over, compute = chunk_seconds(policy, work_s, max_cost, has_forward)
    t1 = t + over + compute
    run.chunks.append((t, t1, n, ntok))
    run.compute_s += compute
    run.overhead_s += over
    run.tokens += ntok
    return t1


def _run_general(work: LaneWork, policy: LanePolicy, t_free: float, budget, record: bool) -> LaneRun:
    n = work.size
    order = np.argsort(work.ready, kind="stable")
    ready = work.ready[order].tolist()
    order = order.tolist()
    groups = work.group.tolist()
    cost, tokens = work.cost.tolist(), work.tokens.tolist()
    fwd = work.forward.tolist() if work.forward is not None else [False] * n
    close = work.close.tolist()
    close_order = np.argsort(work.close, kind="stable").tolist()
    pend = PendingUnits(len(close))
    min_chunk = max(policy.min_chunk if policy.min_chunk is not None else policy.dp, 1)
    run = LaneRun(start=t_free, finish=t_free)
    drops = _Drops(work.drop_at, len(close))
    merge = _MergedTurns(work, run) if work.row is not None else None
    t, i, j, done = t_free, 0, 0, 0
    while done < n:
        while i < n and ready[i] <= t:
            g = groups[order[i]]
            if g >= 0 and drops.dropped[g]:
                run.dropped_units += 1
                done += 1
            else:
                pend.add(order[i], g)
            i += 1
        while j < len(close) and close[close_order[j]] <= t:
            pend.close(close_order[j])
            j += 1
        removed = drops.advance(t, pend, run)
        done += removed
        if done >= n:
            break
        eligible = pend.eligible(budget, min_chunk)
        blocked = bool(pend.new_groups)
        # Eligibility grows only by arrivals or, when groups wait for the budget, by closes (or aborts):
        # jump straight to the arrival that could complete a minimum chunk.
        arrive = ready[min(i + max(min_chunk - eligible, 1) - 1, n - 1)] if i < n else np.inf
        next_t = min(arrive, close[close_order[j]] if (blocked and j < len(close)) else np.inf, drops.next_t)
        if eligible == 0 or (eligible < min_chunk and next_t < np.inf):
            if next_t == np.inf:
                raise RuntimeError("learner lane stalled with untrained units and no future event; this is a bug")
            reason = IDLE_BUDGET if (eligible == 0 and blocked) else IDLE_ROLLOUT
            run.idle[reason] += next_t - t
            if record:
                run.idle_spans.append((t, next_t, reason))
            t = next_t
            continue
        chunk = pend.take(budget, policy.max_chunk)
        run.peak_open_groups = max(run.peak_open_groups, pend.open_count)
        rows = chunk if merge is None else merge.rows(chunk, cost, run)
        t = _chunk(run, policy, t, sum(cost[u] for u in rows), max(cost[u] for u in rows), len(chunk),
                   sum(tokens[u] for u in chunk), any(fwd[u] for u in chunk))
        drops.trained(chunk, groups, cost, tokens, policy.dp)
        done += len(chunk)
    drops.advance(np.inf, pend, run)  # groups aborted after the lane's last chunk: their trained units are waste
    run.units, run.finish = done - run.dropped_units, t
    return run


class _MergedTurns:
    """Point 6: the rows a chunk's units run as, one per trajectory (its latest turn: the largest cost)."""

    def __init__(self, work: LaneWork, run: LaneRun):
        if work.computed is None:
            raise ValueError("LaneWork.row needs LaneWork.computed: the tokens each turn's own row computes")
        self.row, self.computed = work.row.tolist(), work.computed.tolist()
        run.computed_tokens = 0

    def rows(self, chunk: list, cost: list, run: LaneRun) -> list:
        latest: dict = {}
        for u in chunk:
            r = self.row[u]
            if r not in latest or cost[u] > cost[latest[r]]:
                latest[r] = u
        rows = list(latest.values())
        run.computed_tokens += int(sum(self.computed[u] for u in rows))
        return rows


class _Drops:
    """Group aborts in time order (point 5), and what was trained of each group that may be aborted."""

    def __init__(self, drop_at: np.ndarray | None, n_groups: int):
        self.dropped = [False] * n_groups
        self.at = drop_at.tolist() if drop_at is not None else [np.inf] * n_groups
        self.order = [g for g in np.argsort(drop_at, kind="stable").tolist() if self.at[g] < np.inf] \
            if drop_at is not None else []
        self.k = 0
        self.spec: dict[int, list] = {}  # group -> [units, tokens, seconds] trained before its abort

    @property
    def next_t(self) -> float:
        return self.at[self.order[self.k]] if self.k < len(self.order) else np.inf

    def advance(self, t: float, pend: PendingUnits, run: LaneRun) -> int:
        """Abort every group due by t; returns the pending units forgotten."""
        removed = 0
        while self.k < len(self.order) and self.at[self.order[self.k]] <= t:
            g = self.order[self.k]
            self.k += 1
            self.dropped[g] = True
            removed += pend.drop(g)
            units, tokens, seconds = self.spec.pop(g, (0, 0, 0.0))
            run.wasted_units += units
            run.wasted_tokens += tokens
            run.wasted_s += seconds
        run.dropped_units += removed
        return removed

    def trained(self, chunk: list, groups: list, cost: list, tokens: list, dp: int) -> None:
        if not self.order:
            return
        at, spec = self.at, self.spec
        for u in chunk:
            g = groups[u]
            if g >= 0 and at[g] < np.inf:
                entry = spec.setdefault(g, [0, 0, 0.0])
                entry[0] += 1
                entry[1] += tokens[u]
                entry[2] += cost[u] / dp


def _run_unbounded(work: LaneWork, policy: LanePolicy, t_free: float, record: bool) -> LaneRun:
    """Every arrived unit is eligible: one loop iteration per chunk, sums from prefix arrays."""
    n = work.size
    order = np.argsort(work.ready, kind="stable")
    ready = work.ready[order]  # [U] sorted
    cost = work.cost[order]
    cum_cost = np.concatenate([[0.0], np.cumsum(cost)])  # [U + 1]
    cum_tok = np.concatenate([[0], np.cumsum(work.tokens[order])])  # [U + 1]
    fwd = work.forward[order] if work.forward is not None else np.zeros(n, dtype=bool)
    cum_fwd = np.concatenate([[0], np.cumsum(fwd)])  # [U + 1]
    min_chunk = max(policy.min_chunk if policy.min_chunk is not None else policy.dp, 1)
    run = LaneRun(start=t_free, finish=t_free)
    starts = np.empty(n)  # [U] start of the chunk that trained each (sorted) unit
    t, done = t_free, 0
    ready_l = ready.tolist()
    while done < n:
        hi = int(np.searchsorted(ready, t, side="right"))
        if hi - done < min_chunk and hi < n:
            t_next = ready_l[min(done + min_chunk - 1, n - 1)]
            run.idle[IDLE_ROLLOUT] += t_next - t
            if record:
                run.idle_spans.append((t, t_next, IDLE_ROLLOUT))
            t = t_next
            continue
        starts[done:hi] = t
        t = _chunk(run, policy, t, float(cum_cost[hi] - cum_cost[done]), float(cost[done:hi].max()), hi - done,
                   int(cum_tok[hi] - cum_tok[done]), bool(cum_fwd[hi] > cum_fwd[done]))
        done = hi
    run.units, run.finish = done, t
    run.peak_open_groups = _peak_open(work.group[order], starts, work.close)
    return run


def _peak_open(group: np.ndarray, start: np.ndarray, close: np.ndarray) -> int:
    """Most groups holding buffers at once: a group opens when a unit of it trains before it closes."""
    sel = group >= 0
    if not np.any(sel):
        return 0
    first = np.full(len(close), np.inf)
    np.minimum.at(first, group[sel], start[sel])  # [G] first training of each group
    opened = first < close
    if not np.any(opened):
        return 0
    t = np.concatenate([first[opened], close[opened]])
    delta = np.concatenate([np.ones(opened.sum()), -np.ones(opened.sum())])
    order = np.lexsort((delta, t))  # closes before opens at equal times
    return int(np.cumsum(delta[order]).max())
