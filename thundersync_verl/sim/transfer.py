"""Out-of-sample transfer: one run's measured learner and system costs, another run's configuration.

Why this module exists:
1. A simulator is only as good as its predictions of runs it was not fitted on. The fit run's
   records measure the learner; the target contributes only its workload (the replayed
   trajectories) and its configuration (mode, micro-batch size, whether its learner runs a
   separate old-log-prob forward). Nothing here reads a target's step time or op durations.
2. One learner call costs a call overhead (the driver's request to the worker, the batch's
   transfer), plus host work per trained row (one micro-batch of one sequence: dispatch,
   loss, bookkeeping), plus compute per token. A streamed run's records (many calls of 1 to
   a few rows and of different lengths) separate the three (`fit_call_costs`, non-negative
   least squares); a batch trainer's update is ONE call of all its rows, so the same three
   numbers price it. Fitting "overhead + cost x tokens" instead, as the in-sample replay
   does, folds the per-row work into one of the two and mispredicts the other shape: on a
   0.4 M-parameter model the per-row work is most of a micro-batch's time.
   Each record is first brought to its alone speed (divided by 1 + (slowdown - 1) x its overlap with
   decoding) and then weighs 1 / that stretch in the least squares: a stretched record's alone time is
   only as good as the slowdown it was divided by, and rows and tokens are nearly collinear (rows of
   similar length), so the few stretched-by-2.7x records of a shared-core run would otherwise set the
   split. On the shared-core GRPO ThunderSync run the per-token cost drops from 0.000207 to 0.000151 s
   (its ops that ran alone, fitted alone: 0.00013; the same 0.44 M policy's alone ops on the emulated
   device: 0.00014); on the emulated runs (slowdown 1.1) each cost moves by 5% or less.
3. A separate old-log-prob forward (verl's Sync as configured, one-step-off Async, Fully
   Async; not Sync in bypass mode, not ThunderSync, which takes the old log-probs from its own
   forward) is one more call over the same rows without gradients: the call overhead, half
   the per-row host work (the forward's dispatches, not the backward's) and a third of the
   per-token compute (forward 2 P FLOPs of the 6 P of a forward and backward, hardware.py).
   A fit run that records the forward itself (`forward` records) gives it directly instead. The
   forwards a streamed run times inside its calls (`forward_s`: model entry to loss, per
   micro-batch, learner/forward_clock.py; fitted per row and token by `fit_fused_forward`) are
   NOT that price: verl's own forward calls took 2.0x them (shared-core GRPO Sync: 1.33 s per
   step measured, 0.66 s from the timed forwards of the ThunderSync run beside it) and 1.3x
   (emulated paper Sync: 3.28 against 2.52 s, timed by a later ThunderSync run of the same
   policy), as a forward-only call keeps host work outside the model (input preparation, its
   outputs gathered per micro-batch, its own dispatch); the rule priced them closer (0.80 and
   2.73 s), so it stays the price, the target names it (`old_log_prob_forward`) and
   simulate_validate reports the recorded forwards, the rule's price and the timed forwards side
   by side.
4. How much the learner slows while rollouts run applies to every mode whose learner overlaps its
   rollouts (all but Sync): with the rollout engine on the same cores (the shared-core runs) it is the
   engine's decoding; with the rollout on its own (emulated) device the engine costs no CPU, but the
   rollout SIDE (agent loops, tools, verifier, TransferQueue) still runs on the other core, and what it
   does there slows the learner's core through the caches and memory they share. Measured on the
   recorded workload (driver pinned with the learner): during one-step-off Async's learner ops the
   driver used 0.02 of the learner's core and the learner 0.96-0.99 of it, as in Sync's, yet Async's
   ops took 13-17% longer per token than Sync's in the run just before it; a learner-like Adam loop
   pinned to one core ran 4% slower with a Python loop on the other core and 8% slower with memory
   churn there (8 interleaved pairs). So one-step-off Async, whose learner trains while its next batch
   rolls out, is dealt the fit run's slowdown as ThunderSync and Fully Async are.
5. Driver work between steps (the step gap) is the trainer's own bookkeeping: it transfers
   between runs of the same trainer, and is zero where the fit run's trainer differs (the fit
   does not measure another trainer's bookkeeping).
6. Landing (a trajectory's end to the trainer having its reward: the verifier call, the reward
   hop, the driver's pickup) is measured per trajectory in a run with reward timing, and it
   grows with the load: on the emulated paper run 1.36 s on average for trajectories that
   ended with at most one group still running, 1.91 s with more than 16 running. A barrier
   trainer (Sync, one-step-off Async) waits for its batch's last rewards, which land when
   few trajectories still run, so it is dealt the fit run's landings of trajectories that
   ended with at most one group (group size) still running in their step; a streaming
   trainer is dealt all of them (`landing_samples`), in the fit run's submission order. A
   fit run without reward timing gives its one fitted landing latency (calibrate.py).
   On shared cores what stretches a landing is the learner, not the load: the reward hop and the
   driver's pickup run on the cores the learner computes on. On the shared-core GRPO ThunderSync
   run a trajectory whose landing overlapped learner compute for < 30% of it landed in 0.40 s on
   average, one that overlapped it for >= 70% in 0.82 s, whatever still ran (0.75 s with <= one
   group still running, all of those beside the learner's tail). Sync waits for its last rewards
   with its learner idle, so on shared cores it is dealt the fit run's landings made with the
   learner idle (`learner_idle`), when the fit has at least a group of them (Sync's own
   handoff, fitted in sample from its barrier, is 0.36 s); one-step-off Async trains the previous
   batch while its rewards land and keeps the rule above.
7. Another model: compute per token scales with the parameter count (a forward and backward
   is ~6 P FLOPs per token), so a target whose policy has P_t parameters gets the fit's
   per-token cost times P_t / P_f (``token_scale``; each run's meta.json records its model's
   parameters); call and per-row host work do not depend on the model's size.
8. Some of what a target exercises its fit run never ran, so no measurement prices it and the
   prediction leans on a neutral default (``unmeasured_terms`` names each, with the fit's numbers, and
   simulate_validate reports them per target instead of folding them into one error):
   - learner calls: a batch trainer writes one update per step, so its records cannot tell a call's
     overhead from its rows' host work (``fit_call_costs`` puts the intercept on the rows, call 0);
     a streamed target runs tens of calls per step (the recorded ThunderSync runs: 21 to 56 per step at
     0.013 to 0.020 s each, 0.3 to 1.0 s of a 4 to 15 s step) and pays none of them;
   - learner slowdown while the rollout runs: a Sync run's learner never overlaps its rollouts
     (no op to fit it from, slowdown 1), while a streamed target's does (shared cores: 2.68x measured
     on the ThunderSync runs; emulated device, the other core's rollout side: 1.07 to 1.10x);
   - landing under load: a run without reward timing gives one latency, fitted at its barrier (the
     batch's last rewards, when few trajectories still run); a streaming target lands each trajectory
     while up to a batch still runs, and the recorded landings grow with the load (emulated recorded
     workload: 0.96 s mean with < 4 running, 1.57 s with 16 to 40, against 0.60 s fitted at Sync's
     barrier);
   - Fully Async's per-update driver work: verl's Fully Async trainer samples its buffer, extracts
     rewards, balances the batch and computes advantages for every mini-batch update (8 per weight
     push here); a Sync or Async trainer does it once per step, inside the handoff its landing holds,
     and ThunderSync never does it. Only its advantage part is recorded (`other`): 0.67 s per step on
     the shared-core GRPO Fully Async run against 0.066 s on the Sync run;
   - the old-log-prob forward: a fit run without `forward` records (a streamed one) leaves a target's
     separate forward to the rule of point 3;
   - OPD turn latency: only a turn-streaming run measures the teacher's per-turn scoring latency
     (2.63 s fitted on the shared-core ThunderSync OPD run); verl's OPD Sync scores outside the records
     (its slot residual is 0.04 s), so a turn-streaming target predicted from it trains each turn as
     soon as it is generated.
9. Where the measured terms still miss (read after the predictions, from the targets' own records;
   never an input to them): (a) the separate old-log-prob forward is modelled (point 3), not
   measured, when the fit has no forward records, and verl's recorded forwards run above the model:
   1.33 s per step against 0.80 s predicted (shared-core GRPO Sync), 0.59 vs 0.47 (OPD Sync), 3.28 vs
   2.73 (emulated paper Sync); on a small CPU model a forward-only micro-batch keeps most of a
   training micro-batch's host work and the backward is not twice the forward. (b) On shared cores
   a training row of the same model costs more in verl's batch update than in ThunderSync's calls
   at their alone speed: Sync's update_actor 0.0376 s per row against the fit's 0.030 s at its rows'
   length (GRPO), 0.0176 against 0.014 s (OPD); on the emulated device, where every mode's learner is
   pinned to its own core alike, the two agree (0.030 against 0.031 s, recorded workload). The shared-core modes do not run their processes
   alike (recipes/cpu_tiny/mode: Sync's rollout lives in the learner's worker, hybrid_engine; the
   others run a standalone rollout) and nothing pins them, so part of a learner's speed there belongs
   to its mode and the ThunderSync run cannot measure it for the others: on shared cores one-step-off
   Async and Fully Async are predicted 20 to 27% short (OPD; GRPO's latest run 7 and 10%) and GRPO's
   Sync 16% short, nearly all of it in their learner's time (OPD's Sync, whose learner is half as
   long, 4%); verl's forwards there: 2.50 s per step in GRPO Async and Fully Async against 0.90 s priced.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from thundersync_verl.sim.calibrate import Calibration, learner_busy, op_overlap, overlap_fraction
from thundersync_verl.sim.hardware import LearnerCosts
from thundersync_verl.sim.trace import Trace, fit_learner_costs, parse_mode, records_recompute_prefix

FORWARD_FLOP_SHARE = 1.0 / 3.0  # a forward is 2 P of the 6 P FLOPs per token of a forward and backward
STREAMING_DRIVERS = ("thundersync", "fully_async")  # trainers whose driver takes each trajectory in as it lands
FORWARD_HOST_SHARE = 0.5  # a forward dispatches the forward's ops; a training row dispatches those and the backward's


@dataclass(frozen=True)
class RunSettings:
    """What the targets' configuration fixes that their traces do not record (benchmarks/modes.py's settings).

    micro_batch: rows per learner micro-batch; None: every learner record is one call (traces written by the
    simulator's own cost model). fully_async_mini_batch: rows per Fully Async update (an optimizer step each,
    weights pushed once per batch); None: one update per recorded backward record.
    """

    micro_batch: int | None = None
    fully_async_mini_batch: int | None = None


@dataclass(frozen=True)
class CallCosts:
    """Seconds of one learner call: call_s + row_s x rows + token_s x tokens (alone, no shared-core slowdown)."""

    call_s: float
    row_s: float
    token_s: float

    def forward(self) -> "CallCosts":
        """The same rows through a forward without gradients (module docstring, point 3)."""
        return CallCosts(self.call_s, self.row_s * FORWARD_HOST_SHARE, self.token_s * FORWARD_FLOP_SHARE)


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[K] argmin |x c - y|^2 with c >= 0, by trying every support (K is 3 here)."""
    best, out = np.inf, np.zeros(x.shape[1])
    for k in range(1, x.shape[1] + 1):
        for support in itertools.combinations(range(x.shape[1]), k):
            coef, *_ = np.linalg.lstsq(x[:, support], y, rcond=None)
            if (coef >= 0).all():
                err = float(((x[:, support] @ coef - y) ** 2).sum())
                if err < best:
                    best, out = err, np.zeros(x.shape[1])
                    out[list(support)] = coef
    return out


def record_rows(trace: Trace, recs: list, micro_batch: int | None) -> np.ndarray:
    """[R] rows each record trained: its `rows`, else its step's trajectories (a batch trainer's update);
    micro_batch None: every record is one row (a trace written by the simulator's own cost model)."""
    if micro_batch is None:
        return np.ones(len(recs))
    per_step = Counter(r["step"] for r in trace.trajectories)
    return np.asarray([r["rows"] if isinstance(r.get("rows"), int) else -(-per_step[r["step"]] // micro_batch)
                       for r in recs], dtype=np.float64)


def _alone_stretch(trace: Trace, recs: list, contention: float) -> np.ndarray:
    """[R] how much the shared-core slowdown stretched each record: 1 + (slowdown - 1) x its overlap with decoding."""
    return 1.0 + (contention - 1.0) * op_overlap(trace, recs) if contention > 1.0 else np.ones(len(recs))


def fit_call_costs(trace: Trace, op: str, contention: float, micro_batch: int | None) -> CallCosts | None:
    """CallCosts of one op kind from its records (durations at their alone speed); None without records."""
    recs = [r for r in trace.learner if r["op"] == op]
    if not recs:
        return None
    secs = np.asarray([r["t1"] - r["t0"] for r in recs], dtype=np.float64)
    stretch = _alone_stretch(trace, recs, contention)  # [R]
    secs = secs / stretch
    tokens = np.asarray([r["tokens"] for r in recs], dtype=np.float64)
    rows = record_rows(trace, recs, micro_batch)
    if micro_batch is None or len(np.unique(rows)) < 2:  # rows cannot be told from calls: one line per record
        base = fit_learner_costs(replace(trace, learner=recs), contention)
        if micro_batch is None:
            return CallCosts(base.chunk_overhead_s, 0.0, base.s_per_token)
        return CallCosts(0.0, base.chunk_overhead_s / float(rows.mean()), base.s_per_token)
    x = np.stack([np.ones_like(tokens), rows, tokens], axis=1)  # [R, 3]
    call, row, token = nonnegative_least_squares(x / stretch[:, None], secs / stretch)
    return CallCosts(float(call), float(row), float(token))


def fit_fused_forward(trace: Trace, train: CallCosts, contention: float, micro_batch: int | None) -> CallCosts | None:
    """The forwards timed inside the run's streamed calls (their records' ``forward_s``, at their alone speed) as
    CallCosts: the fit's call overhead, per-row and per-token forward work (non-negative least squares on rows and
    tokens); None without such records. Reported beside the forward's price, not used as it (module docstring,
    point 3)."""
    recs = [r for r in trace.learner if r["op"] == "backward" and np.isfinite(r.get("forward_s", np.nan))]
    if not recs or micro_batch is None:
        return None
    secs = np.asarray([r["forward_s"] for r in recs], dtype=np.float64)
    stretch = _alone_stretch(trace, recs, contention)  # [R]
    x = np.stack([record_rows(trace, recs, micro_batch), np.asarray([r["tokens"] for r in recs], dtype=np.float64)],
                 axis=1)  # [R, 2]
    row, token = nonnegative_least_squares(x / stretch[:, None], secs / stretch ** 2)
    return CallCosts(train.call_s, float(row), float(token))


def separate_forward(trace: Trace, bypass: bool) -> bool:
    """Whether the run's learner computed old log-probs in a call of their own (module docstring, point 3)."""
    mode = parse_mode(trace.mode)[0]
    return mode in ("sync", "async", "fully_async") and not bypass and any(r["op"] == "forward" for r in trace.learner)


IDLE_LEARNER_SHARE = 0.3  # a landing overlapping learner compute for less than this share of it counts as idle


def landing_samples(trace: Trace, barrier: bool, learner_idle: bool = False) -> tuple[float, ...] | None:
    """The run's measured landings in submission order, step by step; barrier: only those of trajectories that
    ended with at most one group still running in their step; learner_idle (a Sync target on shared cores): only
    those made while the fit run's learner was idle, when there are at least a group of them (module docstring,
    point 6). None without reward timing."""
    if not any(r["t_reward"] > r["t_done"] for r in trace.trajectories):
        return None
    if barrier and learner_idle:
        idle = _landings_with_learner_idle(trace)
        if idle is not None:
            return idle
    by_step: dict = {}
    for r in trace.trajectories:
        by_step.setdefault(r["step"], []).append(r)
    group = Counter(Counter(r["group_id"] for r in trace.trajectories).values()).most_common(1)[0][0]
    out: list[float] = []
    for step in sorted(by_step):
        recs = sorted(by_step[step], key=lambda r: r["t_submit"])
        start = np.asarray([r["t_submit"] for r in recs])  # [N]
        done = np.asarray([r["t_done"] for r in recs])  # [N]
        running = ((start[None, :] <= done[:, None]) & (done[None, :] > done[:, None])).sum(axis=1)  # [N] at each end
        keep = running <= group if barrier else np.ones(len(recs), dtype=bool)
        out += [r["t_reward"] - r["t_done"] for r, k in zip(recs, keep) if k]
    return tuple(out) or None


def _landings_with_learner_idle(trace: Trace) -> tuple[float, ...] | None:
    """Landings (submission order) during which the run's learner computed for < IDLE_LEARNER_SHARE of the time;
    None when fewer than a group of them."""
    recs = sorted(trace.trajectories, key=lambda r: (r["step"], r["t_submit"]))
    spans = np.asarray([(r["t_done"], r["t_reward"]) for r in recs], dtype=np.float64).reshape(-1, 2)  # [N, 2]
    busy = overlap_fraction(spans, learner_busy(trace))  # [N]
    keep = [float(b - a) for (a, b), share in zip(spans, busy) if b > a and share < IDLE_LEARNER_SHARE]
    group = Counter(Counter(r["group_id"] for r in trace.trajectories).values()).most_common(1)[0][0]
    return tuple(keep) if len(keep) >= group else None


def forward_call_costs(fit: tuple[Trace, Calibration, bool], train: CallCosts,
                       micro_batch: int | None) -> tuple[CallCosts, str]:
    """(a separate old-log-prob forward's CallCosts, where they come from: "forward records" or "rule"), from the
    fit run (trace, calibration, whether its Sync ran in bypass mode); point 3."""
    trace, calib, fit_bypass = fit
    if separate_forward(trace, fit_bypass):
        return fit_call_costs(trace, "forward", calib.contention, micro_batch), "forward records"
    return train.forward(), "rule"


def transfer_costs(fit: tuple[Trace, Calibration, bool], target: Trace, target_bypass: bool, gran: str,
                   micro_batch: int | None, token_scale: float = 1.0) -> LearnerCosts:
    """The fit run's learner costs for the target's configuration.

    fit: (trace, calibration, whether its Sync ran in bypass mode). gran: the target's replayed granularity.
    micro_batch None: each record is one call and a batch update pays one call per record of the target
    (traces written by the simulator's own cost model, whose records are its chunks). token_scale: the
    target's policy parameters over the fit run's (module docstring, point 7).
    """
    trace, calib, fit_bypass = fit
    train = fit_call_costs(trace, "backward", calib.contention, micro_batch)
    if train is None:
        raise ValueError(f"{trace.path}: no backward records, so the learner's cost cannot be fitted from this run; "
                         "fit on a run whose trainer recorded its updates (benchmarks/modes.py writes them)")
    fixed = fit_learner_costs(replace(trace, learner=[r for r in trace.learner if r["op"] != "forward"]),
                              calib.contention)
    calls = train
    if gran in ("batch", "mini_batch") and separate_forward(target, target_bypass):
        fwd = forward_call_costs(fit, train, micro_batch)[0]
        calls = CallCosts(train.call_s + fwd.call_s, train.row_s + fwd.row_s, train.token_s + fwd.token_s)
    call_s = calls.call_s
    if micro_batch is None and gran == "batch":
        call_s *= _records_per_step(target)
    same_trainer = parse_mode(trace.mode)[0] == parse_mode(target.mode)[0]
    split = target.algo == "opd" and gran == "turn"
    return replace(fixed, s_per_token=calls.token_s * token_scale, chunk_overhead_s=call_s,
                   s_per_row=calls.row_s / (micro_batch or 1), forward_s_per_token=0.0, forward_overhead_s=0.0,
                   step_gap_s=calib.step_gap_s if same_trainer else 0.0,
                   prefix_recompute=split and records_recompute_prefix(target))


def unmeasured_terms(fit: tuple[Trace, Calibration], target: Trace, target_mode: str, gran: str,
                     target_bypass: bool = False, fit_bypass: bool = False) -> dict[str, str]:
    """term -> why: what the target's configuration exercises that the fit run did not measure (point 8).

    Reads the fit run's records and calibration and the target's mode, granularity and configuration only
    (target_bypass, fit_bypass: that run's Sync ran in verl's bypass mode, no separate old-log-prob forward).
    """
    trace, calib = fit
    fit_mode = parse_mode(trace.mode)[0]
    streamed = target_mode == "thundersync" and gran not in ("batch", "mini_batch")
    out = {}
    if streamed and _one_call_per_step(trace):
        out["learner_calls"] = (f"the fit run ({fit_mode}) writes one learner update per step, so a call's overhead "
                                "cannot be told from its rows' host work; the streamed target's calls are priced 0 each")
    if target_mode != "sync" and calib.contention_ops == 0:  # its learner overlaps its rollouts (point 4)
        out["learner_slowdown"] = (f"no learner op of the fit run ({fit_mode}) ran while its rollouts did, so the "
                                   f"target's learner, which does, runs at its alone speed (slowdown 1)")
    if target_mode in STREAMING_DRIVERS and not calib.reward_timing:
        out["landing_under_load"] = (f"the fit run ({fit_mode}) records no reward timing: one landing latency "
                                     f"({calib.landing_s:.3f} s) fitted at its barrier is dealt to every trajectory "
                                     "of a target that lands them while the rest of its batch still runs")
    if target_mode == "fully_async" and fit_mode != "fully_async":
        out["update_bookkeeping"] = (f"the fit run ({fit_mode}) never runs verl's Fully Async trainer, which samples "
                                     "its buffer, extracts rewards, balances the batch and computes advantages on "
                                     "its driver for every mini-batch update; that driver work is priced 0")
    if gran in ("batch", "mini_batch") and separate_forward(target, target_bypass) \
            and not separate_forward(trace, fit_bypass):
        out["old_log_prob_forward"] = (f"the fit run ({fit_mode}) runs no separate forward, so the target's old-log-prob "
                                       "forward is priced by rule (half the per-row host work, a third of the "
                                       "per-token compute)")
    if target.algo == "opd" and gran == "turn" and calib.turn_latency_s is None:
        out["turn_latency"] = (f"the fit run ({fit_mode}) does not stream turns, so the teacher's per-turn scoring "
                               "latency is unmeasured; each turn trains as soon as it is generated")
    return out


def _one_call_per_step(trace: Trace) -> bool:
    """The run's backward records are one per step with no `rows` (a batch trainer's update)."""
    recs = [r for r in trace.learner if r["op"] == "backward"]
    return bool(recs) and _records_per_step(trace) == 1 and not any(isinstance(r.get("rows"), int) for r in recs)


def _records_per_step(trace: Trace) -> int:
    counts = Counter(r["step"] for r in trace.learner if r["op"] == "backward")
    return max(1, round(float(np.median(list(counts.values()))))) if counts else 1
