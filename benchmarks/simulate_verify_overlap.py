"""Does starting a trajectory's backward before its verifier answers pay, at the paper's scale?

Why:
1. ThunderSync trains a GRPO trajectory when its reward lands; with SWE verifiers (test runs
   of seconds to minutes) that latency stays on the step's critical path. ThunderSync with
   verify overlap (`thundersync_verl/sim/verify_overlap.py`) trains a completed trajectory
   before its reward lands when the learner would otherwise idle, and pays a second backward
   for the smaller class of each group's early trajectories and a third fp32 buffer per open
   group. This study predicts the step time of Sync, ThunderSync and ThunderSync+verify_overlap
   on the calibrated paper setting (8 B200, 32 x 8 trajectories, ~30B) across pass rates
   0.1-0.9 and verifier latency scales (x the SWE-shaped test-run latency, 1 = SWE-shaped).
2. Memory is held equal: ThunderSync's budget of k = 5 open groups is 2k + 1 = 11 buffers per
   rank; at 3 buffers per open group verify overlap fits floor(2k / 3) = 3 groups. Sensitivity
   runs: verify overlap with 5 groups (16 buffers, +45% accumulator memory), both policies
   without a memory budget, general (non-binary) rewards, and a narrow verifier (lognormal,
   sigma 0.3, the SWE median): the same mean work without the heavy tail.
3. It prints the tables, ends with ONE line of JSON (step times per setting, the crossover,
   the best gain, the gain in the SWE-shaped setting, and whether that gain reaches the 5%
   that would justify the trainer option) written to benchmarks/results/simulate_verify_overlap.json,
   and draws benchmarks/results/simulate_verify_overlap.png.
Run: python benchmarks/simulate_verify_overlap.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result
from thundersync_verl.sim import presets
from thundersync_verl.sim.dists import lognormal
from thundersync_verl.sim.sim_engine import simulate
from thundersync_verl.sim.events import place_rollouts
from thundersync_verl.sim.metrics import format_table
from thundersync_verl.sim.sim_verifier import SWE_VERIFIER, SWE_VERIFIER_NOTE, VerifiedSource, VerifierSpec, scaled
from thundersync_verl.sim.workload import SyntheticSource

SCRIPT = Path(__file__).stem
PASS_RATES = (0.1, 0.3, 0.5, 0.7, 0.9)
LATENCY_SCALES = (0.0, 0.1, 0.3, 1.0, 3.0)
SWE_SCALE = 1.0  # the SWE-shaped setting
NARROW_SIGMA = 0.3
WORTH_BUILDING = 0.05  # the gain over ThunderSync that would justify the trainer option
WIN = 1e-3  # a gain counts as a win above 0.1% (paired runs on the same trajectories; below is noise)
SWE_MEDIAN_S = float(SWE_VERIFIER.quantile(np.array([0.5]))[0])
STEPS, QUICK_STEPS = presets.PAPER_STEPS, 30
VO = "verify_overlap"
# pass-rate independent policies; the verify_overlap_* ones with binary rewards depend on the pass rate
FLAT = ("sync", "thundersync", "thundersync_unbounded", "verify_overlap_general")
PER_PASS = (VO, "verify_overlap_same_groups", "verify_overlap_unbounded")
PAIRS = {VO: "thundersync", "verify_overlap_same_groups": "thundersync",
         "verify_overlap_unbounded": "thundersync_unbounded", "verify_overlap_general": "thundersync"}


def policies(setting) -> dict:
    """SimConfig keyword arguments of every policy, at the paper's memory budget unless named otherwise."""
    k = setting.budget_groups
    same_bytes = (2 * k) // 3  # 3 buffers per open group within ThunderSync's 2k + 1
    vo = {"mode": "thundersync", "verify_overlap": True}
    return {
        "sync": {"mode": "sync"},
        "thundersync": {"mode": "thundersync"},
        VO: {**vo, "budget_groups": same_bytes},
        "verify_overlap_same_groups": {**vo, "budget_groups": k},
        "thundersync_unbounded": {"mode": "thundersync", "budget_groups": None},
        "verify_overlap_unbounded": {**vo, "budget_groups": None},
        "verify_overlap_general": {**vo, "budget_groups": same_bytes, "verify_rewards": "general"},
    }


def latency_dist(family: str, scale: float):
    if family == "swe" or scale == 0:
        return scaled(SWE_VERIFIER, scale)
    return lognormal(SWE_MEDIAN_S * scale, NARROW_SIGMA, cap=SWE_VERIFIER.cap)


def run_one(setting, family: str, scale: float, p: float, kw: dict, steps: int, seed: int):
    spec = VerifierSpec(latency=latency_dist(family, scale), pass_rate=p)
    src = VerifiedSource(SyntheticSource(setting.workload, setting.rollout, seed=seed), spec, seed=seed)
    return simulate(setting.sim_config(steps=steps, **kw), src, setting.costs)


def reward_bound(setting, family: str, scale: float, steps: int, seed: int) -> float:
    """Mean step time if the learner were done the moment the step's last reward lands (optimizer + push after).

    No policy whose optimizer step needs every reward (zero staleness) can beat it, so
    1 - bound / ThunderSync caps what training before the reward can gain.
    """
    src = VerifiedSource(SyntheticSource(setting.workload, setting.rollout, seed=seed),
                         VerifierSpec(latency=latency_dist(family, scale)), seed=seed)
    c = setting.costs
    barrier = c.step_overhead_s + c.optimizer_s + c.weight_sync_s + c.step_gap_s
    last = [float((place_rollouts(b.dur_s, 0.0, setting.rollout.slots).done + b.reward_s).max())
            for b in (src.batch(k) for k in range(1, steps))]  # step 0 is the warm-up
    return float(np.mean(last)) + barrier


def run_cell(setting, family: str, scale: float, names, steps: int, seed: int) -> tuple[dict, dict]:
    """Step times of `names` at one latency scale -> ({policy: s or {p: s}}, {policy: per-step extras})."""
    kws, out, extra = policies(setting), {"reward_bound": reward_bound(setting, family, scale, steps, seed)}, {}
    for name in names:
        if name in FLAT:
            res = run_one(setting, family, scale, 0.5, kws[name], steps, seed)
            out[name] = res.step_time_s
            extra[name] = res
        else:
            runs = {p: run_one(setting, family, scale, p, kws[name], steps, seed) for p in PASS_RATES}
            out[name] = {p: r.step_time_s for p, r in runs.items()}
            extra[name] = runs
    return out, extra


def gains(times: dict, policy: str) -> dict:
    """{pass rate: 1 - t(policy) / t(its ThunderSync pair)}."""
    base, t = times[PAIRS[policy]], times[policy]
    if isinstance(t, dict):
        return {p: 1.0 - v / base for p, v in t.items()}
    return {p: 1.0 - t / base for p in PASS_RATES}


def crossover(grid: dict, policy: str) -> dict:
    """Per pass rate: the latency scale from which on `policy` beats its ThunderSync pair by > WIN
    (interpolated between the grid's scales), or None when it does not at the largest scale."""
    scales = sorted(grid)
    out = {}
    for p in PASS_RATES:
        g = [gains(grid[s], policy)[p] for s in scales]
        win = [x > WIN for x in g]
        first = next((j for j in range(len(scales)) if all(win[j:])), None)
        if first is None:
            out[p] = None
        elif first == 0:
            out[p] = scales[0]
        else:
            s0, s1, g0, g1 = scales[first - 1], scales[first], g[first - 1], g[first]
            out[p] = s0 + (s1 - s0) * (WIN - g0) / (g1 - g0)  # g0 <= WIN < g1
    return out


def describe_run(res, setting) -> str:
    ex = res.extra
    return (f"early {ex['early_backwards'].mean():.1f}/{setting.workload.batch_size} per step, second backwards "
            f"{ex['second_backwards'].mean():.1f} (min class {ex['min_class'].mean():.1f}), "
            f"{ex['second_lane_s'].mean():.1f} s of lane, peak {res.peak_open_groups} open groups, "
            f"{res.accum_peak_bytes_per_rank / 1e9:,.0f} GB/rank")


def print_family(family: str, grid: dict, runs: dict, setting) -> None:
    rows = []
    for s, times in sorted(grid.items()):
        g = gains(times, VO)
        cells = [f"{times[VO][p]:,.1f} ({100 * g[p]:+.1f}%)" for p in PASS_RATES]
        median = SWE_MEDIAN_S * s
        bound = times["reward_bound"]
        rows.append([f"x{s:g} (median {median:.0f} s)", times.get("sync", float("nan")), times["thundersync"],
                     f"{bound:,.1f} ({100 * (1 - bound / times['thundersync']):+.1f}%)", *cells])
    heads = ["verifier", "sync_s", "thundersync_s", "reward_bound_s"] + [f"vo p={p:g}" for p in PASS_RATES]
    print(f"\n{family} verifier: step time (s) and verify_overlap's gain over ThunderSync, same accumulator bytes")
    print(format_table(rows, heads))
    sens = [n for n in ("verify_overlap_same_groups", "verify_overlap_unbounded", "verify_overlap_general")
            if n in next(iter(grid.values()))]
    rows = [[f"x{s:g}", n] + [f"{100 * gains(times, n)[p]:+.1f}%" for p in PASS_RATES]
            for s, times in sorted(grid.items()) for n in sens]
    print(format_table(rows, ["verifier", "variant (vs its ThunderSync)"] + [f"p={p:g}" for p in PASS_RATES]))
    for s in sorted(runs):
        print(f"  x{s:g}, p=0.3: {describe_run(runs[s][VO][0.3], setting)}")


def markdown_table(grid: dict) -> str:
    """The README table: one row per latency scale, Sync, ThunderSync, and verify overlap per pass rate."""
    head = ("| verifier (median) | Sync | ThunderSync | bound | "
            + " | ".join(f"VO p={p:g}" for p in PASS_RATES) + " |")
    lines = [head, "|" + "---|" * (4 + len(PASS_RATES))]
    for s, times in sorted(grid.items()):
        g = gains(times, VO)
        cells = " | ".join(f"{times[VO][p]:.1f} ({100 * g[p]:+.1f}%)" for p in PASS_RATES)
        bound = times["reward_bound"]
        lines.append(f"| x{s:g} ({SWE_MEDIAN_S * s:.0f} s) | {times['sync']:.1f} | {times['thundersync']:.1f} | "
                     f"{bound:.1f} ({100 * (1 - bound / times['thundersync']):+.1f}%) | {cells} |")
    return "\n".join(lines)


def plot(grids: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    swe, narrow = grids["swe"], grids["narrow"]
    scales = sorted(swe)
    fig, axes = plt.subplots(2, len(scales), figsize=(3.3 * len(scales), 6.4), sharex=True)
    for j, s in enumerate(scales):
        top, bot = axes[0, j], axes[1, j]
        t = swe[s]
        top.plot(PASS_RATES, [t["sync"]] * len(PASS_RATES), "k--", label="Sync")
        top.plot(PASS_RATES, [t["thundersync"]] * len(PASS_RATES), "b-", label="ThunderSync")
        top.plot(PASS_RATES, [t[VO][p] for p in PASS_RATES], "ro-", label="ThunderSync+verify_overlap")
        top.plot(PASS_RATES, [t["reward_bound"]] * len(PASS_RATES), "g:", label="last reward + barrier")
        top.set_title(f"SWE verifier x{s:g} (median {SWE_MEDIAN_S * s:.0f} s)", fontsize=9)
        for name, style, label in ((VO, "ro-", "same bytes (3 groups)"),
                                   ("verify_overlap_same_groups", "m^-", "same groups (+45% bytes)"),
                                   ("verify_overlap_unbounded", "gs-", "no memory budget")):
            bot.plot(PASS_RATES, [100 * gains(t, name)[p] for p in PASS_RATES], style, label=label, ms=4)
        if s in narrow:
            bot.plot(PASS_RATES, [100 * gains(narrow[s], VO)[p] for p in PASS_RATES], "c*:",
                     label="narrow verifier, same bytes", ms=5)
            bot.plot(PASS_RATES, [100 * gains(narrow[s], "verify_overlap_unbounded")[p] for p in PASS_RATES],
                     "cd--", label="narrow verifier, no budget", ms=4)
        bot.axhline(0.0, color="k", lw=0.6)
        bot.axhline(100 * WORTH_BUILDING, color="grey", lw=0.6, ls=":")
        bot.set_xlabel("pass rate")
    axes[0, 0].set_ylabel("predicted step time (s)")
    axes[1, 0].set_ylabel("gain over ThunderSync (%)")
    axes[0, 0].legend(fontsize=7)
    axes[1, -1].legend(fontsize=7)
    fig.suptitle("ThunderSync + verify overlap at the paper's scale (8 B200, 32 x 8, 30B)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def simulate_all(setting, steps: int, seed: int) -> tuple[dict, dict]:
    """grids[family][scale][policy] and, for the SWE family, the runs (for per-step extras)."""
    grids, runs = {"swe": {}, "narrow": {}}, {}
    for s in LATENCY_SCALES:
        grids["swe"][s], runs[s] = run_cell(setting, "swe", s, FLAT + PER_PASS, steps, seed)
        if s > 0:
            names = ("thundersync", "thundersync_unbounded", VO, "verify_overlap_unbounded")
            grids["narrow"][s], _ = run_cell(setting, "narrow", s, names, steps, seed)
    return grids, runs


def headline(grids: dict, setting, steps: int, seed: int) -> dict:
    rnd = lambda x: None if x is None else round(float(x), 4)  # noqa: E731
    swe = grids["swe"]
    best = max(((fam, s, name, p, g) for fam, grid in grids.items() for s, times in grid.items()
                for name in times if name in PAIRS for p, g in gains(times, name).items()), key=lambda c: c[4])
    best_headline = max(((s, p, g) for s, times in swe.items() for p, g in gains(times, VO).items()),
                        key=lambda c: c[2])
    at_swe = gains(swe[SWE_SCALE], VO)
    unbounded = gains(swe[SWE_SCALE], "verify_overlap_unbounded")
    step_times = {fam: {f"x{s:g}": {name: ({f"{p:g}": round(v, 1) for p, v in t.items()} if isinstance(t, dict)
                                           else round(t, 1)) for name, t in times.items()}
                        for s, times in grid.items()} for fam, grid in grids.items()}
    loses = [[s, p] for s, times in swe.items() if s > 0 for p, g in gains(times, VO).items() if g < -WIN]
    return {
        "setting": {"preset": "paper (8 B200, 32 x 8, 30B)", "steps": steps, "seed": seed,
                    "thundersync_budget_groups": setting.budget_groups,
                    "verify_overlap_budget_groups": policies(setting)[VO]["budget_groups"],
                    "verifier": SWE_VERIFIER_NOTE, "swe_median_s": round(SWE_MEDIAN_S, 1),
                    "narrow_verifier": f"lognormal(median x scale, sigma {NARROW_SIGMA})",
                    "pass_rates": list(PASS_RATES), "latency_scales": list(LATENCY_SCALES)},
        "step_time_s": step_times,
        "crossover": {"latency_scale_where_vo_starts_winning_by_pass_rate": {
            fam: {f"{p:g}": rnd(c) for p, c in crossover(grid, VO).items()} for fam, grid in grids.items()},
            "unbounded_memory": {f"{p:g}": rnd(c) for p, c in crossover(swe, "verify_overlap_unbounded").items()},
            "vo_loses_at_scale_pass_rate": loses},
        "best_gain_vs_thundersync": {"gain": rnd(best[4]), "verifier": best[0], "latency_scale": best[1],
                                     "policy": best[2], "pass_rate": best[3],
                                     "same_bytes_swe": {"gain": rnd(best_headline[2]),
                                                        "latency_scale": best_headline[0],
                                                        "pass_rate": best_headline[1]}},
        "swe_shaped_gain_vs_thundersync": {"latency_scale": SWE_SCALE,
                                           "by_pass_rate": {f"{p:g}": rnd(g) for p, g in at_swe.items()},
                                           "max": rnd(max(at_swe.values())),
                                           "max_without_memory_budget": rnd(max(unbounded.values())),
                                           "any_zero_staleness_policy_at_most": rnd(
                                               1.0 - swe[SWE_SCALE]["reward_bound"] / swe[SWE_SCALE]["thundersync"])},
        "worth_building": bool(max(at_swe.values()) >= WORTH_BUILDING),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps per run instead of {STEPS}")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (overrides --quick)")
    ap.add_argument("--seed", type=int, default=0)
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    results_dir = find_results_dir(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)  # the plot goes there too
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    setting = presets.paper_setting()
    print(f"Paper setting, {steps} steps per run, seed {args.seed}. Verifier: {SWE_VERIFIER_NOTE}; "
          f"latency scales {LATENCY_SCALES}, pass rates {PASS_RATES}.")
    t0 = time.time()
    grids, runs = simulate_all(setting, steps, args.seed)
    for family in ("swe", "narrow"):
        print_family(family, grids[family], runs if family == "swe" else {}, setting)
    print(f"\nREADME table (SWE-shaped verifier, same accumulator bytes):\n{markdown_table(grids['swe'])}")
    png = plot(grids, results_dir / f"{SCRIPT}.png")
    print(f"\nplot: {png}; simulated in {time.time() - t0:.0f} s")
    write_result(SCRIPT, headline(grids, setting, steps, args.seed), results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
