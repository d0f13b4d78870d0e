"""Does learner-like work on the learner's core slow the emulated rollout? Sync (bypass) with that core idle or loaded.

``python benchmarks/rollout_under_load.py [--quick] [--duty 0.5] [--repeats 3]``

Why:
1. ``modes.py --rollout emulated`` reads ThunderSync's share of the streaming bound against a bound computed from
   Sync's own timings, where the rollout runs while the learner's core is idle. ThunderSync runs its backwards
   during the rollout, and its rollout then takes 4-13% longer (``rollout_slowdown``). Two causes can be told
   apart: the stream's own work on the rollout side's core (the driver's listings and reads, the TransferQueue)
   or the machine (two vCPUs that are not independent: ``core_contention.py``).
2. This run removes the stream: Sync (bypass) alone, pinned as ``modes.py`` pins it, its rollout timed with the
   learner's core idle and with a learner-like load there (a one-thread MLP forward and backward, ``duty`` of
   every 0.2 s, at the nice Ray starts its workers with, so the learner's own calls still get their share).
   The load never touches the rollout side's core; whatever it costs the rollout is the machine's.
3. Arms alternate (idle, loaded, loaded, idle, ...) and every run replays the same recording, so version ``v``
   of one arm and of the other did the same work: the headline is the median over repeats and versions of
   loaded / idle makespan of the same version (the first version left out, as ``rollout_makespan`` does).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import emulated_rollout as er
import modes
from emulated_trace import version_makespans
from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result

LOAD_PERIOD_S = 0.2
RAY_WORKER_NICE = 15  # the nice Ray gives its worker processes (``cpu_pin.py`` point 2)
LOAD_CODE = """
import os, sys, time
import torch
os.sched_setaffinity(0, {int(sys.argv[1])})
os.nice(int(sys.argv[3]))
torch.set_num_threads(1)
net = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
x = torch.randn(256, 1024)
duty, period = float(sys.argv[2]), float(sys.argv[4])
while True:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < duty * period:
        net(x).square().mean().backward()
    time.sleep(max(0.0, (1.0 - duty) * period))
"""


def one_arm(loaded: bool, duty: float, steps: int, inputs: dict, rec: Path, arm_dir: Path) -> dict:
    core = sorted(os.sched_getaffinity(0))[-1]  # the learner's core (``cpu_pin.LearnerPin``)
    load = subprocess.Popen([sys.executable, "-c", LOAD_CODE, str(core), str(duty), str(RAY_WORKER_NICE),
                             str(LOAD_PERIOD_S)]) if loaded else None
    try:
        run = er.run_replay("sync_bypass", steps, inputs, arm_dir, "paper", rec, er.TIME_SCALE["paper"])
        step_s = round(modes.summarise("sync", run)["step_time_s"], 3)
    finally:
        if load is not None:
            load.kill()
            load.wait()
    spans = version_makespans(run["traj_path"])
    return {"makespan_s": {v: round(s, 3) for v, s in sorted(spans.items())}, "step_s": step_s}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats of 4 steps")
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs (idle, loaded), in alternating order")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--duty", type=float, default=0.5, help="share of each 0.2 s the load computes (0-1]")
    ap.add_argument("--work-dir", default="runs/modes", help="as modes.py's (the recording is shared)")
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    if not 0.0 < args.duty <= 1.0:
        ap.error(f"--duty {args.duty}: give a share of the time in (0, 1]")
    if args.repeats < 1 or args.steps < 3:
        ap.error("--repeats must be at least 1 and --steps at least 3 (the first version is not timed)")
    if len(os.sched_getaffinity(0)) < 2:
        ap.error("needs two cores: the learner's, and the rollout side's")
    results_dir = find_results_dir(args.results_dir)
    repeats, steps = (2, 4) if args.quick else (args.repeats, args.steps)
    work = Path(args.work_dir).resolve()
    inputs = modes.prepare_inputs(work, model=str(er.policy_model("paper", work)), variants=("student",))
    rec = er.make_recording("paper", steps + 2, inputs, work)
    t0, arms, ratios = time.time(), [], []
    for r in range(repeats):
        pair = {}
        for loaded in ((False, True) if r % 2 == 0 else (True, False)):
            name = "loaded" if loaded else "idle"
            pair[name] = one_arm(loaded, args.duty, steps, inputs, rec, work / "under_load" / f"r{r}_{name}")
            print(f"[under_load] repeat {r + 1}/{repeats} {name}: makespan per version {pair[name]['makespan_s']}",
                  flush=True)
        arms.append(pair)
        common = sorted(set(pair["idle"]["makespan_s"]) & set(pair["loaded"]["makespan_s"]))[1:]
        ratios += [pair["loaded"]["makespan_s"][v] / pair["idle"]["makespan_s"][v] for v in common]
    result = {"workload": "paper", "steps": steps, "repeats": repeats, "duty": args.duty,
              "rollout_slowdown_under_load": round(statistics.median(ratios), 3),
              "version_ratios": [round(x, 3) for x in ratios],
              "makespan_median_s": {k: round(statistics.median(s for p in arms for v, s in p[k]["makespan_s"].items()
                                                               if v > min(p[k]["makespan_s"])), 3)
                                    for k in ("idle", "loaded")},
              "per_repeat": arms, "seconds": round(time.time() - t0, 1)}
    write_result("rollout_under_load" + ("_quick" if args.quick else ""), result, results_dir)
    return result


if __name__ == "__main__":
    main()
