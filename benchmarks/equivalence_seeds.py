"""``benchmarks/equivalence.py --seeds``: the per-seed results gathered into one verdict (that script's point 12)."""

from __future__ import annotations

import argparse
import statistics

from thundersync_verl.run.results import write_result


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1,2``: distinct non-negative integers separated by commas (point 12)."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seeds like 0,1,2, got {text!r}") from None
    if min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"expected distinct non-negative seeds, got {text!r}")
    return seeds


def aggregate_seeds(per_seed: list[dict]) -> dict:
    """Point 12: one result from every seed's (each with ``seed`` and ``seconds``): the median seed's keys,
    ``gap_over_floor`` its worst-step gap/floor (``median_high``), the worst and the per-seed list beside it."""
    ratios = [r["gap_over_floor"] for r in per_seed]
    median = statistics.median_high(ratios)
    pick = per_seed[ratios.index(median)]
    result = {k: v for k, v in pick.items() if k not in ("seed", "seconds")}
    result.update(gap_over_floor=median, gap_over_floor_per_seed=ratios, gap_over_floor_worst=max(ratios),
                  seeds=[r["seed"] for r in per_seed], median_seed=pick["seed"], per_seed=per_seed)
    if all("gap_over_floor_applied" in r for r in per_seed):  # equivalence.py point 19, aggregated the same way
        applied = [r["gap_over_floor_applied"] for r in per_seed]
        result.update(gap_over_floor_applied=statistics.median_high(applied), gap_over_floor_applied_per_seed=applied,
                      gap_over_floor_applied_worst=max(applied))
    if all("gap_over_verl_rescaled_applied" in r for r in per_seed):
        result["gap_over_verl_rescaled_applied_worst"] = max(r["gap_over_verl_rescaled_applied"] for r in per_seed)
    return result


def report_seeds(args, seconds: float, failed: dict | None = None) -> dict:
    """Point 12: the per-seed worst steps, their median (the verdict) and the worst beside it; JSON <name>_seeds.
    ``failed``: the seed whose comparison raised; the seeds before it are written to <name>_seeds_partial, with the
    seeds never run named, so a complete <name>_seeds is never overwritten by fewer seeds."""
    result = aggregate_seeds([r for _, r in args.per_seed])
    name = args.per_seed[0][0] + ("_seeds" if failed is None else "_seeds_partial")
    if failed is not None:
        done = {r["seed"] for _, r in args.per_seed}
        not_run = [s for s in args.seeds if s not in done and s != failed["seed"]]
        result.update(failed_seed=failed, seeds_not_run=not_run)
        print(f"\nseed {failed['seed']} failed ({failed['error']}); the {len(done)} seed(s) compared before it are "
              f"saved as {name}.json", flush=True)
    median, worst = result["gap_over_floor"], result["gap_over_floor_worst"]
    print(f"\nseeds {', '.join(map(str, result['seeds']))}: worst-step gap/floor "
          + ", ".join(f"{r:.2f}" for r in result["gap_over_floor_per_seed"])
          + f"; median {median:.2f} (seed {result['median_seed']}) -> {'PASS' if median <= 2.0 else 'FAIL'}, "
          + f"worst seed {worst:.2f}{'' if worst <= 2.0 else ' (above 2)'}; {seconds:.0f} s"
          + ("" if failed is None else f" (PARTIAL: {len(result['seeds'])} of {len(args.seeds)} seeds)"))
    if "gap_over_floor_applied" in result:
        print("on the applied gradient (point 19): " + ", ".join(f"{r:.2f}" for r in result["gap_over_floor_applied_per_seed"])
              + f"; median {result['gap_over_floor_applied']:.2f}, worst seed {result['gap_over_floor_applied_worst']:.2f}"
              + (f"; the stream's gap over verl's x24 vs x16, worst step of all seeds "
                 f"{result['gap_over_verl_rescaled_applied_worst']:.2f}" if "gap_over_verl_rescaled_applied_worst" in result else ""))
    result["seconds"] = round(seconds, 1)
    write_result(name, result, args.results_dir)
    return result
