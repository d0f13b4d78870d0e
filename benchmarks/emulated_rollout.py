"""The modes with the rollout on its own (emulated) device: ``python benchmarks/modes.py --rollout emulated``.

Why:
1. On this machine the learner and the rollout engine share two CPU cores, so overlapping them only
   moves CPU time around. What needs a device of its own is the inference engine; here its work is
   served by the ``replay`` backend: recorded tokens, log-probs and per-call service times, slept,
   not computed. Everything else runs for real: verl's agent loop, the tools in their sandbox, the
   verifier, Ray, the TransferQueue, the weight pushes and the learner.
2. Every mode replays the same recording, so they see the same trajectories. Workloads:
   ``recorded``: a real ``hf_cpu`` run of the embedded task at the calibrated settings (Sync,
   latency scale 0.2, no transient tool failures, so later turns replay), played by the task's trained
   1.9 M-parameter model (with the 0.4 M student the learner was a third of a Sync step: wait share 0.63
   at the time scale calibrated to 0.495, as the rollout side's own CPU work, the agent loop and the
   verifier, does not shrink with the scale); ``paper``: a recording
   synthesised from the simulator's paper preset scaled down (``backends/replay/synthesize.py``).
   The recording holds two steps more than the runs: the async modes generate ahead.
3. One knob, the workload's time scale, multiplies every recorded service time and the tools' and
   verifier's latency. It is calibrated on Sync ALONE (``--calibrate``): the scale whose Sync learner
   wait share is nearest the published 49.5%, on the Sync the speed-up is claimed against.
4. Sync runs twice: as configured (verl's old-log-prob forward on the learner) and in verl's bypass
   mode (``algorithm.rollout_correction.bypass_mode``: the rollout's log-probs are the old ones, legal
   when training is on-policy, as here). The speed-up is claimed against the faster one.
5. Same trajectories, same update: short extra runs (1 step, no sleeping) keep the pushed weights
   (``$THUNDERSYNC_REPLAY_WEIGHTS_DIR``). Their optimizer is SGD at lr 1e4, so the update is the clipped
   gradient times 1e4: at lr 1 a weight's update is often below its float32 spacing, and the gap between
   two runs counted the weights whose rounding flipped, not how far their gradients differ (measured: 3.7e-6
   at lr 1 against 1.25e-6 at lr 1e4, for the same pair of runs). The relative gap of ThunderSync's step-1
   update to that of Sync in bypass mode (the Sync the speed-up is claimed against) is divided by the noise
   floor: the largest gap among verl's own Sync runs that compute the same update in exact arithmetic, in
   bypass mode and with its own old-log-prob forward, at micro-batch sizes 1, 2 and 4. Two more runs in
   verl's ``token-sum`` mode give ``step1_update_gap_token_sum``. There each row's loss coefficient is its
   advantage itself, while in ``token-mean`` verl rounds advantage / token count per row, and ThunderSync
   applies the one scale to the summed gradient at the barrier (``stream_loss.py`` point 2). Measured on the
   recorded workload: in token-sum ThunderSync equals verl's Sync bit for bit in one run and is within 2.8e-8
   and 7.4e-8 of it in two benchmark runs. In token-mean, ThunderSync is 1.3e-6 from every Sync run, in any
   micro-batch size or row order (verl's ``actor.shuffle``), while those runs are within 2e-7 of each other
   when run in the same log-prob mode. The per-row roundings are common to all of them.
   ``step1_direction_gap_to_token_sum`` compares directions with verl's token-sum Sync, whose coefficients are
   exact: ThunderSync's token-mean update is 4.9-5.4e-8 from it, verl's token-mean Sync 1.25e-6.
6. What the emulation leaves out: the engine's own host work (scheduling, detokenising, the KV-cache
   manager: its CPU time is not spent, its service time is), the contention a real engine's host
   threads would add, and the weight load on the rollout side (the push runs, the replay server
   drops the tensors).
7. The learner on a device of its own: by default (``--pin-learner on``) every verl process runs on
   one core and the learner worker on the other (``thundersync_harness.cpu_pin``), in every mode
   alike, so the learner's backward cannot slow the rollout side (agent loop, tools, verifier,
   TransferQueue, driver), as a GPU learner does not slow the host CPUs. ``--pin-learner driver``
   puts verl's trainer loop (the driver: it builds and dispatches every learner call) on the learner's
   core too; on a cluster it runs on the head node's CPUs, not on the cores serving agent loops and
   sandboxes. Ray starts its workers' Python threads at nice 15, so there the learner and the driver share the
   core as equals and every CPU second the driver spends stretches a learner call in flight (a GPU's kernels
   would not wait). ``--pin-learner driver-low`` keeps the driver on that core but behind the learner: the
   learner's threads at nice 0, the driver's at ``modes.DRIVER_LOW_NICE`` (``cpu_pin.py`` point 2), in every
   mode alike; the driver then takes the time the learner leaves, and it is the driver's replies that wait.
   The result records which was used (``learner_pinned``: "on", "driver", "driver-low" or false).
8. Reporting stays off the measured runs: ThunderSync draws no timeline PNG while it runs
   (``thundersync.timeline_every=0``; Sync draws none either); its steps are drawn from its trace once the run
   has ended (``timeline.draw_trace``). Drawn every step, the niced drawer shared the learner's core: 6.83 s
   against 6.35 s per ThunderSync step (two runs each, interleaved).
9. The machine's speed beside each run: before the first mode and after every mode, one fixed training step of the
   policy on the learner's core (``thundersync_harness.machine_probe``, between the runs, never during one); the
   trace folder's meta.json keeps ``machine_probe_s[mode] = [before, after]`` (median seconds of the probe), which
   the simulator's out-of-sample check reads to tell the machine's drift from its own error.
10. ``--algo opd`` (paper workload only; the recorded one's policy is the teacher itself): the student's turns are
   replayed from the same recording while verl's teacher server (``hf_cpu``, the tiny teacher) scores every turn
   for real on the rollout side's core, as a teacher fleet would beside the rollout fleet. Its streaming bound's
   rows are agent turns (``streaming_bound``); its exactness is ``benchmarks/equivalence.py --algo opd``'s.
11. ``thundersync_tail`` (opt-in, ``--modes thundersync,thundersync_tail``): ThunderSync with tail batching, beside
   plain ThunderSync, with the simulator's prediction of its speed-up (``emulated_tail.py``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from pathlib import Path

import emulated_tail  # the sibling module: the tail-batching mode and its prediction
from emulated_trace import host_cpu, last_landing, reporting_cost, rollout_makespan, streaming_bound  # sibling module
import modes  # the sibling script: run_mode, summarise, thundersync_lower_bound (a second import is harmless)
from thundersync_verl.backends.replay.synthesize import SHAPES
from thundersync_verl.run.results import write_result
from thundersync_verl.run.timeline import draw_trace
from thundersync_harness.machine_probe import run_probe

WORKLOADS = ("recorded", "paper")
# --calibrate on Sync in bypass mode alone (modes_emulated_calibration_<workload>.json), 6 steps, learner and driver
# pinned: recorded (the 1.9 M policy) 0.25 -> wait share 0.419, 0.5 -> 0.518, 1.0 -> 0.564; paper 0.2 -> 0.538,
# 0.35 -> 0.616, so 0.14 for 0.495, which drifted to 0.598-0.603 in later runs (the paired runs at 0.14); recalibrated:
# 0.07 -> 0.554, 0.1 -> 0.562 (the rollout side's own work on its core, not the slept service times, sets the wait
# there), so 0.1, inside the 0.40-0.60 band. The comparison runs report the share they measured.
TIME_SCALE = {"recorded": 0.5, "paper": 0.1}
EMULATED_MODES = ("sync_bypass", "thundersync", "sync", "async", "fully_async")
BYPASS = ["algorithm.rollout_correction.bypass_mode=true"]
# The paper workload's policy: the model factory's larger tiny architecture (the teacher's: 1.9 M parameters,
# ~4.5x the student's per-token learner work), briefly warm-started; a synthesised workload needs no skill.
PAPER_LEARNER = {"variant": "teacher", "train_steps": 20, "n_transcripts": 400}
REPLAY = "+actor_rollout_ref.rollout.engine_kwargs.replay"


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def workload_overrides(workload: str) -> list[str]:
    """Settings every run of a workload shares (recording and replays alike)."""
    out = ["thundersync.env.retry_prob=0",  # transient tool failures are not seeded: later turns would not replay
           "thundersync.env.tool_timeout_s=120"]  # nor would a call timed out on a busy core (the recording had none)
    return out + (SHAPES["paper"].overrides() if workload == "paper" else [])


def env_scale(workload: str, time_scale: float) -> float:
    """Tool and verifier latency scale: the recorded run's 0.2, or the shape's published seconds, times the time scale."""
    return (modes.LATENCY_SCALE if workload == "recorded" else 1.0) * time_scale


def policy_model(workload: str, work: Path) -> Path:
    """The workload's policy (module docstring, point 2): the learner must have enough work to matter (about half
    of a Sync step at the calibrated scale). ``recorded``: the task's trained larger tiny model (the OPD teacher,
    1.9 M parameters), which plays the embedded task for real while it is recorded; ``paper``: PAPER_LEARNER."""
    if workload == "paper":
        return paper_learner(work)
    from thundersync_verl.models import ensure_tiny_models

    return ensure_tiny_models(variants=("teacher",))["teacher"]


def paper_learner(work: Path) -> Path:
    """The paper workload's policy model (PAPER_LEARNER), built once by the model factory."""
    from thundersync_verl.models.factory import build_model, is_built

    path = work / "models" / "paper_learner"
    if not is_built(path):
        build_model(path, PAPER_LEARNER["variant"], train_steps=PAPER_LEARNER["train_steps"],
                    n_transcripts=PAPER_LEARNER["n_transcripts"])
    return path


def make_recording(workload: str, steps: int, inputs: dict, work: Path) -> Path:
    """The workload's recording (made once per step count and policy model): a Sync run recording every generate call."""
    model = hashlib.sha256(str(Path(inputs["student"]).resolve()).encode()).hexdigest()[:8]
    folder = work / "emulated" / f"{workload}_{steps}steps_{model}"
    rec = folder / "recording.jsonl"
    if (folder / "complete").is_file():
        return rec
    folder.mkdir(parents=True, exist_ok=True)
    rec.unlink(missing_ok=True)
    if workload == "recorded":
        extra = ["+actor_rollout_ref.rollout.engine_kwargs.hf_cpu.record_path=" + str(rec)]
        scale = modes.LATENCY_SCALE
    else:  # synthesis: answers are scripted and nothing needs to wait
        extra = ["actor_rollout_ref.rollout.name=replay", f"{REPLAY}.path={rec}", f"{REPLAY}.synthesize=paper"]
        scale = 0.0
    print(f"[emulated] recording the {workload} workload: {steps} Sync steps", flush=True)
    modes.run_mode("sync", steps, inputs, folder, latency_scale=scale, tag="_record",
                   extra=workload_overrides(workload) + extra)
    (folder / "complete").write_text(json.dumps({"workload": workload, "steps": steps}) + "\n")
    return rec


def replay_overrides(rec: Path, time_scale: float) -> list[str]:
    return ["actor_rollout_ref.rollout.name=replay", f"{REPLAY}.path={rec}", f"{REPLAY}.time_scale={time_scale}"]


BASE_MODE = {"sync_bypass": "sync", emulated_tail.TAIL_MODE: "thundersync"}  # the trainer mode each row runs
RUN_TAG = {"sync_bypass": "_bypass", emulated_tail.TAIL_MODE: "_tail"}  # and its run folder's suffix
PIN = {"learner": "on"}  # --pin-learner (module docstring, point 7); the step-1 update runs are never pinned
OVERRIDES: list[str] = []  # --override: extra hydra overrides for every replay (the recording is made without them)
TIMELINES = ["thundersync.timeline_every=0"]  # point 8: drawn after the run, from the trace


def run_replay(mode: str, steps: int, inputs: dict, work: Path, workload: str, rec: Path, time_scale: float,
               tag: str = "", extra: list[str] | None = None, env: dict | None = None, pin: bool | None = None,
               algo: str = "grpo") -> dict:
    base, tag = BASE_MODE.get(mode, mode), tag + RUN_TAG.get(mode, "")
    if mode == emulated_tail.TAIL_MODE:  # plain ThunderSync plus tail batching (emulated_tail.py point 1)
        extra = emulated_tail.overrides() + list(extra or [])
    rewards = work / ((base if algo == "grpo" else f"{algo}_{base}") + tag) / REWARD_LOG  # modes.run_mode's folder
    extra = (workload_overrides(workload) + replay_overrides(rec, time_scale) + (BYPASS if mode == "sync_bypass" else [])
             + reward_log_overrides(rewards) + TIMELINES + OVERRIDES + list(extra or []))
    load0 = _load()
    run = modes.run_mode(base, steps, inputs, work, algo=algo, latency_scale=env_scale(workload, time_scale), tag=tag,
                         extra=extra, env_extra=env, pin_learner=PIN["learner"] if pin is None else pin)
    run["load_1min"] = [load0, _load()]
    return run


REWARD_LOG = "rewards.jsonl"


def reward_log_overrides(path: Path) -> list[str]:
    """The task's real verifier, wrapped by the replay recorder: each call's start and end go to ``path``."""
    fn = "reward.custom_reward_function"
    return [f"{fn}.path=pkg://thundersync_verl.backends.replay.record", f"{fn}.name=record_compute_score_async",
            f"+{fn}.reward_kwargs.record_path={path}",
            f"+{fn}.reward_kwargs.verifier_timeout_s=120"]  # a verifier killed on a busy core would change the reward


# ----- step-1 update gap (point 5): emulated_exactness.py ---------------------------------------------
def step1_update_gap(inputs: dict, work: Path, workload: str, rec: Path) -> dict:
    import emulated_exactness  # the sibling module; it imports this one

    return emulated_exactness.step1_update_gap(inputs, work, workload, rec)


# ----- the comparison ------------------------------------------------------------------------------
def policy_params(model_path) -> int:
    """Parameters of an HF folder's model (from its safetensors header, nothing loaded)."""
    from safetensors import safe_open

    with safe_open(str(Path(model_path) / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def reward_landing(run: dict, workload: str, time_scale: float) -> dict:
    """From a trajectory's end in the agent loop to ThunderSync's driver having its reward: the verifier call as
    measured (the recorder around it; the configured latency model's mean beside it) and the rest (the agent
    loop's post-processing, the reward-loop hop, the TransferQueue put, the driver's listing polls and fetches)."""
    import random

    from thundersync_verl.envs.latency import LatencyModel

    recs = [json.loads(x) for x in open(run["run_dir"] / "grpo_thundersync.jsonl")]
    land = sorted(r["t_reward"] - r["t_done"] for r in recs if r["kind"] == "trajectory" and r["step"] > 1)
    shape = SHAPES["paper"]
    cfg = ({"kind": "mixture"} if workload == "recorded" else
           {"kind": "lognormal", "median_s": shape.reward_median_s, "sigma": shape.reward_sigma, "max_s": shape.reward_max_s})
    model = LatencyModel.from_config({**cfg, "scale": env_scale(workload, time_scale)})
    verifier = sum(model.sample_many(20000, random.Random(0))) / 20000
    calls = [json.loads(x) for x in open(run["run_dir"] / REWARD_LOG)][1:] if (run["run_dir"] / REWARD_LOG).is_file() else []
    call_s = sum(r["landed_s"] - r["start_s"] for r in calls) / max(len(calls), 1) if calls else None
    mean = sum(land) / max(len(land), 1)
    return {"mean_s": round(mean, 3), "p90_s": round(land[int(0.9 * (len(land) - 1))], 3) if land else None,
            "verifier_model_mean_s": round(verifier, 3), "verifier_call_mean_s": None if call_s is None else round(call_s, 3),
            "rest_mean_s": round(mean - (verifier if call_s is None else call_s), 3)}


def one_repeat(modes_run: list[str], steps: int, inputs: dict, work: Path, workload: str, rec: Path,
               time_scale: float, repeat: int, traces: Path, algo: str = "grpo") -> tuple[dict, dict]:
    """Every mode once, back to back; traces in the simulator's schema under ``traces`` (with ``meta.json``)."""
    runs, rows = {}, {}
    traces.mkdir(parents=True, exist_ok=True)
    meta = {"workload": workload, "time_scale": time_scale, "policy_model": str(inputs["student"]),
            "policy_params": policy_params(inputs["student"]), "machine_probe_s": {}}
    (traces / "meta.json").write_text(json.dumps(meta) + "\n")
    before = run_probe(inputs["student"])["probe_s"]  # point 9: the learner core's speed between the runs
    for mode in modes_run:
        runs[mode] = run_replay(mode, steps, inputs, work / "emulated" / f"r{repeat}", workload, rec, time_scale,
                                algo=algo)
        after = run_probe(inputs["student"])["probe_s"]
        meta["machine_probe_s"][mode] = [before, after]
        (traces / "meta.json").write_text(json.dumps(meta) + "\n")
        before = after
        base = BASE_MODE.get(mode, mode)
        rows[mode] = with_medians(modes.summarise(base, runs[mode]), runs[mode])
        rows[mode]["load_1min"] = runs[mode]["load_1min"]
        rows[mode]["host_cpu_s_per_step"] = host_cpu(runs[mode])
        if base == "thundersync":
            trace = runs[mode]["run_dir"] / f"{algo}_thundersync.jsonl"
            (traces / f"{algo}_{mode}.jsonl").write_text(trace.read_text())
            runs[mode]["drawn_after_run"] = draw_trace(trace, runs[mode]["run_dir"] / "timelines")  # point 8
        else:
            modes.write_sim_trace(base, runs[mode], traces / f"{algo}_{mode}.jsonl", algo)
    return runs, rows


def with_medians(row: dict, run: dict) -> dict:
    """Step time and Sync wait share as the median over the timed steps (the mean is kept beside): a load spike
    from other processes on the shared machine (one Sync step's update_actor took 80 s instead of 7 s) must not
    decide a ratio."""
    timed = [run["per_step"][s] for s in sorted(run["per_step"])[1:]] or list(run["per_step"].values())
    return dict(row, step_time_mean_s=row["step_time_s"], wait_share_mean=row["wait_share"],
                step_time_s=statistics.median(m["timing_s/step"] for m in timed),
                wait_share=statistics.median(m.get("timing_s/gen", 0.0) / m["timing_s/step"] for m in timed))


def headline(rows: dict, runs: dict, workload: str, time_scale: float, algo: str = "grpo") -> dict:
    out = {"step_time_s": {m: round(r["step_time_s"], 3) for m, r in rows.items()},
           "step_time_mean_s": {m: round(r["step_time_mean_s"], 3) for m, r in rows.items()},
           "staleness_max": {m: r["staleness_max"] for m, r in rows.items()},
           "learner_busy": {m: round(r["learner_busy"], 3) for m, r in rows.items()},
           "final_reward": {m: round(r["final_reward"], 3) for m, r in rows.items()},
           "load_1min": {m: r["load_1min"] for m, r in rows.items()},
           "host_cpu_s_per_step": {m: r.get("host_cpu_s_per_step") for m, r in rows.items()}}
    for key in ("opd_rows_per_turn", "opd_teacher_calls_per_turn"):  # OPD per turn: how much was shared
        if key in rows.get("thundersync", {}):
            out[key] = round(rows["thundersync"][key], 3)
    syncs = [m for m in ("sync", "sync_bypass") if m in rows]
    if syncs:
        ref = min(syncs, key=lambda m: rows[m]["step_time_s"])
        out["sync_reference"] = ref
        out["sync_learner_wait_share"] = round(rows[ref]["wait_share"], 3)
        out["sync_learner_wait_share_by_config"] = {m: round(rows[m]["wait_share"], 3) for m in syncs}
        bound = streaming_bound(runs[ref], algo)
        out["sync_streaming_bound_speedup"] = None if bound is None else round(rows[ref]["step_time_s"] / bound, 3)
    if syncs and "thundersync" in rows:
        ts = rows["thundersync"]["step_time_s"]
        out["speedup_vs_sync"] = round(rows[out["sync_reference"]]["step_time_s"] / ts, 3)
        out["speedup_vs_sync_by_config"] = {m: round(rows[m]["step_time_s"] / ts, 3) for m in syncs}
        out["thundersync_over_lower_bound"] = round(ts / modes.thundersync_lower_bound(runs["thundersync"], algo), 3)
        if algo == "grpo":
            out["thundersync_over_schedule_bound"] = round(
                ts / modes.thundersync_lower_bound(runs["thundersync"], learner_work=True), 3)
        if out.get("sync_streaming_bound_speedup"):
            out["share_of_streaming_bound"] = round(out["speedup_vs_sync"] / out["sync_streaming_bound_speedup"], 3)
        paces = {m: rollout_makespan(runs[m]) for m in (out["sync_reference"], "thundersync")}
        if all(paces.values()):  # the same replayed work: how much slower the rollout side ran beside the stream
            sync_pace, ts_pace = paces[out["sync_reference"]], paces["thundersync"]
            out["rollout_makespan_s"] = {m: round(p["makespan_s"], 3) for m, p in paces.items()}
            out["rollout_slowdown"] = round(ts_pace["makespan_s"] / sync_pace["makespan_s"], 3)
            if sync_pace["tool_s"] > 0:
                out["tool_time_slowdown"] = round(ts_pace["tool_s"] / sync_pace["tool_s"], 3)
        if algo == "grpo":  # the bound's step ends at Sync's last landing plus its last rows' update
            ends = {m: last_landing(runs[m], m) for m in (out["sync_reference"], "thundersync")}
            if all(ends.values()):
                out["last_landing_s"] = {m: round(e["last_landing_s"], 3) for m, e in ends.items()}
                out["after_last_landing_s"] = {m: round(e["after_s"], 3) for m, e in ends.items()}
        out["reporting"] = reporting_cost(runs["thundersync"])
        if algo == "grpo":  # OPD trains on the teacher's scores, not the verifier's reward
            out["reward_landing"] = reward_landing(runs["thundersync"], workload, time_scale)
    return {**out, **emulated_tail.headline(rows, runs)}


def calibrate(scales: list[float], steps: int, inputs: dict, work: Path, workload: str, results_dir,
              algo: str = "grpo") -> dict:
    """Sync in bypass mode alone at each time scale: its learner wait share; the scale nearest 0.495."""
    rec = make_recording(workload, steps + 2, inputs, work)
    shares = {}
    for scale in scales:
        run = run_replay("sync_bypass", steps, inputs, work / "emulated" / "calibrate", workload, rec, scale,
                         tag=f"_scale{scale}", algo=algo)
        row = with_medians(modes.summarise("sync", run), run)
        shares[str(scale)] = {"sync_learner_wait_share": round(row["wait_share"], 3),
                              "step_time_s": round(row["step_time_s"], 3), "load_1min": run["load_1min"]}
        print(f"[calibrate] {workload} time scale {scale}: Sync (bypass) wait share {row['wait_share']:.3f}, "
              f"step {row['step_time_s']:.2f}s", flush=True)
    chosen = min(shares, key=lambda k: abs(shares[k]["sync_learner_wait_share"] - modes.TARGET_WAIT_SHARE))
    result = {"rollout": "emulated", "algo": algo, "workload": workload, "steps": steps, "calibrated_on": "sync_bypass",
              "learner_pinned": PIN["learner"],
              "target_wait_share": modes.TARGET_WAIT_SHARE, "scales": shares, "chosen_scale": float(chosen)}
    write_result(f"modes_emulated{_algo(algo)}_calibration_{workload}", result, results_dir)
    return result


def main(args, inputs: dict, work: Path, results_dir) -> dict:
    workload, algo = args.workload, args.algo
    steps = 4 if args.quick else args.steps
    if algo == "opd" and args.exactness_only:  # OPD's exactness: benchmarks/equivalence.py --algo opd
        raise SystemExit("modes.py: error: --exactness-only runs GRPO's step-1 update gap; for OPD use "
                         "benchmarks/equivalence.py --algo opd")
    PIN["learner"] = False if args.pin_learner == "off" else args.pin_learner
    OVERRIDES[:] = list(args.override)
    if args.calibrate:
        return calibrate([float(x) for x in args.calibrate.split(",") if x], steps, inputs, work, workload, results_dir,
                         algo)
    if args.exactness_only:
        result = {"rollout": "emulated", "workload": workload, **_g4(step1_update_gap(
            inputs, work, workload, make_recording(workload, steps + 2, inputs, work)))}
        write_result(f"modes_emulated_exactness_{workload}", result, results_dir)
        return result
    time_scale = TIME_SCALE[workload] if args.time_scale is None else args.time_scale
    modes_run = [m for m in (args.modes.split(",") if args.modes else EMULATED_MODES) if m]
    rec = make_recording(workload, emulated_tail.recording_steps(steps, modes_run), inputs, work)
    t0 = time.time()
    repeats = []
    for r in range(args.repeats):
        traces = results_dir / f"traces_emulated{_algo(algo)}_{workload}{_suffix(args)}" / f"r{r}"
        runs, rows = one_repeat(modes_run, steps, inputs, work, workload, rec, time_scale, r, traces, algo)
        modes.print_table(rows, algo)
        repeats.append(headline(rows, runs, workload, time_scale, algo))
        print(f"[emulated] repeat {r + 1}/{args.repeats}: " + json.dumps({k: repeats[-1].get(k) for k in (
            "speedup_vs_sync", "sync_learner_wait_share", "thundersync_over_lower_bound",
            "thundersync_over_schedule_bound", "sync_streaming_bound_speedup", "share_of_streaming_bound",
            "rollout_slowdown", "tool_time_slowdown", "tail_speedup_vs_thundersync", "tail_speedup_predicted") if k in repeats[-1]}), flush=True)
    result = {"rollout": "emulated", "algo": algo, "workload": workload, "steps": steps, "time_scale": time_scale,
              "tool_verifier_latency_scale": env_scale(workload, time_scale), "repeats": len(repeats),
              "learner_pinned": PIN["learner"], "recording": str(rec), "policy_model": str(inputs["student"]),
              **({"overrides": OVERRIDES} if OVERRIDES else {}), **_median_of(repeats), "per_repeat": repeats}
    if not args.no_exactness and "thundersync" in modes_run and algo == "grpo":  # OPD's: equivalence.py --algo opd
        result.update(_g4(step1_update_gap(inputs, work, workload, rec)))
    result["seconds"] = round(time.time() - t0, 1)
    name = "modes_emulated" + _algo(algo) + ("" if workload == "recorded" else f"_{workload}") + _suffix(args)
    write_result(name, result, results_dir)
    return result


def _algo(algo: str) -> str:
    """Result and trace names: GRPO's keep their names, OPD's say so."""
    return "" if algo == "grpo" else f"_{algo}"


def _suffix(args) -> str:
    """Result and trace names: paired repeats, quick runs and the tail pair never overwrite the single full run's."""
    tail = "_tail" if emulated_tail.TAIL_MODE in (args.modes or "").split(",") else ""
    return modes.opd_suffix(args) + tail + ("_repeats" if args.repeats > 1 else "") + ("_quick" if args.quick else "")


def _g4(value):
    """Figures to 4 significant digits, inside dicts too."""
    return {k: _g4(v) for k, v in value.items()} if isinstance(value, dict) else float(f"{value:.4g}")


def _median_of(repeats: list[dict]) -> dict:
    """The headline of the repeat whose speed-up is the median (all figures of one paired run), or the only one:
    ThunderSync's over Sync, or else the tail policy's over plain ThunderSync."""
    key = next((k for k in ("speedup_vs_sync", "tail_speedup_vs_thundersync") if k in repeats[0]), None)
    if len(repeats) == 1 or key is None:
        return dict(repeats[0])
    order = sorted(range(len(repeats)), key=lambda i: repeats[i][key])
    median = dict(repeats[order[len(order) // 2]])
    median[f"{key}_per_repeat"] = [r[key] for r in repeats]
    median[f"{key}_median"] = statistics.median(r[key] for r in repeats)
    if key == "tail_speedup_vs_thundersync":
        median["tail_speedup_predicted_per_repeat"] = [r["tail_speedup_predicted"] for r in repeats]
    return median
