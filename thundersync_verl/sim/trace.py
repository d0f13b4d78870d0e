"""Recorded traces: load the trainer's JSONL event log, fit learner costs, replay trajectories.

Why this module exists:
1. The simulator must be checked against real runs. The trainer writes one JSON object per
   line (times in seconds from any common origin):
   - {"kind": "trajectory", "mode", "algo", "step", "group_id", "traj_id", "t_submit",
      "t_done", "t_reward", "turns": [{"gen_s", "gen_tokens", "tool_s", "prompt_tokens"}],
      "reward_s", "response_tokens", "prompt_tokens", "policy_version"[, "learner_version"]}
     turns[j].prompt_tokens is the context length passed to the engine for turn j (the
     prompt plus everything before that turn), so turn j added
     prompt_tokens[j] - prompt_tokens[j-1] - gen_tokens[j-1] tool-output tokens;
     the learner trains prompt_tokens + response_tokens tokens; step is the learner step
     that trained the trajectory; t_reward is when the trainer had the finished trajectory
     (t_reward == t_done everywhere: the trace has no reward timing); for OPD, reward_s is
     the teacher's total scoring latency (spread over the turns on replay unless the turn
     latency is measured, calibrate.fit_turn_latency).
   - {"kind": "learner", "mode", "step", "lane", "op": forward|backward|optimizer|
      weight_sync|other, "t0", "t1", "tokens"[, "rows"]}
     tokens: what the op computed; rows (optional): the units (trajectories, or OPD turn rows)
     it trained. An OPD turn row streamed by ThunderSync is the trajectory prefix up to the
     end of its turn, recomputed with grad, so its tokens are the whole prefix's; a trainer
     with fused old log-probs writes no forward records (that forward is in each backward).
   - {"kind": "step", "mode", "algo", "step", "t_start", "t_end", "n_rollout_slots"}
2. Replay keeps the recorded durations (per-turn generation and tool time, landing latency
   t_reward - t_done, slot count) and lets the simulator decide WHEN things run; the
   learner's cost per token and per chunk are fitted from its own records (time = overhead +
   cost * tokens). What the records leave out is measured from them too (calibrate.py), and
   durations measured while rollout and learner shared the cores are replayed at their
   alone speed, the simulator re-applying the slowdown where its schedule overlaps them.
3. The measured step time uses the same definition as the simulator (mean spacing of step
   ends after the first step), so the comparison is like for like.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from thundersync_verl.sim.calibrate import (Calibration, calibrate, decode_scale, fit_line, op_overlap, push_intervals,
                        slot_residual)
from thundersync_verl.sim.sim_config import MODES, SimConfig
from thundersync_verl.sim.hardware import LearnerCosts, SharedCores
from thundersync_verl.sim.workload import Batch, batch_from_turns

TRAJ_KEYS = {"mode": str, "algo": str, "step": int, "group_id": str, "traj_id": str, "t_submit": float,
             "t_done": float, "t_reward": float, "turns": list, "reward_s": float, "response_tokens": int,
             "prompt_tokens": int, "policy_version": int}  # learner_version is optional (not replayed)
TURN_KEYS = {"gen_s": float, "gen_tokens": int, "tool_s": float, "prompt_tokens": int}
LEARNER_KEYS = {"mode": str, "step": int, "lane": str, "op": str, "t0": float, "t1": float, "tokens": int}
STEP_KEYS = {"mode": str, "algo": str, "step": int, "t_start": float, "t_end": float, "n_rollout_slots": int}
LEARNER_OPS = ("forward", "backward", "optimizer", "weight_sync", "other")


@dataclass
class Trace:
    path: str
    trajectories: list = field(default_factory=list)
    learner: list = field(default_factory=list)
    steps: list = field(default_factory=list)

    @property
    def mode(self) -> str:
        return _most_common([s["mode"] for s in self.steps] or [t["mode"] for t in self.trajectories])

    @property
    def algo(self) -> str:
        return _most_common([s["algo"] for s in self.steps] or [t["algo"] for t in self.trajectories])


def _most_common(values: list) -> str:
    return Counter(values).most_common(1)[0][0] if values else ""


def _check(rec: dict, keys: dict, where: str) -> None:
    for key, typ in keys.items():
        if key not in rec:
            raise ValueError(f"{where}: missing key {key!r}. The trace schema (sim/trace.py) needs {sorted(keys)} "
                             "so replay can rebuild every duration; re-run the trainer with event logging on")
        val = rec[key]
        ok = isinstance(val, (int, float)) and not isinstance(val, bool) if typ is float else isinstance(val, typ)
        if not ok:
            raise ValueError(f"{where}: key {key!r} should be {typ.__name__}, got {val!r}; fix the writer")


def load_trace(path) -> Trace:
    """Parse and validate one JSONL trace file."""
    trace = Trace(str(path))
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc}); each line must be one JSON object") from exc
            kind = rec.get("kind")
            if kind == "trajectory":
                _check(rec, TRAJ_KEYS, where)
                for j, turn in enumerate(rec["turns"]):
                    _check(turn, TURN_KEYS, f"{where} turn {j}")
                if not rec["turns"]:
                    raise ValueError(f"{where}: a trajectory needs at least one turn")
                trace.trajectories.append(rec)
            elif kind == "learner":
                _check(rec, LEARNER_KEYS, where)
                if rec["op"] not in LEARNER_OPS:
                    raise ValueError(f"{where}: op {rec['op']!r} is not one of {LEARNER_OPS}")
                trace.learner.append(rec)
            elif kind == "step":
                _check(rec, STEP_KEYS, where)
                trace.steps.append(rec)
            else:
                raise ValueError(f"{where}: kind {kind!r} must be trajectory, learner or step")
    if not trace.steps or not trace.trajectories:
        raise ValueError(f"{path}: a trace needs step and trajectory records to be replayed")
    return trace


def write_trace(path, records) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")


# ------------------------------------------------------------------ measured figures
def measured_step_time(trace: Trace, warmup_steps: int = 1) -> float:
    """Mean spacing of step ends after warm-up (the simulator's definition)."""
    ends = np.sort(np.asarray([s["t_end"] for s in trace.steps], dtype=np.float64))
    if len(ends) <= warmup_steps:
        raise ValueError(f"{trace.path}: {len(ends)} steps recorded; need more than {warmup_steps} (warm-up)")
    return float((ends[-1] - ends[warmup_steps - 1]) / (len(ends) - warmup_steps))


def fit_learner_costs(trace: Trace, contention: float = 1.0, split_forward: bool = False) -> LearnerCosts:
    """Per-token and per-chunk costs from forward/backward records; means for the rest.

    contention > 1: each compute op's duration is first divided by 1 + (contention - 1) x the
    share of it during which the rollout engine decoded (calibrate.py), giving its cost alone.
    split_forward: keep forward records (a landed trajectory's log-probs) as separate costs, for a
    learner that streams OPD turns; otherwise forward and backward add up per chunk.
    """
    by_op: dict[str, list] = {op: [] for op in LEARNER_OPS}
    for r in trace.learner:
        by_op[r["op"]].append(r)

    def secs(recs: list) -> np.ndarray:
        sec = np.asarray([r["t1"] - r["t0"] for r in recs], dtype=np.float64)
        if contention > 1.0 and recs:
            sec = sec / (1.0 + (contention - 1.0) * op_overlap(trace, recs))
        return sec

    fit = {}
    for op in ("forward", "backward"):
        recs = by_op[op]
        fit[op] = fit_line(np.asarray([r["tokens"] for r in recs], dtype=np.float64), secs(recs))
    lanes = max(1, len({r["lane"] for r in by_op["backward"] or by_op["forward"]}))
    n_steps = max(1, len(trace.steps))

    def mean(op: str) -> float:
        return float(np.mean(secs(by_op[op]) if op != "weight_sync" else
                             [r["t1"] - r["t0"] for r in by_op[op]])) if by_op[op] else 0.0

    other = float(secs(by_op["other"]).sum()) / n_steps
    split = split_forward and bool(by_op["forward"]) and bool(by_op["backward"])
    (fa, fb), (ba, bb) = fit["forward"], fit["backward"]
    return LearnerCosts(s_per_token=bb if split else fb + bb, chunk_overhead_s=ba if split else fa + ba,
                        forward_s_per_token=fb if split else 0.0, forward_overhead_s=fa if split else 0.0,
                        optimizer_s=mean("optimizer"), weight_sync_s=mean("weight_sync"), step_overhead_s=other,
                        dp=lanes)


# ------------------------------------------------------------------------- replay
def parse_mode(mode: str) -> tuple[str, str | None]:
    """'thundersync', 'thundersync:group' or 'thundersync_group' -> (mode, granularity)."""
    for sep in (":", "/"):
        if sep in mode:
            base, gran = mode.split(sep, 1)
            return base, gran
    if mode in MODES:
        return mode, None
    for base in sorted(MODES, key=len, reverse=True):
        if mode.startswith(base + "_") or mode.startswith(base + "-"):
            return base, mode[len(base) + 1:]
    raise ValueError(f"mode {mode!r} is not one of {MODES} (optionally with ':granularity'); fix the trace")


class TraceSource:
    """Batches rebuilt from a trace.

    Barrier modes: batch k = the trajectories the k-th recorded learner step trained (a step
    that holds m whole batches, e.g. an off-policy trainer's warm-up, is split in submission
    order). stream=True (fully_async, or a trainer that pushed weights mid-rollout): batch k =
    the k-th run of batch_size trajectories in submission order, so the replayed stream starts
    trajectories in the order the trainer did.
    calib (replay): each trajectory's slot residual is added after its last turn, its landing
    latency is t_reward - t_done (or the fitted one when the trace has no reward timing, or
    another run's landings dealt in order out of sample: Calibration.landing_samples), and
    each turn's gen_s is divided by the slowdown it ran under (calibrate.py).
    """

    def __init__(self, trace: Trace, stream: bool | None = None, calib: Calibration | None = None):
        self.trace, self.calib = trace, calib
        by_step: dict = {}
        for t in trace.trajectories:
            by_step.setdefault(t["step"], []).append(t)
        sizes = Counter(len(v) for v in by_step.values())
        self.batch_size = n = sizes.most_common(1)[0][0]
        if stream if stream is not None else parse_mode(trace.mode)[0] == "fully_async":
            recs = sorted(trace.trajectories, key=lambda r: r["t_submit"])
            by_step = {k: recs[k * n:(k + 1) * n] for k in range(len(recs) // n)}
        else:
            split = {}
            for k in sorted(by_step):
                recs = sorted(by_step[k], key=lambda r: r["t_submit"])
                parts = len(recs) // n if len(recs) % n == 0 else 1
                for j in range(parts):
                    split[(k, j)] = recs[j * n:(j + 1) * n] if parts > 1 else recs
            by_step = split
        self.steps = [k for k in sorted(by_step) if len(by_step[k]) == n]
        self.dropped_steps = sorted({k[0] if isinstance(k, tuple) else k for k in set(by_step) - set(self.steps)})
        self._by_step = by_step
        groups = Counter(t["group_id"] for t in trace.trajectories)
        self.group_size = Counter(groups.values()).most_common(1)[0][0]
        self.algo = trace.algo
        self._scale = decode_scale(trace, calib.rollout_contention) if calib is not None else {}
        self._pushes = push_intervals(trace)

    def batch(self, index: int) -> Batch:
        recs = sorted(self._by_step[self.steps[index % len(self.steps)]], key=lambda r: r["t_submit"])
        gids = {g: i for i, g in enumerate(dict.fromkeys(r["group_id"] for r in recs))}
        turns = [r["turns"] for r in recs]
        n_turns = np.asarray([len(t) for t in turns], dtype=np.int64)
        flat = [x for t in turns for x in t]
        gen_s = np.asarray([x["gen_s"] for x in flat], dtype=np.float64)
        tool_s = np.asarray([x["tool_s"] for x in flat], dtype=np.float64)
        gen_tok = np.asarray([x["gen_tokens"] for x in flat], dtype=np.int64)
        ctx = np.asarray([x["prompt_tokens"] for x in flat], dtype=np.int64)
        seq = np.asarray([r["prompt_tokens"] + r["response_tokens"] for r in recs], dtype=np.int64)
        new_tok = _new_tokens(ctx, gen_tok, n_turns, seq)
        reward = np.asarray([r["reward_s"] for r in recs], dtype=np.float64)
        score = np.repeat(reward / n_turns, n_turns) if self.algo == "opd" else np.zeros(len(flat))
        group = np.asarray([gids[r["group_id"]] for r in recs], dtype=np.int64)
        land = None
        if self.calib is not None:
            if self._scale:
                gen_s = gen_s / np.concatenate([self._scale[id(r)] for r in recs])
            tool_s[np.cumsum(n_turns) - 1] += [slot_residual(r, self._pushes) for r in recs]  # after the last turn
            land = (np.asarray([r["t_reward"] - r["t_done"] for r in recs], dtype=np.float64)
                    if self.calib.reward_timing else np.full(len(recs), self.calib.landing_s))
            if not self.calib.reward_timing and self.calib.landing_samples:  # dealt in order, batch after batch
                dealt = np.asarray(self.calib.landing_samples, dtype=np.float64)
                land = dealt[(index * len(recs) + np.arange(len(recs))) % len(dealt)]
        batch = batch_from_turns(group, len(gids), n_turns, gen_s, tool_s, new_tok, gen_tok, score, reward, seq)
        if self.algo == "opd" and self.calib is not None and self.calib.turn_latency_s is not None:
            # measured turn latency, at most until the slot frees (the agent loop returns after its turns are scored)
            left = np.repeat(batch.dur_s, n_turns) - batch.turn_end_s  # [M] generation end -> slot end
            score = np.minimum(self.calib.turn_latency_s, np.maximum(left, 0.0))
            batch = replace(batch, turn_score_s=score, last_score_s=score[batch.turn_ptr[1:] - 1])
        return replace(batch, land_s=land) if land is not None else batch


def _new_tokens(ctx: np.ndarray, gen: np.ndarray, n_turns: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Tokens each turn adds before decoding; the last turn absorbs any gap to the trained length."""
    ptr = np.concatenate([[0], np.cumsum(n_turns)])
    new = np.empty_like(ctx)
    new[:] = ctx
    rest = np.ones(len(ctx), dtype=bool)
    rest[ptr[:-1]] = False
    idx = np.flatnonzero(rest)
    new[idx] = np.maximum(ctx[idx] - ctx[idx - 1] - gen[idx - 1], 0)
    total = np.add.reduceat(new + gen, ptr[:-1])  # [N]
    last = ptr[1:] - 1
    new[last] = np.maximum(new[last] + (seq - total), 0)
    return new


def replay_config(trace: Trace, source: TraceSource, warmup_steps: int = 1, mode: str | None = None,
                  calib: Calibration | None = None) -> SimConfig:
    """The SimConfig that replays a trace: its mode, slots, chunking, mini-batching, staleness bound
    and, with a calibration, the measured slots and shared cores."""
    recorded, gran = parse_mode(trace.mode)
    mode = mode or recorded
    slots = calib.slots if calib is not None else max(s["n_rollout_slots"] for s in trace.steps)
    per_step = _backward_records_per_step(trace)
    mini = max(source.group_size, source.batch_size // per_step) if mode == "fully_async" else None
    threshold = _gate_threshold(trace, source.batch_size) if mode == "fully_async" else 1.0
    shared = None
    if calib is not None and max(calib.contention, calib.rollout_contention) > 1:
        shared = SharedCores(rollout_slowdown=calib.rollout_contention, learner_slowdown=calib.contention)
    cfg = SimConfig(mode=mode, algo=trace.algo, granularity=gran if mode == recorded else None,
                    steps=len(source.steps), warmup_steps=warmup_steps, rollout_slots=slots, mini_batch=mini,
                    staleness_threshold=threshold, min_chunk=1, shared_cores=shared)
    return replace(cfg, max_chunk=_largest_chunk(trace, source, cfg)) if mode == "thundersync" else cfg


def replay_calibration(trace: Trace) -> tuple[str, Calibration]:
    """(simulator mode, calibration): a trainer that pushed weights mid-rollout replays as streaming."""
    mode, _ = parse_mode(trace.mode)
    plain = TraceSource(trace)
    stream = mode == "fully_async"
    first = max(plain.group_size, plain.batch_size // _backward_records_per_step(trace)) if stream else plain.batch_size
    calib = calibrate(trace, mode, plain.batch_size, first, max(s["n_rollout_slots"] for s in trace.steps))
    if mode == "async" and calib.partial_rollout:
        mode = "fully_async"
        first = plain.batch_size // _backward_records_per_step(trace)
        calib = calibrate(trace, mode, plain.batch_size, max(plain.group_size, first), calib.slots)
        calib = replace(calib, partial_rollout=True)
    return mode, calib


def replay(trace: Trace, warmup_steps: int = 1) -> tuple[SimConfig, TraceSource, LearnerCosts]:
    """Config, batches and fitted costs that replay a trace, with the per-chunk overhead
    scaled to the trainer's chunking: a batch-granularity step that the trainer ran as R
    backward records pays R record overheads in its single simulated chunk. The trace's own
    calibration (calibrate.py) adds what its records leave out."""
    mode, calib = replay_calibration(trace)
    source = TraceSource(trace, stream=mode == "fully_async", calib=calib)
    cfg = replay_config(trace, source, warmup_steps, mode, calib)
    split = trace.algo == "opd" and cfg.resolved_granularity() == "turn"
    costs = replace(fit_learner_costs(trace, calib.contention, split_forward=split), step_gap_s=calib.step_gap_s,
                    prefix_recompute=split and records_recompute_prefix(trace))
    if cfg.resolved_granularity() == "batch":
        costs = replace(costs, chunk_overhead_s=costs.chunk_overhead_s * _backward_records_per_step(trace))
    return cfg, source, costs


def _backward_records_per_step(trace: Trace) -> int:
    counts = Counter(r["step"] for r in trace.learner if r["op"] == "backward")
    return max(1, round(float(np.median(list(counts.values()))))) if counts else 1


def records_recompute_prefix(trace: Trace) -> bool:
    """Whether the backward records' tokens count each OPD turn row as its whole prefix.

    A trainer that streams OPD turns by recomputing the prefix trains, per trajectory, the prefix up
    to the end of each turn: its records add up to the sum over turns of the turn's context plus its
    generated tokens (~(K + 1) / 2 x the trajectory for K turns), not to the trajectory lengths. The
    per-token cost fitted from those records is then a cost per prefix token, and the replay must
    cost each turn as its prefix (LearnerCosts.prefix_recompute).
    """
    trained = sum(r["tokens"] for r in trace.learner if r["op"] == "backward")
    prefixes = sum(t["prompt_tokens"] + t["gen_tokens"] for r in trace.trajectories for t in r["turns"])
    whole = sum(r["prompt_tokens"] + r["response_tokens"] for r in trace.trajectories)
    return prefixes > whole and abs(trained - prefixes) < abs(trained - whole)


def _largest_chunk(trace: Trace, source: TraceSource, cfg: SimConfig) -> int | None:
    """The trainer's largest chunk: OPD turn rows per record when the records count them, else 1 when
    the trainer streamed one unit per backward record, else None (all ready units).

    The OPD turn planner trains every ready turn in chunks of at most max_chunk_size rows; records with
    `rows` show that cap. Without rows, the record count tells the two other policies apart.
    """
    batch = source.batch(0)
    turns = cfg.resolved_granularity() == "turn"
    rows = [r.get("rows") for r in trace.learner if r["op"] == "backward"]
    if turns and cfg.algo == "opd" and rows and all(isinstance(n, int) and n > 0 for n in rows):
        return max(rows)
    units = len(batch.turn_lo) if turns else batch.size
    return 1 if _backward_records_per_step(trace) >= 0.9 * units else None


def _gate_threshold(trace: Trace, batch_size: int) -> float:
    """Smallest staleness threshold whose start gate admits every recorded start.

    The gate admits start number i (0-based, in t_submit order) on weights v when
    i < (v + 1 + threshold) * batch_size.
    """
    recs = sorted(trace.trajectories, key=lambda r: r["t_submit"])
    need = [(i + 1) / batch_size - r["policy_version"] - 1 for i, r in enumerate(recs)]
    return max(0.0, max(need))


def find_traces(trace_dir) -> list[Path]:
    """<mode>.jsonl or <algo>_<mode>.jsonl files in trace_dir, sorted."""
    d = Path(trace_dir)
    return sorted(p for p in d.glob("*.jsonl") if p.is_file()) if d.is_dir() else []
