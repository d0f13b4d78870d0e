"""The CPU recipe on a local multi-node Ray cluster against one node: ``python benchmarks/multinode.py --quick``.

Why:
1. The layouts run on real raylets (``thundersync_verl/run/cluster.py``): a head declaring no learner/rollout
   slot and worker nodes declaring the slots of one role each, so the learner pool and the standalone rollout
   pool land on different nodes by construction. The run is stock ``main_ppo`` pointed at the head
   (``RAY_ADDRESS``), the way a user reaches a running cluster; where every actor ran is read back from
   Ray's actor table (``placement``), and a layout whose learner and rollout share a node fails the run.
   ``--layout dp2`` puts two learner ranks on two nodes (``trainer.nnodes=2``, FSDP2 over gloo between raylets)
   against the same data-parallel size on one node. ``--layout megatron_dp2`` is the same with verl's Megatron actor
   (``main_ppo_runs.MEGATRON_OVERRIDES``: megatron-core, distributed optimizer, gloo between raylets) on the
   Megatron tiny model (``build_megatron_model``: vocabulary padded to 128), recorded with that model.
2. Exactness: every run replays one recording (``replay`` backend, nothing slept) with
   ``thundersync.deterministic=true`` (batch order, whole chunks), so the cluster run and the same steps on one
   node sum the same gradients in the same order. ``update_gap`` is the relative distance of their pushed
   updates; ``update_gap_over_floor`` divides it by the rounding floor of the project's e2e equality rule
   (``main_ppo_runs.UPDATE_ATOL``, 1e-4 relative: below it every main_ppo comparison so far was rounding).
3. ``weight_push_crossed_nodes``: the learner ran on one node, the rollout server that received every push on
   another, and the last version arrived (the replay server keeps each push). The push goes through the
   ``cpu_channel`` checkpoint engine (Ray's object store, so between raylets it is a real object transfer), or
   ``sparse_sync`` (``--push``: only the changed elements, over the same object store).
4. ``trajectories_lost``: trajectories of the batch minus those the cluster run's completed steps learned
   from (the step recorder's trace). ``leftover_processes``: processes of the cluster still alive after it was
   stopped (read from ``/proc``).
5. Per-step costs, cluster against one node, from each run's own step metrics: the weight push
   (``timing_s/update_weights``), the driver's TransferQueue listings (``thundersync/listings``, their seconds
   ``thundersync/listing_s``) and its reads of landed rows (``thundersync/fetch_s``), generation and the step. The full run adds Sync and Async on the cluster (``--modes``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from thundersync_harness import cluster_runs as cr
from thundersync_harness import main_ppo_runs as runs
from thundersync_verl.run.cluster import LocalCluster, layout
from thundersync_verl.run.results import add_results_dir_argument, write_result

DETERMINISTIC = ["thundersync.deterministic=true"]
PER_STEP = 8 * 4  # prompts x rollout.n of the CPU recipe
COSTS = ("timing_s/step", "timing_s/gen", "timing_s/update_weights", "timing_s/stream", "thundersync/listings",
         "thundersync/listing_s", "thundersync/fetch_s")  # the push, the driver's polling and its TransferQueue reads
MODES = ("thundersync", "sync", "async")
DP2 = (["trainer.n_gpus_per_node=2"], ["trainer.nnodes=2", "trainer.n_gpus_per_node=1"])
MEGATRON = runs.MEGATRON_OVERRIDES
# layout -> (cluster layout, overrides on one node, overrides on the cluster, learner nodes): the same learner
# data-parallel size either way
LAYOUTS = {"split": ("split", [], [], 1),
           "dp2": ("dp2", *DP2, 2),
           "megatron_dp2": ("dp2", *([*MEGATRON, *x] for x in DP2), 2)}


def log(msg: str) -> None:
    print(f"[multinode] {msg}", file=sys.stderr, flush=True)


def setup(work: Path, steps: int, megatron: bool = False) -> tuple[Path, Path]:
    """The tiny policy (Megatron's: vocabulary padded) and the recording every run replays, made with that policy
    (its log-probs are the policy's); built once, cached under ``work``."""
    model = work / ("megatron_random_lm" if megatron else "tiny_random_lm")
    if not (model / "config.json").is_file():
        shutil.rmtree(model, ignore_errors=True)  # a failed attempt's half-written folder
        if megatron:
            from thundersync_harness.megatron_engine import build_megatron_model as build
        else:
            from thundersync_harness.engine_setup import build_tiny_model as build
        build(model)
    rec_work = work / (f"recording_{steps}_megatron" if megatron else f"recording_{steps}")
    rec = rec_work / "recording.jsonl"
    if not (rec_work / "recorded").is_file():
        log(f"recording {steps} Sync step(s)")
        rec_work.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(rec_work / "record", ignore_errors=True)  # a failed attempt's half-written run
        runs.record(rec_work, model, steps)
        (rec_work / "recorded").touch()
    return model, rec


def learned(run_dir: Path) -> int:
    """Trajectories the run's completed steps learned from (the step recorder's trace)."""
    trace = run_dir / "grpo_thundersync.jsonl"
    lines = trace.read_text().splitlines() if trace.is_file() else []
    return sum(json.loads(line).get("kind") == "trajectory" for line in lines if line.strip())


def fresh(work: Path, name: str) -> None:
    for folder in (work / name, work / f"weights_{name}"):
        shutil.rmtree(folder, ignore_errors=True)


def one_run(cluster, work, model, rec, name, mode, steps, shape: list[str]) -> dict:
    fresh(work, name)
    t0 = time.time()
    extra = (DETERMINISTIC if mode == "thundersync" else []) + shape
    rows, weights = cr.replayed(cluster, work, model, rec, name, mode, extra, steps=steps)
    where = cr.placement(cluster) if cluster is not None else {}
    log(f"{name}: {len(rows)} step(s) in {time.time() - t0:.0f}s" + (f", placement {where}" if where else ""))
    costs = {k: round(sum(r.get(k, 0.0) for r in rows) / max(len(rows), 1), 4) for k in COSTS}
    return {"rows": rows, "weights": weights, "placement": where, "costs": costs, "run_dir": work / name,
            "staleness_max": max((r.get("training/off_policy/trajectory_staleness/max", 0) for r in rows), default=None)}


def separated(where: dict, *roles: str) -> bool:
    """The learner and each of ``roles`` (default: the standalone rollout pool) ran, on disjoint nodes (point 1)."""
    learner = set(where.get("learner", []))
    return bool(learner) and all(where.get(r) and not learner & set(where[r]) for r in roles or ("rollout",))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 step, ThunderSync only (the acceptance run)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: 1 with --quick, else 2)")
    ap.add_argument("--modes", default=None, help=f"modes run on the cluster, comma-separated, from {','.join(MODES)} "
                    "(default: thundersync with --quick, else all)")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="split",
                    help="split: head + learner node + rollout node; dp2: head + two learner nodes (trainer.nnodes=2, "
                    "data-parallel 2 across nodes, against DP 2 on one node) + rollout node; megatron_dp2: dp2 with "
                    "verl's Megatron actor (megatron-core over gloo, distributed optimizer)")
    ap.add_argument("--push", choices=["cpu_channel", "sparse_sync"], default="cpu_channel",
                    help="the checkpoint engine that carries the weight push (both runs; Sync's hybrid push ignores it)")
    ap.add_argument("--work-dir", default="runs/multinode")
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    steps = args.steps or (1 if args.quick else 2)
    modes = [m for m in (args.modes or ("thundersync" if args.quick else ",".join(MODES))).split(",") if m]
    bad = [m for m in modes if m not in MODES] + (["--steps must be >= 1"] if steps < 1 else [])
    if bad or "thundersync" not in modes:
        ap.error(f"bad --modes/--steps: {bad or 'thundersync must be among the modes'}; modes are {', '.join(MODES)}")
    t0 = time.time()
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    nodes_layout, local, spread, learners = LAYOUTS[args.layout]
    model, rec = setup(work, steps, megatron=args.layout.startswith("megatron"))
    if args.push != "cpu_channel":
        local, spread = ([*x, f"actor_rollout_ref.rollout.checkpoint_engine.backend={args.push}"] for x in (local, spread))
    one = one_run(None, work, model, rec, f"one_node_thundersync_{args.layout}", "thundersync", steps, local)
    cluster = LocalCluster(layout(nodes_layout), cr.cluster_env(work))
    multi, nodes, left = {}, 0, None
    try:
        cluster.start()
        nodes = len([n for n in cluster.node_table() if n["alive"]])
        for mode in modes:
            multi[mode] = one_run(cluster, work, model, rec, f"cluster_{mode}_{args.layout}", mode, steps, spread)
    finally:
        left = cluster.stop()
    ts = multi["thundersync"]
    start = runs.start_weights(model)
    a, b = runs.update(start, ts["weights"], steps), runs.update(start, one["weights"], steps)
    gap = runs.distance(a, b) / runs.norm(b)
    pushed_last = (ts["weights"] / f"weights_v{steps}.pt").is_file()
    result = {
        "nodes": nodes, "layout": args.layout, "push": args.push, "steps": steps, "modes": modes,
        "staleness_max": ts["staleness_max"],
        "update_gap": gap, "update_floor": runs.UPDATE_ATOL, "update_gap_over_floor": round(gap / runs.UPDATE_ATOL, 4),
        "update_bitwise": gap == 0.0,
        "weight_push_crossed_nodes": separated(ts["placement"], "rollout", "rollout_server") and pushed_last,
        "learners_on_distinct_nodes": len(ts["placement"].get("learner", [])) == learners,
        "learner_rollout_separated": {m: separated(r["placement"]) for m, r in multi.items() if m != "sync"},
        "trajectories_lost": steps * PER_STEP - learned(ts["run_dir"]),
        "leftover_processes": left,
        "placement": {m: r["placement"] for m, r in multi.items()},
        "staleness_max_by_mode": {m: r["staleness_max"] for m, r in multi.items()},
        "per_step_one_node": one["costs"], "per_step_cluster": {m: r["costs"] for m, r in multi.items()},
        "seconds": round(time.time() - t0, 1),
    }
    default_run = args.quick and args.layout == "split" and modes == ["thundersync"] and args.push == "cpu_channel"
    name = "multinode" if default_run else f"multinode_{args.layout}_{args.push}_{'_'.join(modes)}"
    write_result(name, result, args.results_dir)
    return result


if __name__ == "__main__":
    main()
