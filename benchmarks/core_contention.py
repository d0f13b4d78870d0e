"""How independent are this machine's two cores? The emulated-device runs assume they are.

``python benchmarks/core_contention.py [--quick]``

Why:
1. ``modes.py --rollout emulated`` pins the learner to one core and the rest of verl to the other, as if
   they were two devices. On a VM two vCPUs may share a physical core (SMT) or caches and memory
   bandwidth, so the learner's core can compute slower whenever the other one is busy: a slowdown a
   GPU learner beside busy host CPUs does not have. On the recorded workload ThunderSync's backward
   chunks ran at about half speed while the rollout side was busy and at full speed after it.
2. The measure: a learner-like workload (fp32 matmul forward + backward of a small MLP, one thread)
   pinned to one core, timed for a few seconds while the other core is (a) left alone, (b) running
   a busy Python loop (compute), (c) streaming a large array (memory bandwidth). Arms alternate
   (a, b, c, a, b, c, ...) so that a change in the machine's load hits every arm alike; each arm's
   speed is the median of its rounds, relative to (a): per wall second, and per CPU second of the
   learner (other runnable processes that move onto the learner's core when the other one is taken
   lower the first, not the second; computing slower lowers both).
3. What it cannot do: make the machine quiet. Other jobs on either core lower every arm; the
   ratios are the figures to read, and ``load_1min`` is reported beside them.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

from thundersync_verl.run.results import add_results_dir_argument, write_result


def _pin(core: int) -> None:
    os.sched_setaffinity(0, {core})


def learner_rate(core: int, seconds: float) -> tuple[float, float]:
    """Forward + backward passes of a small MLP on ``core``, one thread: per wall second and per CPU second
    of this process (the second tells slower computing from a core shared with other runnable processes)."""
    import torch

    _pin(core)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    x = torch.randn(64, 256)
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        net(x).square().mean().backward()
        n += 1
    return n / (time.perf_counter() - t0), n / max(time.process_time() - c0, 1e-9)


def _spin(core: int, kind: str, stop) -> None:
    _pin(core)
    if kind == "compute":
        x = 0
        while not stop.is_set():
            for i in range(10000):
                x += i * i
    else:  # memory: copy a 64 MB array back and forth (far beyond the caches)
        import numpy as np

        a, b = np.ones(8 << 20), np.empty(8 << 20)
        while not stop.is_set():
            np.copyto(b, a)
            np.copyto(a, b)


def one_round(kind: str, learner_core: int, other_core: int, seconds: float) -> tuple[float, float]:
    stop = mp.Event()
    spinner = None if kind == "idle" else mp.Process(target=_spin, args=(other_core, kind, stop), daemon=True)
    if spinner is not None:
        spinner.start()
        time.sleep(0.3)  # the spinner is running before the timing starts
    try:
        with mp.get_context("fork").Pool(1) as pool:
            return pool.apply(learner_rate, (learner_core, seconds))
    finally:
        stop.set()
        if spinner is not None:
            spinner.join(5)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds of 2 s per arm")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=4.0, help="timing per arm and round")
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        ap.error(f"needs two cores to pin to; this process may use {cores}")
    rounds, seconds = (3, 2.0) if args.quick else (args.rounds, args.seconds)
    arms = ("idle", "compute", "memory")
    rates = {arm: [] for arm in arms}
    load0 = os.getloadavg()[0]
    for r in range(rounds):
        for arm in arms:
            rates[arm].append(one_round(arm, cores[-1], cores[0], seconds))
        print(f"[core_contention] round {r + 1}/{rounds}: " + ", ".join(
            f"{a} {rates[a][-1][0]:.1f}/s ({rates[a][-1][1]:.1f}/cpu-s)" for a in arms), flush=True)
    wall = {a: statistics.median(x[0] for x in rates[a]) for a in arms}
    cpu = {a: statistics.median(x[1] for x in rates[a]) for a in arms}
    result = {"learner_core": cores[-1], "other_core": cores[0], "rounds": rounds, "seconds_per_round": seconds,
              "passes_per_s_other_idle": round(wall["idle"], 2),
              "speed_other_compute": round(wall["compute"] / wall["idle"], 3),
              "speed_other_memory": round(wall["memory"] / wall["idle"], 3),
              "speed_per_cpu_s_other_compute": round(cpu["compute"] / cpu["idle"], 3),
              "speed_per_cpu_s_other_memory": round(cpu["memory"] / cpu["idle"], 3),
              "load_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    write_result("core_contention_quick" if args.quick else "core_contention", result, args.results_dir)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
