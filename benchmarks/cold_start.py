"""Seconds from ``thundersync demo`` to its step-1 line on an empty model cache: ``python benchmarks/cold_start.py``.

Why:
1. A user's first run is ``make demo`` on a fresh machine. The tiny student and teacher ship in the
   package, so nothing should be built: the time to step 1 is verl's own start-up (Ray, the engines,
   the rollout servers) plus the first step. The target is 90 s.
2. Each algorithm runs the real demo command (``thundersync demo --algo A --steps 2``) in a subprocess
   with ``$THUNDERSYNC_MODEL_DIR`` pointing at a new empty folder, and the clock runs from the launch to
   the first line that reports step 1. The machine's 1-minute load average is recorded beside it: on two
   shared cores other jobs move the figure a lot.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from thundersync_verl.run.results import add_results_dir_argument, write_result

TARGET_S = 90.0
STEP1 = re.compile(r"\]\s+step\s+1/")


def time_to_step1(algo: str, timeout_s: float) -> dict:
    """One cold-cache demo; returns its seconds to the step-1 line and the load around it."""
    models = Path(tempfile.mkdtemp(prefix="ts_cold_models_"))
    work = Path(tempfile.mkdtemp(prefix="ts_cold_demo_"))
    env = dict(os.environ, THUNDERSYNC_MODEL_DIR=str(models))
    cmd = [sys.executable, "-m", "thundersync_verl.cli", "demo", "--algo", algo, "--steps", "2", "--work-dir", str(work),
           "--results-dir", str(work / "results")]
    load0, t0, seconds = os.getloadavg()[0], time.time(), None
    try:
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                if seconds is None and STEP1.search(line):
                    seconds = time.time() - t0
                    print(f"[cold_start] {algo}: step 1 at {seconds:.1f} s", flush=True)
                if time.time() - t0 > timeout_s:
                    proc.kill()
                    break
            rc = proc.wait()
    finally:
        shutil.rmtree(models, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    if seconds is None:
        raise RuntimeError(f"thundersync demo --algo {algo} printed no step-1 line (exit code {rc})")
    return {"seconds_to_step1": round(seconds, 1), "load_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algo", choices=["grpo", "opd", "both"], default="both")
    ap.add_argument("--quick", action="store_true", help="the same measurement (one demo per algorithm is the run)")
    ap.add_argument("--timeout-s", type=float, default=900.0)
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    algos = ["grpo", "opd"] if args.algo == "both" else [args.algo]
    runs = {algo: time_to_step1(algo, args.timeout_s) for algo in algos}
    result = {f"{algo}_seconds_to_step1": r["seconds_to_step1"] for algo, r in runs.items()}
    result.update(target_s=TARGET_S, within_target=all(r["seconds_to_step1"] <= TARGET_S for r in runs.values()),
                  load_1min={algo: r["load_1min"] for algo, r in runs.items()})
    write_result("cold_start", result, args.results_dir)
    return result


if __name__ == "__main__":
    main()
