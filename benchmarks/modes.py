"""Sync vs Async vs Fully Async vs ThunderSync on the embedded agentic task, side by side in one run.

Each mode is stock ``python -m verl.trainer.main_ppo`` with the ``recipes/cpu_tiny`` overlay and
``mode=<name>``: the same data, model, seed, rollout engine and tool-latency distribution. Printed
per mode: mean step time (step 1, the warm-up, excluded), learner busy fraction, staleness (policy
versions, verl's own ``training/off_policy/*`` metrics), final reward. Also: the share of a Sync
step the learner waits for the last reward, and ThunderSync against its lower bound (rollout
makespan + one trajectory's learner work + optimizer step + weight push).

Traces in the simulator's schema go to ``benchmarks/results/traces/<algo>_<mode>.jsonl`` (``--results-dir``).

``--rollout emulated [--workload recorded|paper]`` replays one recording in every mode instead of
generating on the CPU (the rollout on its own emulated device; ``emulated_rollout.py`` says how), with
Sync also in verl's bypass mode, the step-1 update gap, and ``--repeats N`` paired runs.

``--rollout emulated --algo opd`` (the paper workload): OPD on the emulated device (the student's generation
replayed, the teacher scoring each turn for real on the rollout side's core).

``--algo opd`` runs the ``opd`` recipe (on-policy distillation from the tiny teacher; thundersync
streams agent turns) and adds the student's reverse KL to the teacher over the run (verl's
``actor/distillation/loss``, ThunderSync's ``thundersync/opd/reverse_kl``: the same token mean of
log pi - log p_teacher at the batch's weights); results go to ``modes_opd.json``.

    python benchmarks/modes.py [--algo grpo|opd] [--steps 8] [--quick] [--modes sync,thundersync]
    python benchmarks/modes.py --rollout emulated [--workload recorded|paper] [--quick] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from thundersync_verl.demo import prepare_inputs, reverse_kl, run_env, run_verl, verl_command
from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result

MODES = ("sync", "async", "fully_async", "thundersync")
# --rollout emulated: Sync in verl's bypass mode too, and ThunderSync with tail batching (emulated_tail.py), opt-in
EMULATED_NAMES = ("sync_bypass", "thundersync", "sync", "async", "fully_async", "thundersync_tail")
LEARNER_KEYS = ("old_log_prob", "ref", "adv", "update_actor", "update_weights")
# The default workload: tool and verifier latency shaped like agentic SWE traces (most calls short, a
# long tail), and one trajectory per learner micro-batch, as long-context agentic runs train. The latency
# scale sets the learner/rollout cost ratio. It is calibrated on Sync ALONE (``--calibrate``: Sync runs
# at several scales, the one whose learner wait share is nearest the published agentic trace's 49.5% is
# kept, results in modes_calibration.json), never on ThunderSync's result; the share measured in each
# comparison run is reported as sync_learner_wait_share.
LATENCY_SCALE = 0.2  # --calibrate 0.5,0.2,0.1 --steps 6: Sync wait share 0.535, 0.492, 0.476 (nearest 0.495: 0.2)
BATCH_PROMPTS = 16  # prompts per step (x rollout.n = 4 trajectories each); one mini-batch, as ThunderSync requires
MICRO_BATCH_1 = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1"]
TARGET_WAIT_SHARE = 0.495
DRIVER_LOW_NICE = 10  # --pin-learner driver-low: the driver behind the learner on their shared core (cpu_pin.py point 2)


def workload(latency_scale: float, mode: str) -> list[str]:
    """Overrides shared by every mode; Fully Async keeps its 2-prompt mini-batches and pushes once per batch."""
    if mode == "fully_async":
        batching = [f"trainer.v1.separate_async.parameter_sync_step={BATCH_PROMPTS // 2}"]
    else:
        batching = [f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH_PROMPTS}"]
    return [f"thundersync.env.tool_latency.scale={latency_scale}", f"thundersync.env.verifier_latency.scale={latency_scale}",
            f"data.train_batch_size={BATCH_PROMPTS}"] + batching + MICRO_BATCH_1


def run_mode(mode: str, steps: int, inputs: dict, work: Path, algo: str = "grpo", latency_scale: float = LATENCY_SCALE,
             tag: str = "", extra: list[str] | None = None, env_extra: dict | None = None,
             pin_learner: bool | str = False) -> dict:
    run_dir = work / ((mode if algo == "grpo" else f"{algo}_{mode}") + tag)
    run_dir.mkdir(parents=True, exist_ok=True)
    traj_path = run_dir / "trajectories.jsonl"
    for stale in [*run_dir.glob("*.jsonl"), *run_dir.glob("timelines/*")]:  # the recorders and the drawer append
        stale.unlink()
    extra = workload(latency_scale, mode) + list(extra or []) + [f"thundersync.env.trace_path={traj_path}",
                                                                 f"thundersync.run_dir={run_dir}"]
    cmd = verl_command(inputs, algo=algo, mode=mode, steps=steps, extra=extra)
    print(f"[modes] {algo} {mode}: {steps} steps, latency scale {latency_scale}", flush=True)
    t0 = time.time()
    env = run_env(run_dir, run_dir / "metrics.jsonl")
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ts_ray_")  # a private Ray session per run
    env.update(env_extra or {})
    if not pin_learner:
        per_step = run_verl(cmd, env, run_dir / "verl.log", steps)
        return {"per_step": per_step, "seconds": time.time() - t0, "run_dir": run_dir, "traj_path": traj_path}
    from thundersync_harness.cpu_pin import LearnerPin  # the learner on a core of its own (cpu_pin.py)

    with LearnerPin(with_driver=pin_learner in ("driver", "driver-low"),
                    driver_nice=DRIVER_LOW_NICE if pin_learner == "driver-low" else 0) as pin:
        per_step = run_verl(pin.prefix() + cmd, {**env, **pin.env()}, run_dir / "verl.log", steps)
    return {"per_step": per_step, "seconds": time.time() - t0, "run_dir": run_dir, "traj_path": traj_path,
            "pin": pin.describe(), "core_load": pin.load}


def summarise(mode: str, run: dict) -> dict:
    steps = sorted(run["per_step"])
    timed = [run["per_step"][s] for s in steps[1:]] or [run["per_step"][s] for s in steps]
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    step_time = mean([m["timing_s/step"] for m in timed])
    if mode == "thundersync":
        busy = mean([m.get("thundersync/learner_busy_fraction", 0.0) for m in timed])
    else:
        busy = mean([sum(m.get(f"timing_s/{k}", 0.0) for k in LEARNER_KEYS) / m["timing_s/step"] for m in timed])
    last = [run["per_step"][s] for s in steps[-3:]]
    kls = [k for k in (reverse_kl(run["per_step"][s]) for s in steps) if k is not None]
    turns = sum(m.get("thundersync/opd/turns", 0) for m in timed)
    merged = {  # OPD per turn: learner rows and teacher calls per scored turn (1: none shared; opd_stream point 7)
        "opd_rows_per_turn": sum(m.get("thundersync/opd/rows", 0) for m in timed) / turns,
        "opd_teacher_calls_per_turn": sum(m.get("thundersync/opd/teacher_calls", 0) for m in timed) / turns,
    } if turns and mode == "thundersync" else {}
    return {
        **merged,
        "reverse_kl_first5": mean(kls[:5]) if kls else None,
        "reverse_kl_last5": mean(kls[-5:]) if kls else None,
        "step_time_s": step_time,
        "learner_busy": busy,
        "staleness_mean": mean([m.get("training/off_policy/trajectory_staleness/mean", 0.0) for m in timed]),
        "staleness_max": max(m.get("training/off_policy/trajectory_staleness/max", 0.0) for m in run["per_step"].values()),
        "final_reward": mean([m.get("critic/score/mean", 0.0) for m in last]),
        "wait_share": mean([m.get("timing_s/gen", 0.0) / m["timing_s/step"] for m in timed]),
    }


def thundersync_lower_bound(run: dict, algo: str = "grpo", *, learner_work: bool = False) -> float:
    """Mean over steps of: rollout makespan + one row's backward (a trajectory; an OPD turn) + optimizer + weight push.

    ``learner_work`` (GRPO): the schedule bound of the run's own arrivals instead, max over arrivals k of (t_k + the
    rows landing at or after t_k times the cheapest per-row backward the run measured); its last arrival's term is the
    bound above, its first one's is all of the step's backward work from the first landing on. No order of the same
    arrivals on the same learner finishes sooner, so the step time over it measures the streaming schedule alone.
    """
    records = [json.loads(line) for line in open(run["run_dir"] / f"{algo}_thundersync.jsonl")]
    bounds = []
    for step in {r["step"] for r in records if r["kind"] == "step"} - {1}:
        ops = [r for r in records if r["kind"] == "learner" and r["step"] == step]
        st = next(r for r in records if r["kind"] == "step" and r["step"] == step)
        landed = sorted(r["t_reward"] - st["t_start"] for r in records if r["kind"] == "trajectory" and r["step"] == step)
        row_s = min([(o["t1"] - o["t0"]) / max(o.get("rows", 1), 1) for o in ops if o["op"] == "backward"], default=0.0)
        opt = sum(o["t1"] - o["t0"] for o in ops if o["op"] == "optimizer")
        sync = run["per_step"][step].get("timing_s/update_weights", 0.0)
        if learner_work and algo == "grpo":
            work = max(t + (len(landed) - k) * row_s for k, t in enumerate(landed))
        else:
            work = landed[-1] + row_s
        bounds.append(work + opt + sync)
    return sum(bounds) / max(len(bounds), 1)


def write_sim_trace(mode: str, run: dict, out: Path, algo: str = "grpo") -> None:
    """Agent-loop trajectories + step timings in the simulator's schema (sim/trace.py)."""
    lines = []
    offset = 2 if mode in ("async", "fully_async") else 1  # the learner step that consumed a version's rollouts
    for raw in (json.loads(x) for x in open(run["traj_path"])):
        step = int(raw.get("policy_version", 0)) + offset
        lines.append({"kind": "trajectory", "mode": mode, "algo": algo, "step": step, "group_id": str(raw.get("uid")),
                      "traj_id": f"{raw.get('uid')}_{raw.get('session_id')}", "t_submit": raw["t_submit"],
                      "t_done": raw["t_done"], "t_reward": raw["t_done"], "turns": raw["turns"], "reward_s": 0.0,
                      "response_tokens": raw["response_tokens"], "prompt_tokens": raw["prompt_tokens"],
                      "policy_version": int(raw.get("policy_version", 0)), "learner_version": step - 1})
    for step, m in sorted(run["per_step"].items()):
        t_end = m["_t_logged"]
        lines.append({"kind": "step", "mode": mode, "algo": algo, "step": step, "t_start": t_end - m["timing_s/step"],
                      "t_end": t_end, "n_rollout_slots": BATCH_PROMPTS * 4})
        cursor = t_end
        for key, op in (("update_weights", "weight_sync"), ("update_actor", "backward"), ("adv", "other"), ("old_log_prob", "forward")):
            dur = m.get(f"timing_s/{key}", 0.0)
            if dur > 0:
                lines.append({"kind": "learner", "mode": mode, "step": step, "lane": "learner0", "op": op,
                              "t0": cursor - dur, "t1": cursor, "tokens": int(m.get("perf/total_num_tokens", 0))})
                cursor -= dur
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))


def print_table(rows: dict, algo: str) -> None:
    kl = algo == "opd"
    print(f"\n{'mode':<12} {'step s':>8} {'busy':>6} {'stale mean':>10} {'stale max':>9} {'reward':>7}"
          + (f" {'rev KL first5':>13} {'rev KL last5':>12}" if kl else ""))
    for mode, r in rows.items():
        line = (f"{mode:<12} {r['step_time_s']:>8.2f} {r['learner_busy']:>6.2f} {r['staleness_mean']:>10.2f} "
                f"{r['staleness_max']:>9.0f} {r['final_reward']:>7.3f}")
        if kl:
            line += f" {_fmt(r['reverse_kl_first5']):>13} {_fmt(r['reverse_kl_last5']):>12}"
        print(line)


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def headline(rows: dict, runs: dict, steps: int, algo: str) -> dict:
    """The JSON object of headline figures (the same keys for both algorithms, plus OPD's reverse KL)."""
    result = {"algo": algo, "steps": steps,
              "step_time_s": {m: round(r["step_time_s"], 3) for m, r in rows.items()},
              "staleness_max": {m: r["staleness_max"] for m, r in rows.items()},
              "learner_busy": {m: round(r["learner_busy"], 3) for m, r in rows.items()},
              "final_reward": {m: round(r["final_reward"], 3) for m, r in rows.items()}}
    if algo == "opd":
        for key in ("reverse_kl_first5", "reverse_kl_last5"):
            result[key] = {m: None if r[key] is None else round(r[key], 4) for m, r in rows.items()}
    if "sync" in rows:
        result["sync_learner_wait_share"] = round(rows["sync"]["wait_share"], 3)
    if "sync" in rows and "thundersync" in rows:
        result["speedup_vs_sync"] = round(rows["sync"]["step_time_s"] / rows["thundersync"]["step_time_s"], 3)
        lb = thundersync_lower_bound(runs["thundersync"], algo)
        result["thundersync_over_lower_bound"] = round(rows["thundersync"]["step_time_s"] / lb, 3)
        if algo == "grpo":
            result["thundersync_over_schedule_bound"] = round(rows["thundersync"]["step_time_s"] / thundersync_lower_bound(
                runs["thundersync"], algo, learner_work=True), 3)
        print(f"\nThunderSync / Sync step time: {1 / result['speedup_vs_sync']:.2f}  (lower bound {lb:.2f}s, "
              f"ratio {result['thundersync_over_lower_bound']:.2f}); Sync learner wait share {result['sync_learner_wait_share']:.2f}")
        pngs = sorted((runs["thundersync"]["run_dir"] / "timelines").glob("*.png"))
        if pngs:
            print(f"ThunderSync timelines: {pngs[0].parent} (e.g. {pngs[-1].name})")
    return result


def calibrate(scales: list[float], steps: int, inputs: dict, work: Path, algo: str, results_dir: Path) -> dict:
    """Sync alone at each latency scale: its learner wait share; the scale nearest the published 49.5%."""
    shares = {}
    for scale in scales:
        run = run_mode("sync", steps, inputs, work, algo, latency_scale=scale, tag=f"_scale{scale}")
        row = summarise("sync", run)
        shares[str(scale)] = {"sync_learner_wait_share": round(row["wait_share"], 3), "step_time_s": round(row["step_time_s"], 3)}
        print(f"[calibrate] scale {scale}: Sync learner wait share {row['wait_share']:.3f}, step {row['step_time_s']:.2f}s", flush=True)
    chosen = min(shares, key=lambda k: abs(shares[k]["sync_learner_wait_share"] - TARGET_WAIT_SHARE))
    result = {"algo": algo, "steps": steps, "target_wait_share": TARGET_WAIT_SHARE, "scales": shares, "chosen_scale": float(chosen)}
    write_result("modes_calibration" if algo == "grpo" else "modes_calibration_opd", result, results_dir)
    return result


def build_parser() -> argparse.ArgumentParser:
    """The command line (``ci/gpu_check.py --dry-run`` parses its arguments with it)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algo", default="grpo", choices=["grpo", "opd"], help="opd: on-policy distillation (recipe opd.yaml)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="4 steps per mode")
    ap.add_argument("--modes", default=None, help=f"default: {','.join(MODES)} "
                    "(--rollout emulated: sync_bypass,thundersync,sync,async,fully_async; thundersync_tail on request)")
    ap.add_argument("--rollout", default="cpu", choices=["cpu", "emulated"],
                    help="emulated: every mode replays one recording (generation slept, not computed)")
    ap.add_argument("--workload", default=None, choices=["recorded", "paper"],
                    help="--rollout emulated: a recorded hf_cpu run, or the paper shape synthesised (default: "
                         "recorded; paper with --algo opd, its only workload)")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="--rollout emulated: the workload's time scale (default: the calibrated one)")
    ap.add_argument("--repeats", type=int, default=1, help="--rollout emulated: paired runs (the median is reported)")
    ap.add_argument("--pin-learner", default="on", choices=["on", "driver", "driver-low", "off"],
                    help="--rollout emulated: the learner worker on one core, every other verl process on the other "
                         "(driver: verl's trainer loop on the learner's core too; driver-low: there at nice "
                         f"{DRIVER_LOW_NICE}, behind the learner's compute)")
    ap.add_argument("--no-exactness", action="store_true", help="--rollout emulated: skip the step-1 update gap runs")
    ap.add_argument("--exactness-only", action="store_true",
                    help="--rollout emulated: only the step-1 update gap runs (modes_emulated_exactness_<workload>.json)")
    ap.add_argument("--work-dir", default="runs/modes")
    ap.add_argument("--model", default=None, help="an HF model folder to use instead of the tiny student")
    ap.add_argument("--teacher", default=None, help="OPD: an HF teacher folder (the student's tokenizer) instead of the tiny teacher")
    ap.add_argument("--latency-scale", type=float, default=None,
                    help=f"tool and verifier latency scale (default: the calibrated {LATENCY_SCALE})")
    ap.add_argument("--opd-granularity", default=None, choices=["turn", "trajectory"],
                    help="OPD ThunderSync row unit (thundersync.opd.granularity; default: the recipe's)")
    ap.add_argument("--opd-teacher-calls", default=None, choices=["turn", "trajectory"],
                    help="OPD ThunderSync teacher calls (thundersync.opd.teacher_calls; default: the recipe's): each "
                         "finished turn, or verl's one call per whole trajectory")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra hydra override for every mode (repeatable), e.g. thundersync.chunk_size=4")
    ap.add_argument("--calibrate", default=None, metavar="S1,S2,...",
                    help="run Sync alone at each latency scale and report its learner wait share (modes_calibration.json)")
    add_results_dir_argument(ap)
    return ap


def main(argv=None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    results_dir = find_results_dir(args.results_dir)  # refuse before the runs, not after
    if (args.opd_granularity or args.opd_teacher_calls) and args.algo != "opd":
        ap.error("--opd-granularity and --opd-teacher-calls need --algo opd")
    args.override = opd_overrides(args) + list(args.override)
    if args.workload is None:
        args.workload = "paper" if args.algo == "opd" else "recorded"
    if args.rollout == "emulated" and args.algo == "opd" and args.workload != "paper":
        ap.error("--rollout emulated --algo opd needs --workload paper: the recorded workload's policy is the "
                 "tiny teacher itself, so distilling it would have nothing to learn")
    if args.algo == "opd" and args.model and not args.teacher:
        ap.error("--algo opd --model needs --teacher too: distilling a model into itself has nothing to learn")
    steps = 4 if args.quick else args.steps
    modes = [m for m in (args.modes or ",".join(MODES)).split(",") if m]
    known = EMULATED_NAMES if args.rollout == "emulated" else MODES
    if any(m not in known for m in modes) or not modes:
        ap.error(f"--modes {args.modes!r}: each must be one of {','.join(known)}")
    if "thundersync_tail" in modes and args.algo != "grpo":
        ap.error("--modes thundersync_tail needs --algo grpo: tail batching keeps whole GRPO groups")
    work = Path(args.work_dir).resolve()
    if args.rollout == "emulated" and not args.model:
        import emulated_rollout  # the sibling module (benchmarks/ is this script's folder)

        args.model = str(emulated_rollout.policy_model(args.workload, work))  # the workload's larger policy
    inputs = prepare_inputs(work, model=args.model, variants=("student", "teacher") if args.algo == "opd" else ("student",))
    if args.teacher:
        inputs["teacher"] = Path(args.teacher).resolve()
    if args.rollout == "emulated":
        import emulated_rollout  # the sibling module (benchmarks/ is this script's folder)

        return emulated_rollout.main(args, inputs, work, results_dir)
    if args.calibrate:
        return calibrate([float(x) for x in args.calibrate.split(",") if x], steps, inputs, work, args.algo, results_dir)
    scale = LATENCY_SCALE if args.latency_scale is None else args.latency_scale
    runs, rows = {}, {}
    traces = results_dir / "traces"
    for mode in modes:
        runs[mode] = run_mode(mode, steps, inputs, work, args.algo, latency_scale=scale, extra=list(args.override))
        rows[mode] = summarise(mode, runs[mode])
        if mode != "thundersync":
            write_sim_trace(mode, runs[mode], traces / f"{args.algo}_{mode}.jsonl", args.algo)
        else:
            traces.mkdir(parents=True, exist_ok=True)
            name = f"{args.algo}_thundersync.jsonl"
            (traces / name).write_text((runs[mode]["run_dir"] / name).read_text())
    print_table(rows, args.algo)
    result = headline(rows, runs, steps, args.algo)
    result["latency_scale"] = scale
    if args.override:
        result["overrides"] = list(args.override)
    if args.algo == "opd":
        result["opd_granularity"] = args.opd_granularity or "turn"
        result["opd_teacher_calls"] = args.opd_teacher_calls or "turn"
    name = "modes" if args.algo == "grpo" else "modes_opd"
    write_result(name + opd_suffix(args), result, results_dir)
    return result


def opd_overrides(args) -> list[str]:
    """``--opd-granularity`` / ``--opd-teacher-calls`` as hydra overrides (every mode; Sync ignores them)."""
    return ([f"thundersync.opd.granularity={args.opd_granularity}"] if args.opd_granularity else []) + (
        [f"thundersync.opd.teacher_calls={args.opd_teacher_calls}"] if args.opd_teacher_calls else [])


def opd_suffix(args) -> str:
    """Result names: an OPD run with a non-default row unit or teacher calls never overwrites the default's."""
    return ((f"_{args.opd_granularity}" if args.opd_granularity else "")
            + ("_whole_teacher" if args.opd_teacher_calls == "trajectory" else ""))


if __name__ == "__main__":
    main()
