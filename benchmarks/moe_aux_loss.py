"""Does an MoE router loss's gradient depend on which rows share a micro-batch? verl's own update, measured.

Why:
1. The streaming learner refuses Megatron's router losses (``learner/engine_rules.py``, rule
   ``auxiliary_losses``). A streamed step backpropagates rows in chunks of 1-4 in arrival order, and bucket
   rows apart before folding them with their group's coefficient, so it can equal verl's update only if every
   row's gradient is a function of that row alone (times a scalar). This script measures whether the router
   losses break that, on verl's OWN update (no streaming involved): the tiny Qwen3-MoE of
   ``thundersync_harness.moe`` (4 experts, top-2) on verl's Megatron engine, one router loss on at a time
   (``--kinds``, coefficient ``--coef``; the checkpoint's 0 and verl's ``none`` balancing otherwise).
2. Per step, verl's update on the same rows (``moe.composition_steps``): in order; regrouped (every row gets
   new micro-batch companions, the same micro-batch size and count: the equivalence floor's regrouping); in
   micro-batches of half the size; and the router term alone (every advantage 0, so the policy term vanishes)
   in order and regrouped. Without a router loss, regrouping moves the update by fp32 summation noise only
   (the floor); a router loss whose gradient depends on micro-batch composition moves it far beyond, and its
   own term changes by O(1) when regrouped.
3. The streamed step is tried once per setting and must be refused whenever a router loss is on
   (``refusal``); with none it must run. Then it runs with that refusal lifted (``moe.router_probe_worker_class``,
   every other rule kept): its gap to verl's update over the floor is what the refusal prevents.
JSON: benchmarks/results/moe_aux_loss.json.
Run: python benchmarks/moe_aux_loss.py [--kinds aux_loss,z_loss] [--coef 1e-3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from thundersync_harness import moe
from thundersync_harness.engine_setup import make_trajectories, prepare_environment, start_group
from thundersync_harness.engine_steps import train
from thundersync_harness.megatron_engine import megatron_config
from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result

GROUPS, MICRO = 4, 4


def measure(kind: str | None, coef: float, steps: int, seed: int) -> dict:
    """One setting in its own Ray session: the rows of ``moe.composition_rows`` and the stream's refusal."""
    import ray

    work, ray_tmp = Path(tempfile.mkdtemp(prefix="ts_moe_aux_")), prepare_environment()
    try:
        path, pad_id, vocab = moe.build_moe_model(work / "model")
        config = moe.apply_moe(megatron_config(path, groups=GROUPS, micro=MICRO),
                               aux=(kind, coef) if kind else None)
        wg = start_group(moe.router_probe_worker_class(), config.actor_rollout_ref, 1)
        batches = [make_trajectories(3000 + 100 * seed + s, GROUPS, vocab) for s in range(steps)]
        refusal = moe.stream_refusal(wg, batches[0], pad_id)
        runs = {k: train(wg, fns) for k, fns in moe.composition_steps(wg, batches, pad_id, MICRO).items()}
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return {"kind": kind or "none", "coef": coef if kind else 0.0, "steps": moe.composition_rows(runs),
            "refusal": refusal}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default=",".join(moe.AUX_KINDS), help=f"comma-separated, of {moe.AUX_KINDS}")
    parser.add_argument("--coef", type=float, default=1e-3, help="the router loss coefficient (Qwen3-MoE's: 1e-3)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="one step, aux_loss only (a smoke run in about a minute)")
    add_results_dir_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.kinds = 1, "aux_loss"
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        moe.parse_aux(f"{k}:{args.coef}")  # refuse an unknown kind before minutes of work
    results_dir, t0 = find_results_dir(args.results_dir), time.time()
    settings = [measure(kind, args.coef, args.steps, args.seed) for kind in [None, *kinds]]
    floor = statistics.median(r["regrouped"] for r in settings[0]["steps"])
    print(f"\nverl's own update on a tiny Qwen3-MoE (4 experts, top-2), rows regrouped vs in order; "
          f"floor (no router loss) {floor:.3e}")
    print(f"{'router loss':>22} | {'regrouped/floor':>15} | {'half micro/floor':>16} | {'router share':>12} | "
          f"{'router term regrouped':>21} | {'stream/floor':>12} | learner")
    for r in settings:
        rows = r["steps"]
        worst = max(rows, key=lambda x: x["regrouped"])
        term = [x["router_regrouped"] for x in rows if x["router_regrouped"] is not None]
        r.update(regrouped_over_floor=max(x["regrouped"] for x in rows) / floor,
                 half_micro_over_floor=max(x["half_micro"] for x in rows) / floor,
                 router_share=max(x["router_share"] for x in rows),
                 stream_over_floor=max(x["stream"] for x in rows) / floor,
                 router_regrouped_min=min(term) if term else None)
        print(f"{r['kind'] + ':' + format(r['coef'], 'g'):>22} | {r['regrouped_over_floor']:>15.1f} | "
              f"{r['half_micro_over_floor']:>16.1f} | {worst['router_share']:>12.2e} | "
              f"{'-' if not term else format(min(term), '.2e') + ' .. ' + format(max(term), '.2e'):>21} | "
              f"{r['stream_over_floor']:>12.1f} | {'refuses' if r['refusal'] else 'streams'}")
    result = {"model": "tiny Qwen3-MoE, 4 experts, top-2, 2 layers", "engine": "megatron", "coef": args.coef,
              "floor": floor, "settings": settings, "seconds": round(time.time() - t0, 1)}
    write_result("moe_aux_loss_quick" if args.quick else "moe_aux_loss", result, results_dir)
    return result


if __name__ == "__main__":
    main()
