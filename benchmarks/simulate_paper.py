"""Reproduce the published ThunderSyncRL step times with the calibrated simulator.

Why:
1. The simulator's scale-out predictions are only credible if, with physical and sourced
   parameters and no per-mode factor, it reproduces the one published deployment:
   8 B200 (4 learner + 4 rollout), 32 x 8 trajectories per step, ~30B model, SWE agent.
2. It prints the parameter table (published / vendor / assumed / derived), the simulated vs
   published step time per mode for GRPO and OPD, Sync's learner wait share, the
   accumulator footprint, and a utilisation timeline PNG.
Run: python benchmarks/simulate_paper.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from thundersync_verl.sim import presets
from thundersync_verl.sim.sim_engine import simulate
from thundersync_verl.sim.metrics import comparison_table, format_table
from thundersync_verl.sim.plot import plot_timelines
from thundersync_verl.sim.workload import SyntheticSource
from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result

SCRIPT = Path(__file__).stem
MODES = ("sync", "async", "fully_async", "thundersync")




def run_algo(setting, algo: str, steps: int, seed: int) -> dict:
    source = SyntheticSource(setting.workload, setting.rollout, seed=seed)
    return {m: simulate(setting.sim_config(m, algo, steps), source, setting.costs) for m in MODES}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"200 steps instead of {presets.PAPER_STEPS}")
    ap.add_argument("--seed", type=int, default=0)
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    results_dir = find_results_dir(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)  # the plot goes there too
    steps = 200 if args.quick else presets.PAPER_STEPS
    setting = presets.paper_setting()

    print("Parameters of the calibrated ThunderSyncRL setting (no parameter depends on the mode):")
    print(format_table(presets.param_table_rows(setting), ["parameter", "value", "unit", "source", "why"]))
    print(f"\nSimulating {steps} steps per mode, seed {args.seed}.\n")

    results = {algo: run_algo(setting, algo, steps, args.seed) for algo in ("grpo", "opd")}
    rows, errors = [], []
    for algo, by_mode in results.items():
        print(f"{algo.upper()}:\n{comparison_table(list(by_mode.values()))}\n")
        for mode, res in by_mode.items():
            pub = presets.PUBLISHED_STEP_S[algo].get(f"{mode}_s")
            err = (res.step_time_s / pub - 1.0) if pub else None
            if err is not None:
                errors.append(abs(err))
            rows.append([algo, mode, res.step_time_s, "-" if pub is None else pub,
                         "-" if err is None else f"{100 * err:+.1f}%"])
    print(format_table(rows, ["algo", "mode", "simulated_s", "published_s", "rel_err"]))

    sync = results["grpo"]["sync"]
    wait = sync.learner_wait_share
    print(f"\nSync learner waits for rewards {100 * wait:.1f}% of each step "
          f"(published {100 * presets.PUBLISHED_SYNC_LEARNER_WAIT:.1f}%, "
          f"{100 * (wait - presets.PUBLISHED_SYNC_LEARNER_WAIT):+.1f} points).")
    ts = results["grpo"]["thundersync"]
    ranks = setting.cluster.learner_gpus
    print(f"ThunderSync accumulators: peak {ts.peak_open_groups} open groups (budget {setting.budget_groups}), "
          f"{ts.accum_peak_bytes_per_rank / 1e9:,.0f} GB per rank, "
          f"{ranks * ts.accum_peak_bytes_per_rank / 1e12:.2f} TB "
          f"over {ranks} ranks (published 1.3-1.5 TB).")
    print(f"GPU-hours per step: sync {sync.gpu_hours_per_step:.2f}, thundersync {ts.gpu_hours_per_step:.2f} "
          f"(published totals 233.5 vs 121.3 GPU-h at equal accuracy: ratio 1.92; "
          f"simulated ratio {sync.gpu_hours_per_step / ts.gpu_hours_per_step:.2f}).")

    timeline_setting = setting
    traced = [simulate(timeline_setting.sim_config(m, "grpo", 5, record_timeline=True),
                       SyntheticSource(setting.workload, setting.rollout, seed=args.seed), setting.costs)
              for m in MODES]
    png = plot_timelines(traced, results_dir / f"{SCRIPT}_timeline.png")
    print(f"timeline: {png}")

    out = {algo: {f"{m}_s": round(r.step_time_s, 1) for m, r in by_mode.items()} for algo, by_mode in results.items()}
    out["sync_learner_wait_share"] = round(wait, 4)
    out["max_rel_err_vs_published"] = round(max(errors), 4)
    write_result(SCRIPT, out, results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
