"""Sandbox spawning and the agent loop's event loop: prlimit (vfork) vs preexec_fn (fork), side by side.

Why:
1. verl's agent-loop worker runs every trajectory of a batch on one asyncio loop. A tool call that
   blocks that loop while its sandbox starts delays every other trajectory's generation and reward.
2. With a ``preexec_fn`` CPython must fork() the whole parent process (a trainer-side process holds
   hundreds of MB) and waits for the exec; without one it takes the vfork/posix_spawn path. The
   sandbox sets its rlimits through ``prlimit`` for that reason (``envs/sandbox.py`` point 3).
3. This runs ``concurrency`` sandboxed calls at once from a process holding ``--parent-mb`` of
   memory, once per path, alternating rounds, and reports the wall time and the longest stall of
   a 1 ms ticker on the same loop (what the other trajectories feel).
Run: python benchmarks/sandbox_spawn.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from thundersync_verl.envs import sandbox  # noqa: E402
from thundersync_verl.results import write_result  # noqa: E402


async def one_round(concurrency: int) -> tuple[float, float]:
    stalls, stop = [], False

    async def ticker():
        while not stop:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            stalls.append(time.perf_counter() - t)

    tick = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    results = await asyncio.gather(*[sandbox.run_python_async("print(1)") for _ in range(concurrency)])
    wall = time.perf_counter() - t0
    stop = True
    await tick
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} sandbox calls failed, e.g. {bad[0]}")
    return wall, max(stalls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 5")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--parent-mb", type=int, default=400, help="memory the calling process holds (a worker's)")
    args = parser.parse_args()
    if sandbox._prlimit() is None:
        raise SystemExit("prlimit (util-linux) is not installed: only the preexec_fn path exists here")
    ballast = bytearray(args.parent_mb << 20)  # resident: fork() must copy its page tables
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    with_prlimit = sandbox._prlimit
    figures: dict[str, dict[str, list[float]]] = {"prlimit": {"wall": [], "stall": []}, "preexec_fn": {"wall": [], "stall": []}}
    rounds = 2 if args.quick else 5
    for r in range(rounds):
        for path in figures:
            sandbox._prlimit = with_prlimit if path == "prlimit" else (lambda: None)
            wall, stall = asyncio.run(one_round(args.concurrency))
            figures[path]["wall"].append(wall)
            figures[path]["stall"].append(stall)
            print(f"round {r + 1}/{rounds} {path:10s} {args.concurrency} calls in {wall:.3f} s, longest loop stall {stall:.3f} s",
                  flush=True)
    sandbox._prlimit = with_prlimit
    med = {p: {k: statistics.median(v) for k, v in f.items()} for p, f in figures.items()}
    write_result(Path(__file__).stem, {
        "concurrency": args.concurrency, "parent_mb": args.parent_mb,
        "wall_s_prlimit": round(med["prlimit"]["wall"], 3), "wall_s_preexec_fn": round(med["preexec_fn"]["wall"], 3),
        "loop_stall_s_prlimit": round(med["prlimit"]["stall"], 3),
        "loop_stall_s_preexec_fn": round(med["preexec_fn"]["stall"], 3),
    })


if __name__ == "__main__":
    main()
