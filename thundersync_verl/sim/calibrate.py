"""What a trace measures beyond its recorded durations: landing latency, step gaps, slots, shared cores.

Why this module exists:
1. A trainer's records do not cover every second of a step. Each missing part is measured
   here from quantities the trace itself records (trajectory t_submit / t_done / t_reward and
   turn durations, learner op t0 / t1 / tokens, step t_start / t_end), never from the step
   time the replay is compared with:
   - landing latency: when a trace has no reward timing (every t_reward == t_done, as verl's
     own trainers write it), the time from a batch's data being complete to the learner's
     first op on it (reward verification, transfer queue, Ray calls) is fitted per trace;
   - step gap: driver time between a step's end and the next step (a weight push the trainer
     did not record, data loading, bookkeeping);
   - slot residual: time a trajectory held its slot beyond its turns (agent-loop work after
     the last turn, e.g. waiting for the teacher's scores);
   - slots: at least the largest number of trajectories the trace shows in flight at once;
   - partial rollout: a weight push landed in the middle of running trajectories;
   - shared cores: how much slower learner ops ran while the rollout engine decoded, and how
     much slower the engine decoded while the learner computed;
   - turn latency (OPD turn streaming, records with `rows`): from the end of a turn's generation
     to the trainer having the scored turn (teacher scoring, transfer, the driver's poll), fitted
     from how many turns each of the driver's polls had (the rows it then trained back to back).
2. Shared cores (processor sharing, hardware.SharedCores), both sides measured:
   - learner: an op of n tokens takes (a + b n)(1 + k w), where w is the share of its time
     during which at least one sequence was decoding; k is fitted with a and b (least squares
     over a grid of k);
   - rollout: the engine's token rate depends on how many sequences decode at once, so its
     rate while the learner computed is compared with its rate while it did not at the same
     concurrency: slowdown = (tokens it would have made in the learner-busy time at the idle
     rates of the same concurrency) / (tokens it made).
   Recorded turn and op durations are divided by 1 + (slowdown - 1) x overlap before replay,
   so the simulator can re-apply the slowdown wherever its own schedule overlaps the two.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

LEARNER_COMPUTE_OPS = ("forward", "backward", "other", "optimizer")
KAPPA_GRID = np.round(np.arange(0.0, 3.0001, 0.01), 2)  # contention 1 + k, k in [0, 3]


@dataclass(frozen=True)
class Calibration:
    reward_timing: bool  # the trace records when each reward reached the trainer
    landing_s: float  # fitted landing latency (used only without reward timing)
    step_gap_s: float
    slots: int
    partial_rollout: bool
    contention: float  # 1 + k: slowdown of learner compute while the engine decodes; 1 = none seen
    contention_ops: int  # learner ops that overlapped decoding (what k was fitted from)
    rollout_contention: float = 1.0  # slowdown of decoding while the learner computes; 1 = none seen
    turn_latency_s: float | None = None  # OPD turn streaming: generation end -> trainer has the turn; None: unmeasured
    # out of sample (transfer.landing_samples): another run's measured landings, dealt to this run's trajectories
    landing_samples: tuple[float, ...] | None = None

    def summary(self) -> dict:
        out = {"reward_timing": self.reward_timing, "landing_s": round(self.landing_s, 4),
               "step_gap_s": round(self.step_gap_s, 4), "slots": self.slots,
               "partial_rollout": self.partial_rollout, "learner_slowdown": round(self.contention, 3),
               "contention_ops": self.contention_ops, "rollout_slowdown": round(self.rollout_contention, 3)}
        if self.turn_latency_s is not None:
            out["turn_latency_s"] = round(self.turn_latency_s, 4)
        return out


# ------------------------------------------------------------------ intervals
def turn_intervals(rec: dict) -> np.ndarray:
    """[T, 2] generation interval of each turn: turns run back to back from t_submit."""
    t, out = rec["t_submit"], []
    for turn in rec["turns"]:
        out.append((t, t + turn["gen_s"]))
        t += turn["gen_s"] + turn["tool_s"]
    return np.asarray(out, dtype=np.float64).reshape(-1, 2)


def slot_residual(rec: dict, pushes: np.ndarray | None = None) -> float:
    """Seconds the trajectory held its slot beyond its turns and any weight push it waited for (>= 0)."""
    span = rec["t_done"] - rec["t_submit"]
    paused = 0.0
    if pushes is not None and len(pushes):
        paused = span * float(overlap_fraction(np.asarray([[rec["t_submit"], rec["t_done"]]]), pushes)[0])
    return max(0.0, span - paused - sum(t["gen_s"] + t["tool_s"] for t in rec["turns"]))


def push_intervals(trace) -> np.ndarray:
    """[P, 2] recorded weight pushes."""
    iv = [(r["t0"], r["t1"]) for r in trace.learner if r["op"] == "weight_sync"]
    return np.asarray(iv, dtype=np.float64).reshape(-1, 2)


def _union(iv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted segments covering the intervals; (starts, cumulative covered length at each end)."""
    iv = iv[iv[:, 1] > iv[:, 0]] if len(iv) else iv.reshape(0, 2)
    if not len(iv):
        return np.zeros((0, 2)), np.zeros(0)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    segs = [list(iv[0])]
    for a, b in iv[1:]:
        if a <= segs[-1][1]:
            segs[-1][1] = max(segs[-1][1], b)
        else:
            segs.append([a, b])
    segs = np.asarray(segs)
    return segs, np.cumsum(segs[:, 1] - segs[:, 0])


def _covered_before(segs: np.ndarray, cum: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Length of the union inside (-inf, x] for each x."""
    if not len(segs):
        return np.zeros_like(x)
    i = np.searchsorted(segs[:, 0], x, side="right") - 1  # last segment starting at or before x
    inside = np.where(i >= 0, np.minimum(x - segs[np.maximum(i, 0), 0], segs[np.maximum(i, 0), 1]
                                         - segs[np.maximum(i, 0), 0]), 0.0)
    before = np.where(i >= 1, cum[np.maximum(i - 1, 0)], 0.0)
    return np.where(i >= 0, before + inside, 0.0)


def overlap_fraction(query: np.ndarray, busy: np.ndarray) -> np.ndarray:
    """[Q] share of each [t0, t1) in `query` covered by the union of `busy` intervals."""
    query = np.asarray(query, dtype=np.float64).reshape(-1, 2)
    segs, cum = _union(np.asarray(busy, dtype=np.float64).reshape(-1, 2))
    span = query[:, 1] - query[:, 0]
    cov = _covered_before(segs, cum, query[:, 1]) - _covered_before(segs, cum, query[:, 0])
    return np.where(span > 0, np.clip(cov / np.where(span > 0, span, 1.0), 0.0, 1.0), 0.0)


def decode_busy(trace) -> np.ndarray:
    """[T, 2] every turn's generation interval in the trace."""
    parts = [turn_intervals(r) for r in trace.trajectories]
    return np.concatenate(parts) if parts else np.zeros((0, 2))


def learner_busy(trace) -> np.ndarray:
    """[L, 2] learner compute intervals (forward, backward, other, optimizer)."""
    iv = [(r["t0"], r["t1"]) for r in trace.learner if r["op"] in LEARNER_COMPUTE_OPS]
    return np.asarray(iv, dtype=np.float64).reshape(-1, 2)


# ------------------------------------------------------------------ shared cores
def fit_line(tokens: np.ndarray, secs: np.ndarray) -> tuple[float, float]:
    """Least-squares secs = a + b * tokens with a, b >= 0."""
    if len(secs) == 0:
        return 0.0, 0.0
    if len(np.unique(tokens)) < 2:
        return 0.0, float(secs.sum() / max(tokens.sum(), 1))
    b, a = np.polyfit(tokens.astype(np.float64), secs, 1)
    if a < 0:
        return 0.0, float(secs.sum() / max(tokens.sum(), 1))
    if b < 0:
        return float(secs.mean()), 0.0
    return float(a), float(b)


def op_overlap(trace, ops: list) -> np.ndarray:
    """[K] share of each learner op's time during which at least one sequence was decoding."""
    iv = np.asarray([(r["t0"], r["t1"]) for r in ops], dtype=np.float64).reshape(-1, 2)
    return overlap_fraction(iv, decode_busy(trace))


def fit_contention(trace) -> tuple[float, int]:
    """(k, ops that overlapped decoding): forward/backward time = (a + b n)(1 + k w), per op kind.

    k stays 0 unless at least two ops ran mostly during decoding and two mostly without it
    (otherwise the trace cannot tell contention from cost).
    """
    kinds = []
    for op in ("forward", "backward"):
        recs = [r for r in trace.learner if r["op"] == op]
        if recs:
            tok = np.asarray([r["tokens"] for r in recs], dtype=np.float64)
            sec = np.asarray([r["t1"] - r["t0"] for r in recs], dtype=np.float64)
            kinds.append((tok, sec, op_overlap(trace, recs)))
    if not kinds:
        return 0.0, 0
    w_all = np.concatenate([w for _, _, w in kinds])
    n_over = int((w_all > 0.5).sum())
    if n_over < 2 or int((w_all < 0.5).sum()) < 2:
        return 0.0, n_over
    best = (np.inf, 0.0)
    for k in KAPPA_GRID:
        err = 0.0
        for tok, sec, w in kinds:
            f = 1.0 + k * w
            a, b = fit_line(tok, sec / f)
            err += float((((a + b * tok) * f - sec) ** 2).sum())
        if err < best[0] * (1.0 - 1e-9):  # a near-tie keeps the smaller k
            best = (err, float(k))
    return best[1], n_over


CONCURRENCY_BINS = (1, 2, 3, 5, 8, 12, 17, 24, 33, 48, 68, 96, 136, 192, 272, 384, 544, 768, 1 << 30)


def fit_rollout_contention(trace, min_overlap_s: float = 1.0, min_bin_s: float = 0.2) -> float:
    """Decode slowdown while the learner computed, at matched concurrency (>= 1; 1 when not identified)."""
    turns = [(a, b, t["gen_tokens"]) for r in trace.trajectories
             for (a, b), t in zip(turn_intervals(r), r["turns"]) if b > a]
    ops = learner_busy(trace)
    if not turns or not len(ops):
        return 1.0
    tv = np.asarray(turns, dtype=np.float64)
    edges = np.unique(np.concatenate([tv[:, 0], tv[:, 1], ops[:, 0], ops[:, 1]]))
    dt = np.diff(edges)  # [S] elementary segments
    n = np.zeros(len(edges))
    rate = np.zeros(len(edges))
    busy = np.zeros(len(edges))
    i0, i1 = np.searchsorted(edges, tv[:, 0]), np.searchsorted(edges, tv[:, 1])
    np.add.at(n, i0, 1.0)
    np.add.at(n, i1, -1.0)
    r = tv[:, 2] / (tv[:, 1] - tv[:, 0])  # tokens per second of each turn
    np.add.at(rate, i0, r)
    np.add.at(rate, i1, -r)
    np.add.at(busy, np.searchsorted(edges, ops[:, 0]), 1.0)
    np.add.at(busy, np.searchsorted(edges, ops[:, 1]), -1.0)
    n, rate, busy = np.rint(np.cumsum(n)[:-1]), np.cumsum(rate)[:-1], np.rint(np.cumsum(busy)[:-1]) > 0
    b = np.searchsorted(CONCURRENCY_BINS, n, side="right") - 1  # [S] bin of each segment (n >= 1)
    per_seq = np.where(n >= 1, rate / np.maximum(n, 1), 0.0)  # [S] tokens per second per decoding sequence
    made = would = covered = 0.0
    for k in np.unique(b[n >= 1]):
        idle, hot = (b == k) & (n >= 1) & ~busy, (b == k) & (n >= 1) & busy
        t_idle = float(dt[idle].sum())
        if t_idle >= min_bin_s and hot.any():
            # what the same sequences would have made at the bin's idle rate per sequence
            would += float((n[hot] * dt[hot]).sum()) * float((per_seq[idle] * dt[idle]).sum()) / t_idle
            made += float((rate[hot] * dt[hot]).sum())
            covered += float(dt[hot].sum())
    total_hot = float(dt[(n >= 1) & busy].sum())
    if covered < min_overlap_s or covered < 0.5 * total_hot or made <= 0:
        return 1.0
    return max(1.0, would / made)


# ------------------------------------------------------------------ timing the trace does not record
def has_reward_timing(trace) -> bool:
    return any(r["t_reward"] > r["t_done"] or r["reward_s"] > 0 for r in trace.trajectories)


def peak_in_flight(trace) -> int:
    ev = sorted([(r["t_submit"], 1) for r in trace.trajectories] + [(r["t_done"], -1) for r in trace.trajectories])
    return int(max(np.cumsum([e[1] for e in ev]))) if ev else 0


def push_times(trace) -> np.ndarray:
    pushes = [r["t1"] for r in trace.learner if r["op"] == "weight_sync"]
    return np.sort(np.asarray(pushes or [s["t_end"] for s in trace.steps], dtype=np.float64))


def has_partial_rollout(trace, margin: float = 0.1) -> bool:
    """A push fell inside a running trajectory, at least `margin` x the median trajectory from both ends."""
    t0 = np.asarray([r["t_submit"] for r in trace.trajectories])
    t1 = np.asarray([r["t_done"] for r in trace.trajectories])
    pad = margin * float(np.median(t1 - t0))
    pushes = push_times(trace)
    return bool(np.any((np.searchsorted(pushes, t1 - pad) - np.searchsorted(pushes, t0 + pad, side="right")) > 0))


def step_gap(trace, barrier: bool) -> float:
    """Mean driver time between a step's end and the next step (barrier: the next batch's first submit)."""
    steps = sorted(trace.steps, key=lambda s: s["step"])
    first: dict = {}
    for r in trace.trajectories:
        first[r["step"]] = min(first.get(r["step"], np.inf), r["t_submit"])
    gaps = []
    for a, b in zip(steps, steps[1:]):
        nxt = first.get(b["step"], b["t_start"]) if barrier else b["t_start"]
        gaps.append(max(0.0, nxt - a["t_end"]))
    return float(np.mean(gaps)) if gaps else 0.0


def fit_landing(trace, batch_size: int, first_chunk: int) -> float:
    """Landing latency h: the learner's first op of step k starts at max(step start, ready_k + h).

    ready_k is when, counting finished trajectories in completion order (whole groups for GRPO,
    which needs a group's rewards together), the data for step k's first chunk was complete:
    (k - 1) x batch + first_chunk trajectories. Steps after the first; least squares over h.
    """
    first_op: dict = {}
    for r in trace.learner:
        if r["op"] in LEARNER_COMPUTE_OPS:
            first_op[r["step"]] = min(first_op.get(r["step"], np.inf), r["t0"])
    if trace.algo == "grpo":
        groups: dict = {}
        for r in trace.trajectories:
            groups.setdefault(r["group_id"], []).append(r["t_done"])
        size = Counter(len(v) for v in groups.values()).most_common(1)[0][0]
        units = sorted((max(v), len(v)) for v in groups.values() if len(v) == size)
    else:
        units = sorted((r["t_done"], 1) for r in trace.trajectories)
    if not units:
        return 0.0
    cum = np.cumsum([n for _, n in units])
    when = np.asarray([t for t, _ in units])
    rows = []
    for k, s in enumerate(sorted(trace.steps, key=lambda s: s["step"])):
        i = int(np.searchsorted(cum, k * batch_size + first_chunk))
        if k and i < len(when) and s["step"] in first_op:
            rows.append((when[i], s["t_start"], first_op[s["step"]]))
    if not rows:
        return 0.0
    ready, start, op0 = np.asarray(rows).T
    top = max(float(np.max(op0 - ready)), 0.0)
    grid = np.linspace(0.0, top, 1201)
    err = [float(((op0 - np.maximum(start, ready + h)) ** 2).sum()) for h in grid]
    return float(grid[int(np.argmin(err))])


POLL_GAP_S = 1e-3  # backward records further apart than this were trained after separate polls of the driver


def turn_polls(trace, poll_gap_s: float = POLL_GAP_S) -> list[tuple[np.ndarray, np.ndarray, float, int]]:
    """(gen_end [T], t_done [T], poll time, turns the trainer had by then) per driver poll of an OPD turn stream.

    A streaming OPD driver polls for scored turns, then trains every turn it got in chunks run back to back
    (one backward record each, `rows` = turn rows). A record that starts more than poll_gap_s after the
    previous one ends opens a new poll: at its start the trainer had every turn of the step trained up to
    the end of that run of records. Steps whose rows do not add up to their turns are left out (the rows
    are then not turns). Empty when the records carry no `rows`.
    """
    backward = [r for r in trace.learner if r["op"] == "backward"]
    if trace.algo != "opd" or not backward or any(not isinstance(r.get("rows"), int) for r in backward):
        return []
    ops: dict = {}
    for r in backward:
        ops.setdefault(r["step"], []).append(r)
    trajs: dict = {}
    for r in trace.trajectories:
        trajs.setdefault(r["step"], []).append(r)
    polls = []
    for step, recs in ops.items():
        recs = sorted(recs, key=lambda r: r["t0"])
        mine = trajs.get(step, [])
        if not mine or sum(r["rows"] for r in recs) != sum(len(t["turns"]) for t in mine):
            continue
        gen_end = np.concatenate([turn_intervals(t)[:, 1] for t in mine])  # [T]
        done = np.concatenate([np.full(len(t["turns"]), t["t_done"]) for t in mine])  # [T]
        had = np.cumsum([r["rows"] for r in recs])
        starts = [0] + [i for i in range(1, len(recs)) if recs[i]["t0"] - recs[i - 1]["t1"] > poll_gap_s]
        for a, b in zip(starts, starts[1:] + [len(recs)]):
            polls.append((gen_end, done, float(recs[a]["t0"]), int(had[b - 1])))
    return polls


def fit_turn_latency(trace, poll_gap_s: float = POLL_GAP_S) -> float | None:
    """Latency h of an OPD turn stream: turn j is the trainer's at min(gen_end_j + h, t_done).

    The cap: the recorded agent loop returns only after every turn of its trajectory is scored and
    published, so a trajectory's turns are all available when its slot frees (the slot residual holds
    the wait for the last turn's score). h is the least-squares fit, over the driver's polls
    (turn_polls), of the turns available at each poll; None when the trace has no such polls.
    """
    polls = turn_polls(trace, poll_gap_s)
    if not polls:
        return None
    top = max(float(np.max(d - g)) for g, d, _, _ in polls)
    grid = np.linspace(0.0, max(top, 0.0), 1201)  # [H]
    err = np.zeros(len(grid))
    for gen_end, done, p, had in polls:
        later = np.sort(gen_end[done > p])  # turns whose slot was still held at p: available iff gen_end + h <= p
        count = int((done <= p).sum()) + np.searchsorted(later, p - grid, side="right")  # [H]
        err += (count - had) ** 2
    return float(grid[int(np.argmin(err))])


def calibrate(trace, mode: str, batch_size: int, first_chunk: int, recorded_slots: int) -> Calibration:
    timing = has_reward_timing(trace)
    k, n_over = fit_contention(trace)
    return Calibration(
        reward_timing=timing,
        landing_s=0.0 if timing else fit_landing(trace, batch_size, first_chunk),
        step_gap_s=step_gap(trace, barrier=mode in ("sync", "thundersync")),
        slots=max(recorded_slots, peak_in_flight(trace)),
        partial_rollout=mode != "fully_async" and has_partial_rollout(trace),
        contention=1.0 + k, contention_ops=n_over, rollout_contention=fit_rollout_contention(trace),
        turn_latency_s=fit_turn_latency(trace) if mode == "thundersync" else None)


def decode_scale(trace, contention: float) -> dict[int, np.ndarray]:  # contention: the rollout's slowdown
    """id(trajectory record) -> [T] factor each turn's gen_s was stretched by in the recorded run."""
    if contention <= 1.0:
        return {}
    busy = learner_busy(trace)
    return {id(r): 1.0 + (contention - 1.0) * overlap_fraction(turn_intervals(r), busy) for r in trace.trajectories}


# ------------------------------------------------------------------ out of sample
def landing_latency(trace, calib: Calibration) -> float:
    """A run's landing latency as one number: the fitted one, or the mean recorded t_reward - t_done."""
    if not calib.reward_timing:
        return calib.landing_s
    return float(np.mean([r["t_reward"] - r["t_done"] for r in trace.trajectories]))


def transferred(own: Calibration, fit: Calibration, fit_landing_s: float) -> Calibration:
    """Out-of-sample replay: the target run's configuration with the fit run's measured system costs.

    The target keeps what its configuration fixes (rollout slots, whether pushes land mid-rollout);
    everything its records would measure about the system comes from the fit run instead: the landing
    latency (one number, every trajectory; the target's own reward timing is not used), the step gap,
    the shared-core slowdowns and the OPD turn latency.
    """
    return Calibration(
        reward_timing=False, landing_s=fit_landing_s, step_gap_s=fit.step_gap_s, slots=own.slots,
        partial_rollout=own.partial_rollout, contention=fit.contention, contention_ops=fit.contention_ops,
        rollout_contention=fit.rollout_contention,
        turn_latency_s=fit.turn_latency_s if own.turn_latency_s is not None else None)
