"""Zero staleness at fleet scale: does tail batching cut the batch's tail where plain ThunderSync cannot?

Why:
1. At 4,096 GPUs the scale preset has Sync at 853 s a step with the rollout fleet idle 75% for the
   batch's longest trajectories, ThunderSync 1.1x and Fully Async 5.1x at a staleness of up to 5.
   Tail batching (thundersync_verl/sim/tail.py) launches ceil(eta x P) prompt groups for a batch of
   P, trains the first P to complete, aborts and queues the rest, and runs the queued prompts again
   in a later round at the weights of that round: staleness 0. This study sweeps it beside Sync,
   Async, Fully Async and plain ThunderSync, and beside Sync running the same tail policy (`sync_tail`,
   the fair reference: what the tail policy gives without streaming, `tail_x_sync_tail` what streaming adds).
2. Every mode runs at the learner/rollout split the planner picks for it (planner.plan_split), on
   the same GPUs, batch and prompts (sim/tail_study.py). The batch is swept per rollout GPU of the
   half/half layout (the preset caps it at 16k sequences, 8 per rollout GPU at 4,096 GPUs), so no
   conclusion rests on the cap; the engines hold 64 sequences per rollout GPU.
3. Reported per deployment: step time, GPU-hours per million trained tokens, staleness, wasted
   tokens, deferral statistics, and the trained response lengths under the tail policy against
   Sync's (the known risk: training on the first to finish favours short responses).
4. It prints the tables, draws step time vs GPUs per mode (benchmarks/results/simulate_tail.png)
   and ends with ONE line of JSON (benchmarks/results/simulate_tail.json): for 512 and 4,096 GPUs
   and both tails, the ratios over Sync, the staleness, waste and deferral of the best tail variant,
   whether it reaches 0.8 of Fully Async's step rate at 4,096 GPUs, and whether it wins 1.5x over
   plain ThunderSync anywhere at 512+ GPUs. Without --quick (both models, more batches, variants
   and steps) the same goes to simulate_tail_full.json and simulate_tail_full.png.
Run: python benchmarks/simulate_tail.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result
from thundersync_verl.sim.metrics import format_table
from thundersync_verl.sim.plot import plot_step_times
from thundersync_verl.sim.tail_study import SYNC_TAIL, TAIL, Deployment, Variant, run_deployment

SCRIPT = Path(__file__).stem
GPU_COUNTS = (8, 64, 512, 4096)
TAILS = ("lognormal", "pareto")
QUICK_VARIANTS = (Variant(1.25, 2), Variant(1.25, 1), Variant(1.5, 2), Variant(1.25, 2, "mixed"))
FULL_VARIANTS = QUICK_VARIANTS + (Variant(1.125, 2), Variant(1.5, 1), Variant(2.0, 1), Variant(1.25, 4),
                                  Variant(1.5, 4), Variant(1.25, 1, "mixed"), Variant(1.5, 4, "mixed"))
GOAL_RATE = 0.8  # the tail policy's step rate over Fully Async's at 4,096 GPUs
WIN = 1.5  # over plain ThunderSync at 512+ GPUs


def deployments(quick: bool) -> list[tuple[Deployment, tuple]]:
    """(deployment, tail variants): b = 8 and 64 per rollout GPU on every GPU count (the preset's batch is b = 64 up
    to 512 GPUs and b = 8 at 4,096, its 16k cap). Quick: 30B without 4,096 x b = 64 (131k trajectories a step, the
    one costly point; the same b at 512 GPUs gives its ratios). Full: that point too (quick variants), b = 16 and 32
    at 512 GPUs, and 235B from 64 GPUs."""
    out = []
    for model in ("30B",) if quick else ("30B", "235B"):
        for tail in TAILS:
            for gpus in GPU_COUNTS:
                if model == "235B" and gpus < 64:
                    continue  # its training state does not fit 4 learner GPUs
                for b in (64, 32, 16, 8):
                    if b in (16, 32) and (quick or gpus != 512 or model != "30B"):
                        continue
                    big = gpus == 4096 and b == 64
                    if big and (quick or model != "30B"):
                        continue
                    out.append((Deployment(gpus, model, tail, b), QUICK_VARIANTS if quick or big else FULL_VARIANTS))
    return out


def is_preset(dep: Deployment) -> bool:
    return dep.reference().workload.batch_size == Deployment(dep.gpus, dep.model, dep.tail, None).reference(
        ).workload.batch_size


def best_tail(rows: list[dict]) -> dict:
    return min((r for r in rows if r["mode"] == TAIL), key=lambda r: r["step_s"])


def headline(rows: list[dict]) -> dict:
    """One deployment's figures for the JSON (module docstring, point 4)."""
    by = {r["mode"]: r for r in rows if r["mode"] != TAIL}
    tail = best_tail(rows)
    ref = next(r for r in rows if r["mode"] == TAIL)
    r3 = lambda x: None if x is None else round(x, 3)  # noqa: E731
    return {
        "batch": tail["batch"], "sync_step_s": round(by["sync"]["step_s"], 1),
        "thundersync_tail_x_sync": r3(tail["x_sync"]), "fully_async_x_sync": r3(by["fully_async"]["x_sync"]),
        "plain_thundersync_x_sync": r3(by["thundersync"]["x_sync"]), "async_x_sync": r3(by["async"]["x_sync"]),
        "sync_tail_x_sync": r3(by[SYNC_TAIL]["x_sync"]),  # the same tail policy with Sync's learner (tail_study point 4)
        "tail_x_sync_tail": r3(by[SYNC_TAIL]["step_s"] / ref["step_s"]),  # what streaming adds to the reference variant
        "tail_variant": tail["variant"], "tail_x_plain_thundersync": r3(tail["x_thundersync"]),
        "tail_over_fully_async_step_rate": r3(tail["rate_over_fully_async"]),
        "staleness_max": tail["staleness_max"],  # the tail policy's (0: every trained token is on-policy)
        "staleness_max_by_mode": {m: r["staleness_max"] for m, r in {**by, TAIL: tail}.items()},
        "step_s": {m: round(r["step_s"], 1) for m, r in {**by, TAIL: tail}.items()},
        "fully_async_staleness_mean": r3(by["fully_async"]["staleness_mean"]),
        "wasted_token_share": r3(tail["wasted_token_share"]), "learner_wasted_share": r3(tail["learner_wasted_share"]),
        "deferred_prompt_share": r3(tail["deferred_prompt_share"]), "delay_rounds_mean": r3(tail["delay_rounds_mean"]),
        "delay_rounds_max": tail["delay_rounds_max"],
        "queued_round_share": r3(tail["queued_round_share"]), "queued_round_s": r3(tail["queued_round_s"]),
        "fresh_round_s": r3(tail["fresh_round_s"]),
        "gpu_hours_per_mtoken": {m: r3(r["gpu_hours_per_mtoken"]) for m, r in {**by, TAIL: tail}.items()},
        "learner_gpus": {m: r["learner_gpus"] for m, r in {**by, TAIL: ref}.items()},
        "response_tokens": {"sync": _lengths(by["sync"]), "thundersync_tail": _lengths(tail)},
        "reference_variant": {"variant": ref["variant"], "x_sync": r3(ref["x_sync"]),
                              "x_plain_thundersync": r3(ref["x_thundersync"])},
        "workload_s": {k: r3(v) for k, v in tail["workload"].items()},
        "trajectory_mean_over_fully_async_step": r3(tail["workload"]["trajectory_mean_s"]
                                                     / by["fully_async"]["step_s"]),
    }


def _lengths(row: dict) -> dict:
    return {k: round(v) for k, v in row["response_tokens"].items() if k in ("mean", "p50", "p90")}


def print_tables(rows: list[dict]) -> None:
    table = [[r["deployment"], r["batch"], f"{r['mode']}{' ' + r['variant'] if r['variant'] else ''}",
              r["learner_gpus"], r["step_s"], f"{r['x_sync']:.2f}", f"{r['x_thundersync']:.2f}",
              f"{r['rate_over_fully_async']:.2f}", r["gpu_hours_per_mtoken"],
              f"{r['staleness_max']}/{r['staleness_mean']:.2f}", f"{100 * r['wasted_token_share']:.0f}%",
              f"{100 * r['deferred_prompt_share']:.0f}%", r["delay_rounds_max"]] for r in rows]
    print(format_table(table, ["deployment", "batch", "mode", "learner", "step_s", "x_sync", "x_ts", "rate/FA",
                               "GPUh/Mtok", "stale max/mean", "waste", "deferred", "delay_max"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="30B, 4 tail variants, 16 steps (full: both models, "
                                                         "b = 16 and 32 too, 11 variants, 32 steps)")
    ap.add_argument("--seed", type=int, default=0)
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    results_dir = find_results_dir(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    name = SCRIPT if args.quick else f"{SCRIPT}_full"  # --quick is the checked result; the full sweep sits beside it
    steps, plan_steps = (16, 8) if args.quick else (32, 12)
    t0 = time.perf_counter()
    rows, heads = [], {}
    for dep, variants in deployments(args.quick):
        dep_rows = run_deployment(dep, list(variants), steps, plan_steps, seed=args.seed)
        rows += dep_rows
        heads[dep.label] = {"preset_batch": is_preset(dep), **headline(dep_rows)}
        print(f"{dep.label}: done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print_tables(rows)
    best = {id(best_tail([r for r in rows if r["deployment"] == d])) for d in heads}
    png = plot_step_times([r for r in rows if r["mode"] != TAIL or id(r) in best], results_dir / f"{name}.png")
    print(f"plot: {png}")
    write_result(name, summarize(heads, args.quick, steps, time.perf_counter() - t0), results_dir)
    return 0


def summarize(heads: dict, quick: bool, steps: int, seconds: float) -> dict:
    """The JSON line: headlines at 512 and 4,096 GPUs, the goal and the 1.5x question over every deployment."""
    big = {k: v for k, v in heads.items() if int(k.split("/")[0]) >= 512}
    goal = {k: v["tail_over_fully_async_step_rate"] for k, v in big.items() if k.startswith("4096/")}
    win = {k: v["tail_x_plain_thundersync"] for k, v in big.items()}
    return {
        "quick": quick, "steps": steps, "seconds": round(seconds, 1),
        "variants": [v.label for v in (QUICK_VARIANTS if quick else FULL_VARIANTS)],
        "headline": big,
        "goal_tail_rate_over_fully_async_4096": goal, "goal_met": any(x >= GOAL_RATE for x in goal.values()),
        "tail_x_plain_thundersync_512plus": win,
        "tail_x_sync_tail_512plus": {k: v["tail_x_sync_tail"] for k, v in big.items()},
        "win_1p5x_anywhere": any(x >= WIN for x in win.values()),
        "win_1p5x_everywhere": all(x >= WIN for x in win.values()),
        "response_tokens_tail_over_sync": {k: {q: round(v["response_tokens"]["thundersync_tail"][q] /
                                                    v["response_tokens"]["sync"][q], 3) for q in ("mean", "p50", "p90")}
                                           for k, v in big.items()},
        "small_clusters": {k: {"tail_x_plain_thundersync": v["tail_x_plain_thundersync"],
                               "plain_thundersync_x_sync": v["plain_thundersync_x_sync"]}
                           for k, v in heads.items() if k not in big},
    }


if __name__ == "__main__":
    sys.exit(main())
