"""Sandbox start cost and the agent loop's event loop: fork server vs prlimit (vfork) vs preexec_fn (fork).

Why:
1. verl's agent-loop worker runs every trajectory of a batch on one asyncio loop. A tool call that
   blocks that loop while its sandbox starts delays every other trajectory's generation and reward.
2. With a ``preexec_fn`` CPython must fork() the whole parent process (a trainer-side process holds
   hundreds of MB) and waits for the exec; without one it takes the vfork/posix_spawn path
   (``prlimit`` sets the limits). Either way every call starts a fresh interpreter (~10 ms of CPU);
   the fork server (``envs/forkserver.py``, the default) forks a small pre-started one instead.
3. This runs ``concurrency`` sandboxed calls at once from a process holding ``--parent-mb`` of
   memory, once per path, alternating rounds, and reports the wall time, the longest stall of a
   1 ms ticker on the same loop (what the other trajectories feel) and the CPU the whole machine
   spent per call (``/proc/stat``: parent, children, kernel; other load on the machine adds noise).
Run: python benchmarks/sandbox_spawn.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from thundersync_harness.cpu_pin import cpu_ticks
from thundersync_verl.envs import sandbox
from thundersync_verl.run.results import add_results_dir_argument, write_result


def _busy_ticks() -> int:
    """The whole machine's busy clock ticks (every CPU's, all but idle and iowait)."""
    return sum(busy for busy, _ in cpu_ticks().values())


async def one_round(concurrency: int, spawn: str) -> tuple[float, float, float]:
    stalls, stop = [], False

    async def ticker():
        while not stop:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            stalls.append(time.perf_counter() - t)

    await sandbox.run_python_async("print(0)", spawn=spawn)  # a fork server starts once per process, not per call
    tick = asyncio.create_task(ticker())
    busy0, t0 = _busy_ticks(), time.perf_counter()
    results = await asyncio.gather(*[sandbox.run_python_async("print(1)", spawn=spawn) for _ in range(concurrency)])
    wall = time.perf_counter() - t0
    stop = True
    await tick
    cpu_ms = 1000.0 * (_busy_ticks() - busy0) / os.sysconf("SC_CLK_TCK") / concurrency
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} sandbox calls failed, e.g. {bad[0]}")
    return wall, max(stalls), cpu_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 5")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--parent-mb", type=int, default=400, help="memory the calling process holds (a worker's)")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    if sandbox._prlimit() is None:
        raise SystemExit("prlimit (util-linux) is not installed: only the preexec_fn path exists here")
    ballast = bytearray(args.parent_mb << 20)  # resident: fork() must copy its page tables
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    with_prlimit = sandbox._prlimit
    paths = ("fork", "prlimit", "preexec_fn")
    figures = {p: {"wall": [], "stall": [], "cpu_ms": []} for p in paths}
    rounds = 2 if args.quick else 5
    for r in range(rounds):
        for path in paths:
            sandbox._prlimit = (lambda: None) if path == "preexec_fn" else with_prlimit
            wall, stall, cpu_ms = asyncio.run(one_round(args.concurrency, "fork" if path == "fork" else "exec"))
            for key, value in (("wall", wall), ("stall", stall), ("cpu_ms", cpu_ms)):
                figures[path][key].append(value)
            print(f"round {r + 1}/{rounds} {path:10s} {args.concurrency} calls in {wall:.3f} s, longest loop stall "
                  f"{stall:.3f} s, {cpu_ms:.1f} ms CPU per call", flush=True)
    sandbox._prlimit = with_prlimit
    med = {p: {k: statistics.median(v) for k, v in f.items()} for p, f in figures.items()}
    result = {"concurrency": args.concurrency, "parent_mb": args.parent_mb}
    for key, name, digits in (("wall", "wall_s", 3), ("stall", "loop_stall_s", 3), ("cpu_ms", "cpu_ms_per_call", 2)):
        result.update({f"{name}_{p}": round(med[p][key], digits) for p in paths})
    # the fork server's CPU per call over a fresh interpreter's (target < 0.6; a timed test asserted it once)
    result["fork_over_exec_cpu_per_call"] = round(med["fork"]["cpu_ms"] / med["prlimit"]["cpu_ms"], 3)
    write_result(Path(__file__).stem, result, args.results_dir)


if __name__ == "__main__":
    main()
