"""Soak: ThunderSync steps for N minutes, with the processes' memory, file descriptors and children sampled.

``python benchmarks/soak.py --minutes 10`` (``--quick``: about 2 minutes).

Why:
1. A leak (a bucket never freed, a sandbox never reaped, a socket per weight push) shows only over many
   steps. The run is verl's real ``main_ppo`` with the ThunderSync trainer on the embedded CPU task and
   the live ``hf_cpu`` rollout, so every part that could leak runs: Ray actors, the streaming learner,
   the tool sandboxes and verifier subprocesses, the weight pushes.
2. It is bounded and stops by itself: when the minutes are up the soak creates the run's
   ``thundersync.stop_file`` and the trainer ends at the next step boundary (the way a scheduler's
   pre-emption hook stops a run); the step cap (``MAX_STEPS_PER_MIN``) is only a backstop, and a hard
   limit of three times the minutes kills a run that hangs.
3. Every ``--sample-s`` seconds the driver and all its descendants (Ray's raylet and GCS, the worker
   actors, the sandbox processes they start) are sampled: RSS, open fds, process count. Growth is the
   last sample before the last step ended minus the first sample after the warm-up step (the first
   step builds the model, the pools and the caches once; the shutdown after the last step is not
   growth). A leak grows at the same rate to the end; a cache that fills up during the run (Ray's bounded
   task-event table, allocator arenas) stops: ``rss_growth_mb_second_half`` is the growth over the second
   half of the steps alone, the figure that tells them apart. Every sample is kept in
   ``samples.jsonl`` beside the run's log. After the run exits, every process seen during it that is
   still alive is a leftover, and so is any process naming the run's private Ray folder (a daemon
   that left the tree between two samples).
4. ``trajectories_lost``: the batch's trajectories of every completed step minus those the step
   recorder says the learner streamed.
5. ``--memory-probe``: the driver traces its Python allocations (``run/memory_probe.py``) and the
   sites that grew most since step 2 are reported (``driver_grown_sites``). Tracing slows the driver:
   a diagnostic run, not the soak's figures.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from thundersync_verl.demo import parse_step_line, prepare_inputs, run_env, verl_command
from thundersync_verl.run.results import add_results_dir_argument, write_result

MAX_STEPS_PER_MIN = 30  # a backstop cap on steps (the stop file ends the run; the cpu_tiny step takes 5-20 s here)
PER_STEP = 8 * 4  # recipe: train_batch_size x rollout.n
GRACE_S = 15.0  # after the driver exits, processes get this long to go before they count as leftovers


def tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root] + root.children(recursive=True)
    except psutil.Error:
        return []


def sample(root: psutil.Process, seen: dict) -> dict:
    """RSS (MB), open fds and process count of ``root`` and its descendants, and each one's RSS by pid (to find
    which process grows); remembers every process seen."""
    rss = fds = n = 0
    per_pid = {}
    for p in tree(root):
        try:
            mem = p.memory_info().rss
            rss += mem
            fds += p.num_fds()
            n += 1
            label = " ".join(p.cmdline()[:3])[:120]
            if p.pid not in seen or seen[p.pid][1].startswith("ray::IDLE"):  # a Ray worker names its actor once it has one
                seen[p.pid] = (p.create_time(), label)
            per_pid[str(p.pid)] = round(mem / 2**20, 1)
        except psutil.Error:
            continue
    return {"t": time.time(), "rss_mb": rss / 2**20, "fds": fds, "processes": n, "rss_mb_by_pid": per_pid}


def growth_by_process(first: dict, last: dict, seen: dict, top: int = 5) -> list[str]:
    """The processes whose RSS grew most between two samples: "<MB> MB <command>"."""
    grew = [(last["rss_mb_by_pid"][pid] - mb, pid) for pid, mb in first["rss_mb_by_pid"].items()
            if pid in last["rss_mb_by_pid"]]
    return [f"{d:+.1f} MB {seen.get(int(pid), (0, pid))[1]}" for d, pid in sorted(grew, reverse=True)[:top]]


def leftovers(seen: dict, marker: str) -> list[str]:
    """Processes seen during the run that are still alive (same pid AND start time: not a reused pid), and any
    process whose command line holds ``marker`` (the run's private Ray folder: Ray daemons name it)."""
    alive, me = [], {q.pid for q in [psutil.Process()] + psutil.Process().parents()}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if marker in cmd and p.info["pid"] not in seen and p.info["pid"] not in me:
            alive.append(f"{p.info['pid']}: {cmd[:120]}")
    for pid, (created, cmd) in seen.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid}: {cmd}")
        except psutil.Error:
            continue
    return alive


def run(minutes: float, work: Path, sample_s: float, memory_probe: bool = False) -> dict:
    """One bounded run (module docstring, points 2-3); returns the samples, steps and what was left."""
    from thundersync_harness.engine_setup import build_tiny_model

    model = work / "tiny_random_lm"
    if not (model / "config.json").is_file():
        build_tiny_model(model)
    inputs = prepare_inputs(work, model=str(model))
    steps = max(3, math.ceil(minutes * MAX_STEPS_PER_MIN))
    run_dir = work / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*run_dir.glob("*.jsonl"), run_dir / "STOP", run_dir / "memory_probe.jsonl"]:
        stale.unlink(missing_ok=True)
    cmd = verl_command(inputs, algo="grpo", mode="thundersync", steps=steps,
                       extra=[f"thundersync.run_dir={run_dir}", "thundersync.env.trace_path=" + str(run_dir / "traj.jsonl"),
                              f"thundersync.stop_file={run_dir / 'STOP'}"])
    env = run_env(run_dir, run_dir / "metrics.jsonl")
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ts_soak_ray_")
    if memory_probe:  # point 5: the driver's allocation sites that grow (run/memory_probe.py)
        env["THUNDERSYNC_MEMORY_PROBE"] = str(run_dir / "memory_probe.jsonl")
    samples, step_at, seen = [], {}, {}
    t0 = time.time()
    with open(run_dir / "verl.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        root = psutil.Process(proc.pid)

        def pump():
            for line in proc.stdout:
                log.write(line)
                parsed = parse_step_line(line)
                if parsed:
                    step_at[parsed[0]] = time.time()
                    print(f"[soak] step {parsed[0]}/{steps} at {time.time() - t0:.0f}s", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        while proc.poll() is None:
            if time.time() - t0 > minutes * 60 and not (run_dir / "STOP").exists():
                (run_dir / "STOP").touch()  # point 2: the trainer stops at the next step boundary
                print(f"[soak] {minutes} minutes up: stop file written", flush=True)
            if time.time() - t0 > 3 * minutes * 60 + 600:
                proc.kill()  # a hung run: ends here, and is reported
                break
            samples.append(sample(root, seen))
            time.sleep(sample_s)
        rc = proc.wait()
        reader.join(timeout=30)
    time.sleep(GRACE_S)
    with open(run_dir / "samples.jsonl", "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    stopped = "exists; the run stops at this step boundary" in (run_dir / "verl.log").read_text(errors="replace")
    return {"rc": rc, "steps": steps, "stopped_by_stop_file": stopped, "samples": samples, "step_at": step_at, "t0": t0, "t_end": time.time(),
            "leftovers": leftovers(seen, env["RAY_TMPDIR"]), "processes_seen": len(seen), "run_dir": run_dir,
            "seen": seen}


def learned(run_dir: Path) -> dict[int, int]:
    trace = run_dir / "grpo_thundersync.jsonl"
    counts: dict[int, int] = {}
    for line in (trace.read_text().splitlines() if trace.is_file() else []):
        rec = json.loads(line)
        if rec.get("kind") == "trajectory":
            counts[rec["step"]] = counts.get(rec["step"], 0) + 1
    return counts


def summarise(out: dict, minutes: float) -> dict:
    """Growth after warm-up (point 3), per-minute slopes, leftovers and lost trajectories."""
    steps_done = sorted(out["step_at"])
    warm = out["step_at"].get(steps_done[0], out["t0"]) if steps_done else out["t0"]
    last_step = out["step_at"][steps_done[-1]] if steps_done else out["t_end"]
    during = [s for s in out["samples"] if warm <= s["t"] <= last_step] or out["samples"]  # not the shutdown
    first, last = during[0], during[-1]
    mid = min(during, key=lambda s: abs(s["t"] - (first["t"] + last["t"]) / 2))
    span_min = max((last["t"] - first["t"]) / 60, 1e-9)
    counts = learned(out["run_dir"])
    step_times = [b - a for a, b in zip([out["step_at"][s] for s in steps_done], [out["step_at"][s] for s in steps_done][1:])]
    return {
        "minutes_requested": minutes, "minutes_run": round((out["t_end"] - out["t0"]) / 60, 2), "exit_code": out["rc"],
        "steps_cap": out["steps"], "steps_completed": len(steps_done),
        "stopped_by_stop_file": out["stopped_by_stop_file"],
        "step_s_median": round(sorted(step_times)[len(step_times) // 2], 2) if step_times else None,
        "rss_growth_mb": round(last["rss_mb"] - first["rss_mb"], 1), "rss_mb_after_warmup": round(first["rss_mb"], 1),
        "rss_mb_peak": round(max(s["rss_mb"] for s in during), 1),
        "rss_growth_mb_per_min": round((last["rss_mb"] - first["rss_mb"]) / span_min, 2),
        "rss_growth_by_process": growth_by_process(first, last, out["seen"]),
        "rss_growth_mb_second_half": round(last["rss_mb"] - mid["rss_mb"], 1),
        "rss_growth_by_process_second_half": growth_by_process(mid, last, out["seen"]),
        "fd_growth": last["fds"] - first["fds"], "fds_after_warmup": first["fds"],
        "process_growth": last["processes"] - first["processes"], "processes_after_warmup": first["processes"],
        "processes_peak": max(s["processes"] for s in during),
        "leftover_processes": len(out["leftovers"]), "leftovers": out["leftovers"][:10],
        "processes_seen": out["processes_seen"], "samples": len(out["samples"]),
        "trajectories_learned": sum(counts.values()),
        "trajectories_lost": sum(PER_STEP - counts.get(s, 0) for s in steps_done),
        **probe_summary(out["run_dir"] / "memory_probe.jsonl"),
    }


def probe_summary(path: Path) -> dict:
    """The driver's traced Python memory (``--memory-probe``): its growth and the sites that grew most."""
    records = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    if len(records) < 2:
        return {}
    first, last = records[0], records[-1]
    return {"driver_traced_mb_growth": round(last["traced_mb"] - first["traced_mb"], 2),
            "driver_traced_steps": [first["step"], last["step"]],
            "driver_grown_sites": [f"{g['kb']:+.0f} KB {g['where'][0]}" for g in last["grown"][:5]]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="about 2 minutes")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--memory-probe", action="store_true",
                    help="trace the driver's Python allocations (slower; run/memory_probe.py) and report the sites that grow")
    ap.add_argument("--work-dir", default="runs/soak")
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    minutes = 2.0 if args.quick else args.minutes
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    result = summarise(run(minutes, work, args.sample_s, args.memory_probe), minutes)
    write_result("soak_quick" if args.quick else "soak", result, args.results_dir)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["exit_code"] == 0 else 1)
