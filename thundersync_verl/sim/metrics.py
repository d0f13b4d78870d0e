"""What a simulation reports: step time, utilisation, bubbles, staleness, memory, GPU-hours.

Why this module exists:
1. Every mode is judged by the same ledger so the comparison is fair: learner time split
   into compute, chunk overhead, optimizer, weight sync, step overhead and the waits
   (for rollouts, for the memory budget, for the barrier); rollout slot-time split into
   busy, paused by a weight sync, idle while other slots still run (the tail, or a staleness
   gate) and idle with nothing in flight (waiting on the learner).
2. The figures are steady-state: warm-up steps (the first batch of an off-policy pipeline,
   or any start-up) are left out of the window [end of warm-up, end of the last step].
3. Step time is the mean spacing of weight pushes in that window: it equals the mean step
   duration for barrier modes and the throughput for streaming ones, so measured traces and
   simulations are compared on the same definition.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

LEARNER_BUSY = ("compute", "chunk_overhead", "optimizer", "weight_sync", "step_overhead")
LEARNER_IDLE = ("wait_rollout", "wait_budget", "wait_barrier")
ROLLOUT_KINDS = ("busy", "paused_sync", "idle_tail", "idle_no_work")


def clip_sum(t0: np.ndarray, t1: np.ndarray, a: float, b: float) -> float:
    """Total length of intervals [t0, t1) inside the window [a, b)."""
    lo = np.maximum(np.asarray(t0, dtype=np.float64), a)
    hi = np.minimum(np.asarray(t1, dtype=np.float64), b)
    return float(np.clip(hi - lo, 0.0, None).sum())


def union_length(t0: np.ndarray, t1: np.ndarray, a: float, b: float) -> float:
    """Length of the union of intervals, inside [a, b): time with at least one in flight."""
    lo = np.maximum(np.asarray(t0, dtype=np.float64), a)
    hi = np.minimum(np.asarray(t1, dtype=np.float64), b)
    keep = hi > lo
    if not np.any(keep):
        return 0.0
    lo, hi = lo[keep], hi[keep]
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    run_hi = np.maximum.accumulate(hi)  # [K] furthest end so far
    starts_new = np.concatenate([[True], lo[1:] > run_hi[:-1]])
    seg_id = np.cumsum(starts_new) - 1
    seg_lo = lo[starts_new]
    seg_hi = np.zeros(len(seg_lo))
    np.maximum.at(seg_hi, seg_id, hi)
    return float((seg_hi - seg_lo).sum())


LEARNER_WORK_KINDS = ("compute", "optimizer", "weight_sync", "step_overhead")


def activity_split(rollout: np.ndarray, learner: np.ndarray, a: float, b: float) -> dict:
    """Seconds of [a, b) with only rollouts in flight, only the learner working, both, and neither.

    rollout / learner: [K, 2] intervals (a trajectory holding its slot; a learner op). The same
    split is computed for a measured trace and for its replay, so they compare side by side.
    """
    r0, r1 = (rollout[:, 0], rollout[:, 1]) if len(rollout) else (np.zeros(0), np.zeros(0))
    l0, l1 = (learner[:, 0], learner[:, 1]) if len(learner) else (np.zeros(0), np.zeros(0))
    r = union_length(r0, r1, a, b)
    lw = union_length(l0, l1, a, b)
    either = union_length(np.concatenate([r0, l0]), np.concatenate([r1, l1]), a, b)
    both = r + lw - either
    return {"rollout_only": r - both, "learner_only": lw - both, "both": both, "neither": (b - a) - either}


@dataclass
class Ledger:
    """Accumulates learner seconds and rollout slot-seconds inside the steady window."""

    slots: int
    learner: dict = field(default_factory=lambda: dict.fromkeys(LEARNER_BUSY + LEARNER_IDLE, 0.0))
    rollout: dict = field(default_factory=lambda: dict.fromkeys(ROLLOUT_KINDS, 0.0))
    window_s: float = 0.0

    def add_learner(self, kind: str, seconds: float) -> None:
        self.learner[kind] += float(seconds)

    def add_rollout_window(self, a: float, b: float, t0: np.ndarray, t1: np.ndarray,
                           paused_slot_s: float = 0.0) -> None:
        """Account rollout slots over [a, b) given the trajectories' slot intervals."""
        self.add_rollout_totals(b - a, clip_sum(t0, t1, a, b), union_length(t0, t1, a, b), paused_slot_s)

    def add_rollout_totals(self, span: float, occupied: float, any_busy: float, paused_slot_s: float = 0.0) -> None:
        """occupied: slot-seconds holding a trajectory; any_busy: seconds with >= 1 in flight."""
        busy = occupied - paused_slot_s
        self.rollout["busy"] += busy
        self.rollout["paused_sync"] += paused_slot_s
        self.rollout["idle_tail"] += max(self.slots * any_busy - occupied, 0.0)
        self.rollout["idle_no_work"] += self.slots * (span - any_busy)

    def close_window(self, span: float) -> None:
        """Whatever learner time is not yet explained inside the window waited on the barrier."""
        self.window_s = float(span)
        explained = sum(self.learner.values())
        self.learner["wait_barrier"] += max(span - explained, 0.0)


@dataclass
class SimResult:
    mode: str
    algo: str
    granularity: str
    step_start: np.ndarray  # [S]
    step_end: np.ndarray  # [S] weights of this step pushed to the rollout engines
    warmup_steps: int
    ledger: Ledger
    staleness: Counter
    peak_open_groups: int
    accum_peak_bytes_per_rank: float
    gpus: int
    tokens_generated: int  # sequence tokens of the batches the learner trained on
    tokens_trained: int  # sequence tokens the learner trained (each exactly once)
    compute_tokens: int  # tokens the learner processed, prefix recomputation included
    timeline: dict | None = None
    extra: dict = field(default_factory=dict)

    @property
    def step_times(self) -> np.ndarray:
        return np.diff(np.concatenate([[0.0], self.step_end]))

    @property
    def step_time_s(self) -> float:
        """Mean spacing of weight pushes after warm-up."""
        w = min(self.warmup_steps, len(self.step_end) - 1)
        a = self.step_end[w - 1] if w > 0 else 0.0
        return float((self.step_end[-1] - a) / (len(self.step_end) - w))

    @property
    def learner_util(self) -> float:
        busy = self.ledger.learner["compute"] + self.ledger.learner["optimizer"]
        return busy / self.ledger.window_s if self.ledger.window_s else 0.0

    @property
    def rollout_util(self) -> float:
        cap = self.ledger.slots * self.ledger.window_s
        return self.ledger.rollout["busy"] / cap if cap else 0.0

    @property
    def learner_wait_share(self) -> float:
        """Share of the window the learner waited for rollouts (the sync 'bubble')."""
        return self.ledger.learner["wait_rollout"] / self.ledger.window_s if self.ledger.window_s else 0.0

    @property
    def gpu_hours_per_step(self) -> float:
        return self.gpus * self.step_time_s / 3600.0

    def staleness_summary(self) -> dict:
        total = sum(self.staleness.values())
        if not total:
            return {"max": 0, "mean": 0.0, "hist": {}}
        mean = sum(k * v for k, v in self.staleness.items()) / total
        return {"max": max(self.staleness), "mean": mean, "hist": dict(sorted(self.staleness.items()))}

    def summary(self) -> dict:
        w = self.ledger.window_s or 1.0
        return {
            "mode": self.mode, "algo": self.algo, "granularity": self.granularity,
            "step_time_s": self.step_time_s, "learner_util": self.learner_util,
            "rollout_util": self.rollout_util, "learner_wait_share": self.learner_wait_share,
            "learner_share": {k: v / w for k, v in self.ledger.learner.items()},
            "rollout_share": {k: v / (w * self.ledger.slots) for k, v in self.ledger.rollout.items()},
            "staleness": self.staleness_summary(), "peak_open_groups": self.peak_open_groups,
            "accum_peak_gb_per_rank": self.accum_peak_bytes_per_rank / 1e9,
            "gpu_hours_per_step": self.gpu_hours_per_step,
            **({"tail": self.extra["tail"]} if "tail" in self.extra else {}),
        }


def format_table(rows: list[list], headers: list[str]) -> str:
    """Plain fixed-width table (no third-party dependency)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 1 else f"{c:,.1f}"
    return str(c)


def comparison_table(results: list[SimResult], baseline: str = "sync") -> str:
    """One row per mode: step time, speedup, utilisation, bubbles, staleness, memory, GPU-hours."""
    base = next((r.step_time_s for r in results if r.mode == baseline), None)
    rows = []
    for r in results:
        s = r.summary()
        st = s["staleness"]
        rows.append([
            f"{r.mode}/{r.granularity}", r.step_time_s, (base / r.step_time_s) if base else float("nan"),
            f"{100 * r.learner_util:.0f}%", f"{100 * r.rollout_util:.0f}%",
            f"{100 * s['learner_share']['wait_rollout']:.0f}%", f"{100 * s['learner_share']['wait_budget']:.0f}%",
            f"{100 * s['rollout_share']['idle_tail']:.0f}%", f"{100 * s['rollout_share']['idle_no_work']:.0f}%",
            f"{st['max']}/{st['mean']:.2f}", r.peak_open_groups, s["accum_peak_gb_per_rank"], r.gpu_hours_per_step,
        ])
    headers = ["mode", "step_s", "x_sync", "learn_util", "roll_util", "L_wait_roll", "L_wait_mem",
               "R_idle_tail", "R_idle_nowork", "stale max/mean", "open_grp", "accum_GB/rank", "GPUh/step"]
    return format_table(rows, headers)
