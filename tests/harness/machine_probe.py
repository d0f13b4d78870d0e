"""How fast the learner's core is right now: one fixed training step of the run's own policy, timed on that core.

Why:
1. This machine is shared: the same learner work costs up to 30% more CPU from one run to the next (verl's Sync
   and its bypass mode, the same ``update_actor`` on the same trajectories, 28% apart per token in one set). A
   simulator fitted on one run and checked on another then carries that drift in its error, whatever its model.
2. The probe measures the drift without touching either run: the policy model of the run, a FIXED batch (seeded
   token ids, fixed shape), forward + backward, gradients dropped after each, on the learner's cores with one
   torch thread, in a process of its own between the runs (never while one runs, so it slows nothing). Its
   median time is a speed reference of the machine; its ratio between two runs is how much slower the second
   ran for identical work. Nothing in it depends on a run's mode, workload or results.
3. ``python -m thundersync_harness.machine_probe MODEL`` (run it under ``taskset``, as ``run_probe`` does) prints ``{"probe_s": ..., "times_s": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS, LENGTH, WARMUP, TIMED = 8, 128, 2, 11


def probe_seconds(model_path: str | Path, rows: int = ROWS, length: int = LENGTH, timed: int = TIMED) -> list[float]:
    """Seconds of each timed forward + backward of ``rows`` x ``length`` seeded tokens (in this process)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), torch_dtype=torch.float32)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))
    times = []
    for i in range(WARMUP + timed):
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return times


def run_probe(model_path: str | Path, cpus: set[int] | None = None, timeout_s: float = 300.0) -> dict:
    """The probe in a process of its own on ``cpus`` (default: the last CPU this process may use, the learner's
    core of ``cpu_pin.LearnerPin``): ``{"probe_s": median seconds, "times_s": [...], "cpus": [...]}``."""
    cpus = cpus or {sorted(os.sched_getaffinity(0))[-1]}
    cmd = ["taskset", "-c", ",".join(map(str, sorted(cpus))), sys.executable, "-m", "thundersync_harness.machine_probe",
           str(model_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"machine probe failed ({' '.join(cmd)}): {done.stderr.strip()[-400:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "cpus": sorted(cpus)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="an HF-format causal LM folder (the run's policy)")
    args = ap.parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        ap.error(f"{args.model}: no config.json; pass the folder of an HF-format model")
    times = probe_seconds(args.model)
    print(json.dumps({"probe_s": round(statistics.median(times), 5), "times_s": [round(t, 5) for t in times]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
