"""Validate the simulator against real runs: replay recorded traces, compare step times.

Why:
1. A simulator's scale-out claims rest on it predicting runs it can be checked against.
   For each recorded trace (one per mode) this fits the learner's per-token and per-chunk
   costs, optimizer and weight-push times from the trace's own learner records, measures
   what the records leave out (sim/calibrate.py: landing latency when the trace has no
   reward timing, driver time between steps, slot residual, slots in flight, partial
   rollout, how much rollout and learner slow each other down on shared cores), replays
   the recorded trajectories through the simulator in the trace's mode, and compares the
   simulated mean step time with the measured one. No parameter is fitted to a step time.
2. Printed per trace: the fitted parameters, and measured vs simulated step time with the
   same breakdown of each steady step: seconds with only rollouts in flight, only the
   learner working, both, and neither (handoffs, gaps).
3. Traces are <mode>.jsonl or <algo>_<mode>.jsonl files written by the trainer
   (`python benchmarks/modes.py` writes them to benchmarks/results/traces/, the default --trace-dir).
4. --self-test runs the same pipeline on synthetic traces (NOT measurements) to show the
   replay machinery is exact; it writes no result file.
5. --out-of-sample: every trace is predicted from costs fitted on ANOTHER run, without refitting
   (``fit_per_family``). A family is one kind of machine: the emulated-device runs (the rollout on its own
   device, ``modes.py --rollout emulated``, one family per workload, as each workload has its own policy
   model and verifier) and the two-shared-core runs (``modes.py``, GRPO and OPD apart: their learners
   differ). In each family the ThunderSync run is the fit for every other trace (its learner records
   many calls of 1 to a few rows and of different lengths, which separates a call's overhead, its
   per-row host work and its per-token compute; a Sync trace has one update per step and cannot), and
   the family's Sync run predicts the ThunderSync run. A target contributes only its workload (its
   trajectories' turns, tokens, tool times) and its configuration (mode, slots, micro-batch size, Fully
   Async's mini-batches, whether its learner runs a separate old-log-prob forward, the policy's size);
   everything the system costs is the fit run's (sim/transfer.py: learner calls, the old-log-prob
   forward, the learner's slowdown beside the rollouts, step gap, landings). Printed per target: measured vs
   predicted step time and the per-step breakdown of point 2. --fit TRACE predicts --targets from one
   trace instead.
6. A prediction can rest on a term its fit run never measured (sim/transfer.py, point 8: a batch
   trainer's one update per step prices no streamed call, its learner never ran beside its rollouts,
   it records no per-trajectory landing nor OPD turn latency). Each target lists those terms under
   ``unmeasured``; each family and the result give ``max_abs_rel_err`` over every prediction and
   ``max_abs_rel_err_measured_terms`` over the predictions whose every term the fit run measured.
7. Repeated --fit (runs of the same configuration, e.g. two ThunderSync runs an hour apart): each fit predicts the
   same targets, and ``fit_to_fit_spread`` gives per target how far the predictions land apart (max / min - 1).
   The fits differ only in the machine's state while each ran, so no single prediction can be trusted closer than
   that (``simulate_validate_out_of_sample_fits.json``).
8. --paired DIR ...: each folder holds one ``modes.py --rollout emulated --modes MODE,thundersync`` run, the two
   modes recorded back to back; its ThunderSync run predicts MODE and, where MODE is a Sync, MODE predicts the
   ThunderSync run. Every prediction is still of another run (another mode) from costs fitted on one run, without
   refitting; what the pairing removes is the machine's drift between a fit and its target (point 7), which no
   model of the system can know (``simulate_validate_out_of_sample_paired.json``).
9. The machine's own drift, told apart: an emulated-device run records beside each mode the time of a fixed training
   step of its policy on the learner's core, taken between the runs (meta.json ``machine_probe_s``,
   ``thundersync_harness.machine_probe``). Each prediction is also given with the fit's learner-core costs
   (per token, per row, per call, optimizer, weight push, step gap) times the target's probe over the fit's:
   ``rel_err_at_machine_speed`` per target and ``max_abs_rel_err_at_machine_speed`` per family. The probe knows
   nothing of the target's mode, workload or timings; the raw ``max_abs_rel_err_out_of_sample`` stays the headline.
Run: python benchmarks/simulate_validate.py [--trace-dir DIR] [--quick] [--self-test]
     python benchmarks/simulate_validate.py --out-of-sample [--fit TRACE ...] [--targets DIR ...] [--paired DIR ...]
         [--family NAME=DIR ...] [--save-as NAME]   (each cited file's own command: docs/results.md)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from thundersync_verl.sim.sim_engine import simulate
from thundersync_verl.sim.metrics import LEARNER_WORK_KINDS, activity_split, format_table
from thundersync_verl.sim.calibrate import landing_latency, transferred
from thundersync_verl.sim.trace import (TraceSource, find_traces, load_trace, measured_step_time, replay,
                                        replay_calibration, replay_config)
from thundersync_verl.sim.transfer import (RunSettings, fit_call_costs, fit_fused_forward, forward_call_costs,
                                           landing_samples, record_rows, transfer_costs, unmeasured_terms)
from thundersync_verl.sim.run_meta import (at_machine_speed as at_speed, is_bypass, rollout_on_own_device, speed_ratio,
                                           token_scale)
from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result

SCRIPT = Path(__file__).stem
PRODUCER = "python benchmarks/modes.py"




SPLIT = ("rollout_only", "learner_only", "both", "neither")


def _per_step(split: dict, steps: int) -> dict:
    return {k: v / max(steps, 1) for k, v in split.items()}


def measured_split(trace) -> dict:
    ends = np.sort([s["t_end"] for s in trace.steps])
    roll = np.asarray([(r["t_submit"], r["t_done"]) for r in trace.trajectories]).reshape(-1, 2)
    learn = np.asarray([(r["t0"], r["t1"]) for r in trace.learner]).reshape(-1, 2)
    return _per_step(activity_split(roll, learn, ends[0], ends[-1]), len(ends) - 1)


def simulated_split(res) -> dict:
    tl, w = res.timeline, res.warmup_steps
    roll = np.asarray([(t0, t1) for _s, t0, t1, _b, _i in tl["rollout"]]).reshape(-1, 2)
    learn = np.asarray([(t0, t1) for t0, t1, kind, _n in tl["learner"] if kind in LEARNER_WORK_KINDS]).reshape(-1, 2)
    return _per_step(activity_split(roll, learn, res.step_end[w - 1], res.step_end[-1]), len(res.step_end) - w)


def validate_file(path: Path) -> dict:
    trace = load_trace(path)
    sim_mode, calib = replay_calibration(trace)
    cfg, source, costs = replay(trace)
    res = simulate(replace(cfg, record_timeline=True), source, costs)
    measured = measured_step_time(trace)
    return {"file": path.name, "mode": trace.mode, "sim_mode": sim_mode, "algo": trace.algo,
            "steps": len(source.steps), "batch": source.batch_size, "slots": cfg.rollout_slots,
            "s_per_token": costs.s_per_token, "chunk_overhead_s": costs.chunk_overhead_s,
            "forward_s_per_token": costs.forward_s_per_token, "optimizer_s": costs.optimizer_s,
            "weight_sync_s": costs.weight_sync_s, "calibration": calib.summary(),
            "measured_s": measured, "simulated_s": res.step_time_s, "rel_err": res.step_time_s / measured - 1.0,
            "measured_split": measured_split(trace), "simulated_split": simulated_split(res),
            "dropped_steps": source.dropped_steps}


def step_time_rel_se(trace, warmup_steps: int = 1) -> float:
    """Relative standard error of a run's mean step time (spacing of its steady step ends): how far a second
    recording of the same run could land, to read a prediction's error against (never an input to one)."""
    gaps = np.diff(np.sort([s["t_end"] for s in trace.steps])[warmup_steps - 1:])
    return float(gaps.std(ddof=1) / np.sqrt(len(gaps)) / gaps.mean()) if len(gaps) > 1 else float("nan")


def predict_file(path: Path, fit, settings: RunSettings, at_machine_speed: bool = False) -> dict:
    """Out of sample: the target's workload and configuration, the fit run's costs (module docstring, point 5).
    at_machine_speed: the learner core's costs times the probes' ratio (point 9); a row without probes is None."""
    fit_trace, fit_calib, fit_path = fit
    speed = speed_ratio(fit_path, path)
    if at_machine_speed and speed is None:
        return None
    trace = load_trace(path)
    sim_mode, own = replay_calibration(trace)
    calib = transferred(own, fit_calib, landing_latency(fit_trace, fit_calib))
    calib = replace(calib, landing_samples=landing_samples(fit_trace, barrier=sim_mode in ("sync", "async"),
                                                           learner_idle=sim_mode == "sync"
                                                           and not rollout_on_own_device(fit_path)))
    source = TraceSource(trace, stream=sim_mode == "fully_async", calib=calib)
    cfg = replay_config(trace, source, 1, sim_mode, calib)
    if sim_mode == "fully_async" and settings.fully_async_mini_batch:
        cfg = replace(cfg, mini_batch=settings.fully_async_mini_batch)
    costs = transfer_costs((fit_trace, fit_calib, is_bypass(fit_path)), trace, is_bypass(path),
                           cfg.resolved_granularity(), settings.micro_batch, token_scale(fit_path, path))
    if at_machine_speed:
        costs = at_speed(costs, speed)
    res = simulate(replace(cfg, record_timeline=True), source, costs)
    measured = measured_step_time(trace)
    unmeasured = unmeasured_terms((fit_trace, fit_calib), trace, sim_mode, cfg.resolved_granularity(),
                                  target_bypass=is_bypass(path), fit_bypass=is_bypass(fit_path))
    return {"file": str(path), "fit": str(fit_path), "mode": trace.mode, "sim_mode": sim_mode, "measured_s": measured,
            "predicted_s": res.step_time_s, "rel_err": res.step_time_s / measured - 1.0, "unmeasured": unmeasured,
            "old_log_prob_forward": None if is_bypass(path) else forward_check(fit, trace, settings,
                                                                               token_scale(fit_path, path)),
            "measured_rel_se": step_time_rel_se(trace), "machine_speed_ratio": speed,
            "measured_split": measured_split(trace), "predicted_split": simulated_split(res)}


def forward_check(fit, trace, settings: RunSettings, scale: float) -> dict | None:
    """The target's own old-log-prob forward records against the fit's forward costs applied to them, per steady
    step (read after the prediction, never an input to it; sim/transfer.py, point 9); None without such records."""
    fit_trace, fit_calib, fit_path = fit
    recs = [r for r in trace.learner if r["op"] == "forward" and r["step"] > 1]
    train = fit_call_costs(fit_trace, "backward", fit_calib.contention, settings.micro_batch)
    if not recs or train is None or settings.micro_batch is None:
        return None
    fwd, source = forward_call_costs((fit_trace, fit_calib, is_bypass(fit_path)), train, settings.micro_batch)
    timed = fit_fused_forward(fit_trace, train, fit_calib.contention, settings.micro_batch)
    rows = record_rows(trace, recs, settings.micro_batch)
    steps = len({r["step"] for r in recs})

    def per_step(c) -> float:
        return round(sum(c.call_s + c.row_s * n + c.token_s * scale * r["tokens"] for r, n in zip(recs, rows)) / steps, 3)

    return {"priced_by": source, "measured_s_per_step": round(sum(r["t1"] - r["t0"] for r in recs) / steps, 3),
            "predicted_s_per_step": per_step(fwd), "timed_forwards_s_per_step": per_step(timed) if timed else None}


def trace_digest(path: Path) -> str:
    """The replayed trace's content digest (sha256, 16 hex digits), kept beside its figures: a result file whose
    traces were re-recorded since no longer matches them (``tests/sim/test_out_of_sample_on_cpu.py``)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def trace_digests(paths) -> dict[str, str]:
    """``trace_digest`` of each trace, keyed by its path in the repository (symlinks resolved) where it lies there,
    so that the guard test finds every replayed trace whatever folder the command named."""
    repo = Path(__file__).resolve().parents[1]
    out = {}
    for p in sorted({Path(q).resolve() for q in paths}):
        out[str(p.relative_to(repo)) if p.is_relative_to(repo) else str(p)] = trace_digest(p)
    return out


def _short(path) -> str:
    return "/".join(Path(path).parts[-3:])


def print_out_of_sample(rows: list[dict]) -> None:
    table = [[_short(r["file"]), Path(r["fit"]).stem, r["sim_mode"], r["measured_s"], r["predicted_s"],
              f"{100 * r['rel_err']:+.1f}%"] + [f"{r['measured_split'][k]:.2f} / {r['predicted_split'][k]:.2f}"
                                                 for k in SPLIT] for r in rows]
    print("Out of sample, per steady step, measured / predicted seconds: rollouts only, learner only, both, neither:")
    print(format_table(table, ["trace", "fitted on", "replayed as", "measured_s", "predicted_s", "rel_err",
                               "R only", "L only", "both", "neither"]))
    for r in rows:
        if r["unmeasured"]:
            print(f"  {_short(r['file'])}: not measured by its fit: {', '.join(r['unmeasured'])}")
        fwd = r.get("old_log_prob_forward")
        if r.get("rel_err_at_machine_speed") is not None:
            print(f"  {_short(r['file'])}: machine {r['machine_speed_ratio']:.3f}x the fit run's time for the probe; "
                  f"at that speed {r['predicted_s_at_machine_speed']:.2f} s predicted, "
                  f"{100 * r['rel_err_at_machine_speed']:+.1f}%")
        if fwd:
            timed = fwd.get("timed_forwards_s_per_step")
            print(f"  {_short(r['file'])}: old-log-prob forward {fwd['measured_s_per_step']:.2f} s measured, "
                  f"{fwd['predicted_s_per_step']:.2f} s priced per step ({fwd['priced_by']})"
                  + (f", {timed:.2f} s from the fit's timed forwards" if timed is not None else ""))


def _max_err(rows: list[dict], measured_only: bool = False) -> float | None:
    """Largest |rel_err| over rows (measured_only: over those whose every term the fit run measured; None if none)."""
    errs = [abs(r["rel_err"]) for r in rows if not (measured_only and r["unmeasured"])]
    return round(max(errs), 4) if errs else None


def _max_err_at_speed(rows: list[dict]) -> float | None:
    """Largest |rel_err| with the learner core's costs at the target run's machine speed (point 9); None unless
    every row has its probes."""
    errs = [r.get("rel_err_at_machine_speed") for r in rows]
    return round(max(abs(e) for e in errs), 4) if errs and None not in errs else None


def _target_entry(r: dict) -> dict:
    return {"fit": _short(r["fit"]), "measured_s": round(r["measured_s"], 4), "predicted_s": round(r["predicted_s"], 4),
            "rel_err": round(r["rel_err"], 4), "measured_rel_se": round(r["measured_rel_se"], 4),
            **({"machine_speed_ratio": round(r["machine_speed_ratio"], 4),
                "predicted_s_at_machine_speed": round(r["predicted_s_at_machine_speed"], 4),
                "rel_err_at_machine_speed": round(r["rel_err_at_machine_speed"], 4)}
               if r.get("rel_err_at_machine_speed") is not None else {}),
            "unmeasured": r["unmeasured"], "old_log_prob_forward": r.get("old_log_prob_forward"),
            "measured_split_s": {k: round(v, 3) for k, v in r["measured_split"].items()},
            "predicted_split_s": {k: round(v, 3) for k, v in r["predicted_split"].items()}}


def fit_summary(fit_path: Path, settings: RunSettings) -> tuple[tuple, dict]:
    """((trace, calibration, path), what was fitted) for one fit run."""
    trace = load_trace(fit_path)
    calib = replay_calibration(trace)[1]
    calls = {op: fit_call_costs(trace, op, calib.contention, settings.micro_batch) for op in ("backward", "forward")}
    if calls["backward"] is not None:
        calls["fused_forward"] = fit_fused_forward(trace, calls["backward"], calib.contention, settings.micro_batch)
    return (trace, calib, fit_path), {
        "calls_s": {op: {k: round(v, 6) for k, v in vars(c).items()} for op, c in calls.items() if c is not None},
        "calibration": calib.summary(), "landing_s": round(landing_latency(trace, calib), 4),
        "rollout_on_own_device": rollout_on_own_device(fit_path)}


def out_of_sample(fit_path: Path, target_dirs: list[Path], settings: RunSettings = RunSettings(),
                  only: list[Path] | None = None) -> dict:
    """Costs fitted on fit_path predict every other trace of target_dirs (or exactly `only`)."""
    fit, summary = fit_summary(fit_path, settings)
    targets = only if only is not None else [p for d in target_dirs for p in find_traces(d)
                                             if p.resolve() != fit_path.resolve()]
    if not targets:
        raise SystemExit(f"no target traces in {[str(d) for d in target_dirs]}: run "
                         "`python benchmarks/modes.py --rollout emulated [--workload paper]` first")
    rows = [predict_file(p, fit, settings) for p in targets]
    for r, p in zip(rows, targets):  # a second replay only where both runs have probes (point 9)
        probed = predict_file(p, fit, settings, at_machine_speed=True) if r["machine_speed_ratio"] else None
        r["predicted_s_at_machine_speed"] = probed and probed["predicted_s"]
        r["rel_err_at_machine_speed"] = probed and probed["rel_err"]
    print(f"Costs fitted on {fit_path} only:")
    print_out_of_sample(rows)
    return {"fit": str(fit_path), "fit_costs": summary, "rows": rows,
            "max_abs_rel_err_out_of_sample": _max_err(rows),
            "max_abs_rel_err_measured_terms": _max_err(rows, measured_only=True),
            "max_abs_rel_err_at_machine_speed": _max_err_at_speed(rows),
            "per_target": {_short(r["file"]): _target_entry(r) for r in rows}}


# fit_per_family (module docstring, point 5): the folder of a family's traces and the files of the family in it, the
# run every other trace is predicted from, and the run (a path in the results folder) that predicts that one.
FAMILIES = {
    "emulated_paper": ("traces_emulated_paper/r0", "grpo_*", "grpo_thundersync",
                       "traces_emulated_paper/r0/grpo_sync_bypass.jsonl"),
    "emulated_recorded": ("traces_emulated_recorded/r0", "grpo_*", "grpo_thundersync",
                          "traces_emulated_recorded/r0/grpo_sync_bypass.jsonl"),
    "shared_core_grpo": ("traces", "grpo_*", "grpo_thundersync", "traces/grpo_sync.jsonl"),
    "shared_core_opd": ("traces", "opd_*", "opd_thundersync", "traces/opd_sync.jsonl"),
}

FAMILY_MACHINE = {"emulated": "rollout on its own emulated device (replay backend); learner and driver on one core, "
                              "the rest of verl on the other; one family per workload (policy model, verifier)",
                  "shared": "rollout engine (hf_cpu) and learner on the same 2 CPU cores; GRPO and OPD apart"}


def _largest_gap(r: dict) -> str:
    """Where a prediction beyond 10% went wrong: the part of the step (point 2's split) it missed most, read after
    the prediction (never an input to it), and the terms its fit run did not measure."""
    m, p = r["measured_split"], r["predicted_split"]
    part = max(SPLIT, key=lambda k: abs(p[k] - m[k]))
    terms = f"; not measured by the fit: {', '.join(sorted(r['unmeasured']))}" if r["unmeasured"] else ""
    return (f"{100 * r['rel_err']:+.1f}%: most in {part.replace('_', ' ')} ({m[part]:.2f} s measured, {p[part]:.2f} s "
            f"predicted per step){terms}")


def backward_s_per_token(trace, warmup_steps: int = 1) -> float:
    """A run's learner seconds per trained token over its steady steps (backward records)."""
    recs = [r for r in trace.learner if r["op"] == "backward" and r["step"] > warmup_steps]
    tokens = sum(r["tokens"] for r in recs)
    return sum(r["t1"] - r["t0"] for r in recs) / tokens if tokens else float("nan")


def identical_work_drift(files: list[Path]) -> float | None:
    """How far apart two runs of the SAME learner work are on this machine: verl's Sync and its bypass mode train the
    same trajectories with the same ``update_actor``, so their cost per token differs only by the machine's state
    while each ran (other jobs, frequency). Relative difference of the two (None without both traces). No
    prediction from one run can be expected closer to another than this; it is read after the predictions and never
    enters one."""
    by_stem = {p.stem: p for p in files}
    pair = [by_stem.get(f"grpo_{m}") for m in ("sync", "sync_bypass")]
    if None in pair:
        return None
    a, b = (backward_s_per_token(load_trace(p)) for p in pair)
    return round(max(a, b) / min(a, b) - 1.0, 4)


def fit_to_fit(fits: list[Path], target_dirs: list[Path], settings: RunSettings) -> dict:
    """Point 7: every fit predicts the same targets (none of the fits); the spread of their predictions per target."""
    own = {p.resolve() for p in fits}
    targets = [p for d in target_dirs for p in find_traces(d) if p.resolve() not in own]
    if not targets:
        raise SystemExit(f"no target traces besides the fits in {[str(d) for d in target_dirs]}")
    per_fit = {str(f): out_of_sample(f, [], settings, only=targets) for f in fits}
    spread = {}
    for t in targets:
        preds = [next(r["predicted_s"] for r in out["rows"] if r["file"] == str(t)) for out in per_fit.values()]
        spread[str(t)] = round(max(preds) / min(preds) - 1.0, 4)
    print("Fit to fit: the same targets predicted from each fit run, max / min - 1 per target: "
          + ", ".join(f"{_short(t)} {100 * v:.1f}%" for t, v in spread.items()))
    return {"fits": [str(f) for f in fits], "targets": [str(t) for t in targets],
            "per_fit": {f: {"max_abs_rel_err_out_of_sample": o["max_abs_rel_err_out_of_sample"],
                            "fit_costs": o["fit_costs"], "per_target": o["per_target"]} for f, o in per_fit.items()},
            "fit_to_fit_spread": spread, "max_fit_to_fit_spread": max(spread.values()),
            "trace_sha256": trace_digests([*fits, *targets])}


def paired(dirs: list[Path], settings: RunSettings) -> dict:
    """Point 8: in each folder one ``modes.py`` run of a mode and ThunderSync, back to back; the ThunderSync run
    predicts the other mode, and a Sync run predicts the ThunderSync run (as in the families)."""
    rows = []
    for d in dirs:
        ts, traces = d / "grpo_thundersync.jsonl", find_traces(d)
        others = [p for p in traces if p != ts]
        if ts not in traces or not others:
            raise SystemExit(f"{d}: --paired needs grpo_thundersync.jsonl and one other mode's trace "
                             "(`python benchmarks/modes.py --rollout emulated --modes MODE,thundersync`)")
        rows += out_of_sample(ts, [], settings, only=others)["rows"]
        syncs = [p for p in others if p.stem in ("grpo_sync", "grpo_sync_bypass")]
        if syncs:
            rows += out_of_sample(syncs[0], [], settings, only=[ts])["rows"]
    return {"folders": [str(d) for d in dirs], "max_abs_rel_err_out_of_sample_paired": _max_err(rows),
            "max_abs_rel_err_measured_terms": _max_err(rows, measured_only=True),
            "per_target": {_short(r["file"]) + " <- " + Path(r["fit"]).stem: _target_entry(r) for r in rows},
            "trace_sha256": trace_digests(p for d in dirs for p in find_traces(d))}


def out_of_sample_families(results: Path, settings: RunSettings, folders: dict[str, Path] | None = None) -> dict:
    """Every trace of every family predicted from a fit on another run of its family (module docstring, point 5).
    ``folders`` (``--family NAME=DIR``): only these families, each read from its DIR."""
    families, per_target, fits = {}, {}, {}
    for name, (folder, pattern, fit, back) in FAMILIES.items():
        if folders is not None and name not in folders:
            continue
        where = Path(folders[name]) if folders is not None else results / folder
        files = sorted(where.glob(pattern + ".jsonl"))
        main, other = where / f"{fit}.jsonl", where / Path(back).name
        if main not in files or not other.is_file():
            print(f"note: family {name}: {main.name} or {other.name} missing in {where}; not predicted")
            continue
        print(f"\n== {name}")
        a = out_of_sample(main, [], settings, only=[p for p in files if p != main])
        b = out_of_sample(other, [], settings, only=[main])
        fits[_short(main)], fits[_short(other)] = a["fit_costs"], b["fit_costs"]
        rows = a["rows"] + b["rows"]
        families[name] = {"machine": FAMILY_MACHINE[name.split("_")[0]],
                          "fits": {_short(main): "every other trace", _short(other): _short(main)},
                          "max_abs_rel_err": _max_err(rows),
                          "max_abs_rel_err_measured_terms": _max_err(rows, measured_only=True),
                          "max_abs_rel_err_at_machine_speed": _max_err_at_speed(rows),
                          "identical_work_drift": identical_work_drift(files),
                          "predicted_through_unmeasured_terms": {_short(r["file"]): sorted(r["unmeasured"])
                                                                 for r in rows if r["unmeasured"]},
                          "beyond_10_percent": {_short(r["file"]): _largest_gap(r) for r in rows
                                                if abs(r["rel_err"]) > 0.10},
                          "trace_sha256": trace_digests({*files, other})}
        per_target.update({_short(r["file"]): _target_entry(r) for r in rows})
        if families[name]["identical_work_drift"] is not None:
            print(f"  {name}: Sync and Sync (bypass), the same learner work, cost "
                  f"{100 * families[name]['identical_work_drift']:.1f}% apart per token between the two runs")
    if not per_target:
        raise SystemExit(f"no family's traces under {results}: run `{PRODUCER} --rollout emulated` first")
    measured = [f["max_abs_rel_err_measured_terms"] for f in families.values()]
    drifts = [f["identical_work_drift"] for f in families.values() if f["identical_work_drift"] is not None]
    return {"settings": vars(settings), "fit_per_family": families, "fit_costs": fits,
            "max_abs_rel_err_out_of_sample": max(f["max_abs_rel_err"] for f in families.values()),
            "max_abs_rel_err_measured_terms": max((m for m in measured if m is not None), default=None),
            "max_identical_work_drift": max(drifts, default=None),
            "max_abs_rel_err_at_machine_speed": {n: f["max_abs_rel_err_at_machine_speed"] for n, f in families.items()
                                                 if f["max_abs_rel_err_at_machine_speed"] is not None},
            "per_target": per_target}


def print_report(rows: list[dict]) -> None:
    fitted = [[r["file"], r["sim_mode"], r["slots"], f"{r['s_per_token']:.3g}", f"{r['chunk_overhead_s']:.3g}",
               f"{r['forward_s_per_token']:.3g}", f"{r['optimizer_s']:.3g}", f"{r['weight_sync_s']:.3g}",
               f"{r['calibration']['step_gap_s']:.3g}",
               "recorded" if r["calibration"]["reward_timing"] else f"{r['calibration']['landing_s']:.3g}",
               "yes" if r["calibration"]["partial_rollout"] else "no",
               f"{r['calibration']['rollout_slowdown']:.2f}", f"{r['calibration']['learner_slowdown']:.2f}",
               f"{r['calibration']['turn_latency_s']:.3g}" if "turn_latency_s" in r["calibration"] else "-"]
              for r in rows]
    print("Fitted from each trace's own records (seconds):")
    print(format_table(fitted, ["trace", "replayed as", "slots", "s/token", "chunk_s", "fwd s/token", "optim_s",
                                "sync_s", "step_gap_s", "landing_s", "partial", "roll_slow", "learn_slow",
                                "turn_lat_s"]))
    table = []
    for r in rows:
        m, s = r["measured_split"], r["simulated_split"]
        table.append([r["file"], r["mode"], r["algo"], r["steps"], r["measured_s"], r["simulated_s"],
                      f"{100 * r['rel_err']:+.1f}%"] + [f"{m[k]:.2f} / {s[k]:.2f}" for k in SPLIT])
    print("\nPer steady step, measured / simulated seconds: rollouts only, learner only, both, neither:")
    print(format_table(table, ["trace", "mode", "algo", "steps", "measured_s", "simulated_s", "rel_err",
                               "R only", "L only", "both", "neither"]))


def write_self_test_traces(directory: Path) -> None:
    """Synthetic traces of a small CPU-like run, one per mode (clearly not measurements)."""
    from thundersync_verl.sim.dists import const, lognormal
    from thundersync_verl.sim.sim_engine import SimConfig
    from thundersync_verl.sim.hardware import LearnerCosts
    from thundersync_verl.sim.tracegen import write_synthetic_trace
    from thundersync_verl.sim.workload import RolloutSpec, SyntheticSource, WorkloadSpec

    work = WorkloadSpec(groups_per_step=4, group_size=4, turns=lognormal(3, 0.6), prompt_tokens=const(48),
                        gen_tokens=lognormal(32, 0.5), obs_tokens=lognormal(24, 0.5), tool_s=lognormal(0.05, 0.5),
                        reward_s=lognormal(0.02, 0.3))
    roll = RolloutSpec(slots=16, decode_s_per_token=0.004, prefill_s_per_token=1e-4, teacher_fixed_s=0.01,
                       teacher_s_per_token=1e-4)
    costs = LearnerCosts(s_per_token=3e-4, chunk_overhead_s=0.02, optimizer_s=0.15, weight_sync_s=0.05)
    source = SyntheticSource(work, roll, seed=7)
    for algo, mode in (("grpo", "sync"), ("grpo", "async"), ("grpo", "fully_async"), ("grpo", "thundersync"),
                       ("opd", "sync"), ("opd", "thundersync")):
        cfg = SimConfig(mode=mode, algo=algo, steps=12, rollout_slots=16, min_chunk=1)
        write_synthetic_trace(directory / f"{algo}_{mode}.jsonl", cfg, source, costs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace-dir", default=None, help="default: traces/ in the results folder (--results-dir)")
    ap.add_argument("--quick", action="store_true", help="same replay (it is already fast); kept for uniformity")
    ap.add_argument("--self-test", action="store_true", help="validate synthetic traces instead (no result file)")
    ap.add_argument("--out-of-sample", action="store_true", help="fit on one trace (--fit), predict the others")
    ap.add_argument("--fit", action="append", default=None, help="--out-of-sample: one trace to fit on instead of "
                    "the families' fits (point 5); its predictions of --targets are written instead. Repeated: each "
                    "fit predicts the same targets, and how far apart they land is written (point 7)")
    ap.add_argument("--paired", nargs="+", default=None, metavar="DIR", help="--out-of-sample: folders of one "
                    "two-mode run each (a mode and thundersync, back to back); each predicted from the other (point 8)")
    ap.add_argument("--targets", nargs="*", default=None, help="--out-of-sample with --fit: folders of traces to "
                    "predict (default: the fit trace's folder)")
    ap.add_argument("--family", action="append", default=None, metavar="NAME=DIR",
                    help=f"--out-of-sample: only family NAME ({', '.join(FAMILIES)}), its traces read from DIR")
    ap.add_argument("--save-as", default=None, metavar="NAME",
                    help="the result file's name (NAME.json in the results folder) instead of the command's own")
    ap.add_argument("--micro-batch-size", type=int, default=1, help="--out-of-sample: the runs' learner micro-batch "
                    "(benchmarks/modes.py trains one trajectory per micro-batch)")
    ap.add_argument("--fully-async-mini-batch", type=int, default=8, help="--out-of-sample: rows per Fully Async "
                    "update (modes.py: 2-prompt mini-batches of rollout.n = 4, weights pushed once per batch); 0: one "
                    "update per recorded backward")
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    if (args.fit or args.paired or args.targets) and not args.out_of_sample:
        ap.error("--fit, --paired and --targets belong to --out-of-sample: add it")
    if args.paired and (args.fit or args.targets):
        ap.error("--paired predicts each folder's runs from each other: drop --fit and --targets, or --paired")
    folders = None
    if args.family:
        if not args.out_of_sample or args.fit or args.paired:
            ap.error("--family picks the families of --out-of-sample alone: drop --fit/--paired, or --family")
        pairs = [f.partition("=") for f in args.family]
        bad = [f for f, (name, eq, d) in zip(args.family, pairs)
               if name not in FAMILIES or not eq or not Path(d).is_dir()]
        if bad:
            ap.error(f"--family {bad[0]}: give NAME=DIR with NAME one of {', '.join(FAMILIES)} and DIR a folder")
        folders = {name: Path(d) for name, _, d in pairs}

    def save(default: str, out: dict) -> None:
        write_result(args.save_as or f"{SCRIPT}{default}", out, args.results_dir)
    if args.out_of_sample:
        results = find_results_dir(args.results_dir)
        settings = RunSettings(args.micro_batch_size, args.fully_async_mini_batch or None)
        if args.paired:
            save("_out_of_sample_paired", paired([Path(d) for d in args.paired], settings))
            return 0
        if args.fit is None:
            save("_out_of_sample", out_of_sample_families(results, settings, folders))
            return 0
        fits = [Path(f) for f in args.fit]
        missing = [str(f) for f in fits if not f.is_file()]
        if missing:
            print(f"No fit trace {', '.join(missing)}: run `{PRODUCER} --rollout emulated` first.", file=sys.stderr)
            return 2
        dirs = [Path(d) for d in args.targets] if args.targets else [fits[0].parent]
        if len(fits) > 1:
            save("_out_of_sample_fits", fit_to_fit(fits, dirs, settings))
            return 0
        out = out_of_sample(fits[0], dirs, settings)
        out.pop("rows")
        save("_out_of_sample", out)
        return 0
    tmp = None
    if args.self_test:
        tmp = tempfile.TemporaryDirectory()
        trace_dir = Path(tmp.name)
        write_self_test_traces(trace_dir)
        print("SELF-TEST: synthetic traces, not measurements.")
    else:
        trace_dir = Path(args.trace_dir) if args.trace_dir else find_results_dir(args.results_dir) / "traces"
    files = find_traces(trace_dir)
    if not files:
        print(f"No traces in {trace_dir}: record real runs first with `{PRODUCER}` (it writes <mode>.jsonl or "
              f"<algo>_<mode>.jsonl there), then re-run this script.", file=sys.stderr)
        return 2
    rows = [validate_file(p) for p in files]
    print_report(rows)
    for r in rows:
        if r["dropped_steps"]:
            print(f"note: {r['file']}: steps {r['dropped_steps']} have a different batch size and were not replayed")
    out = {"max_rel_err_vs_measured": round(max(abs(r["rel_err"]) for r in rows), 4),
           "per_mode": {Path(r["file"]).stem: {
               "measured_s": round(r["measured_s"], 4), "simulated_s": round(r["simulated_s"], 4),
               "rel_err": round(r["rel_err"], 4), "replayed_as": r["sim_mode"], "calibration": r["calibration"],
               "measured_split_s": {k: round(v, 3) for k, v in r["measured_split"].items()},
               "simulated_split_s": {k: round(v, 3) for k, v in r["simulated_split"].items()},
               "trace_sha256": trace_digest(path)} for r, path in zip(rows, files)}}
    if tmp is not None:
        print(json.dumps(out))
        tmp.cleanup()
        return 0
    write_result(args.save_as or SCRIPT, out, args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
