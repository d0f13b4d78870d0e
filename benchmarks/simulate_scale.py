"""What each pipeline buys from 8 to 4,096 GPUs, and what ThunderSync's accumulators cost.

Why:
1. The published run is one node; users run up to thousands of GPUs. This sweeps 8, 64, 512
   and 4,096 B200 (half learner, half rollout), a 30B and a 235B model, and a lognormal and
   a Pareto turn tail, and reports each mode's speedup over Sync and ThunderSync's
   accumulator memory per learner rank against the budget (80% of host memory per rank).
2. It also times 1,000 simulated steps of the 4,096-GPU case, the simulator's own cost.
Run: python benchmarks/simulate_scale.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from thundersync_verl.sim import presets
from thundersync_verl.sim.sim_engine import simulate
from thundersync_verl.sim.metrics import format_table
from thundersync_verl.sim.plot import plot_scale
from thundersync_verl.sim.workload import SyntheticSource
from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result

SCRIPT = Path(__file__).stem
GPU_COUNTS = (8, 64, 512, 4096)
MODELS = ("30B", "235B")
TAILS = ("lognormal", "pareto")
MODES = ("sync", "async", "fully_async", "thundersync")




def sweep_one(setting, steps: int, seed: int) -> list[dict]:
    """Every mode on one deployment; thundersync runs under the memory budget and unbounded."""
    source = SyntheticSource(setting.workload, setting.rollout, seed=seed)
    res = {m: simulate(setting.sim_config(m, "grpo", steps), source, setting.costs) for m in MODES}
    free = simulate(setting.sim_config("thundersync", "grpo", steps, budget_groups=None), source, setting.costs)
    budget_gb = presets.SCALE_HOST_MEM_FRACTION * setting.gpu.host_mem_gb
    rows = []
    for mode, r in res.items():
        rows.append({"gpus": setting.cluster.gpus, "model": setting.model.name.split()[0],
                     "tail": setting.name.split("-")[-1],
                     "mode": mode, "step_s": r.step_time_s, "speedup": res["sync"].step_time_s / r.step_time_s,
                     "stale_max": r.staleness_summary()["max"], "open_groups": r.peak_open_groups,
                     "accum_gb_per_rank": r.accum_peak_bytes_per_rank / 1e9,
                     "unbounded_gb_per_rank": free.accum_peak_bytes_per_rank / 1e9,
                     "unbounded_speedup": res["sync"].step_time_s / free.step_time_s,
                     "budget_gb_per_rank": budget_gb, "budget_groups": setting.budget_groups})
    return rows


def time_4096(steps: int, seed: int, modes=("thundersync",)) -> dict:
    setting = presets.scale_setting(4096, "30B", "lognormal")
    source = SyntheticSource(setting.workload, setting.rollout, seed=seed)
    out = {}
    for mode in modes:
        t0 = time.perf_counter()
        simulate(setting.sim_config(mode, "grpo", steps), source, setting.costs)
        out[mode] = time.perf_counter() - t0
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 steps per deployment instead of 24")
    ap.add_argument("--seed", type=int, default=0)
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    results_dir = find_results_dir(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)  # the plot goes there too
    steps = 8 if args.quick else 24
    rows, skipped = [], []
    for gpus in GPU_COUNTS:
        for model in MODELS:
            try:
                settings = [presets.scale_setting(gpus, model, tail) for tail in TAILS]
            except ValueError as exc:  # the model does not fit this cluster
                skipped.append(f"{gpus} GPUs / {model}: {exc}")
                continue
            for setting in settings:
                rows += sweep_one(setting, steps, args.seed)
    table = [[r["gpus"], r["model"], r["tail"], r["mode"], r["step_s"], f"{r['speedup']:.3f}", r["stale_max"],
              r["open_groups"], r["accum_gb_per_rank"], r["budget_gb_per_rank"],
              r["unbounded_gb_per_rank"] if r["mode"] == "thundersync" else "-",
              f"{r['unbounded_speedup']:.3f}" if r["mode"] == "thundersync" else "-"] for r in rows]
    print("thundersync runs under the budget (80% of host memory per learner rank); the last two columns")
    print("show it without a budget: accumulator peak and speedup.")
    print(format_table(table, ["gpus", "model", "tail", "mode", "step_s", "x_sync", "stale_max", "open_grp",
                               "accum_GB/rank", "budget_GB/rank", "unbounded_GB/rank", "unbounded_x_sync"]))
    for s in skipped:
        print("skipped:", s)
    png = plot_scale(rows, results_dir / f"{SCRIPT}.png")
    print(f"plot: {png}")

    timing = time_4096(1000, args.seed)
    print(f"\n1,000 simulated steps of the 4,096-GPU case (30B, lognormal, thundersync, 16,384 trajectories "
          f"per step): {timing['thundersync']:.1f} s")
    if not args.quick:
        more = time_4096(1000, args.seed, ("sync", "async"))
        fa = time_4096(100, args.seed, ("fully_async",))["fully_async"]
        print(f"  sync {more['sync']:.1f} s, async {more['async']:.1f} s for 1,000 steps; fully_async "
              f"{fa:.1f} s for 100 steps (event-driven per trajectory, ~{10 * fa:.0f} s per 1,000)")
    key = lambda r: f"{r['gpus']}/{r['model']}/{r['tail']}"  # noqa: E731
    out = {"seconds_1000_steps_4096_gpus": round(timing["thundersync"], 2),
           "speedup_vs_sync": {}, "accum_gb_per_rank": {}, "budget_gb_per_rank": {}}
    for r in rows:
        out["speedup_vs_sync"].setdefault(key(r), {})[r["mode"]] = round(r["speedup"], 3)
        if r["mode"] == "thundersync":
            out["accum_gb_per_rank"][key(r)] = round(r["accum_gb_per_rank"], 1)
            out["budget_gb_per_rank"][key(r)] = round(r["budget_gb_per_rank"], 1)
    write_result(SCRIPT, out, results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
