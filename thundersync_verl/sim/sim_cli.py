"""Command line: `simulate` a deployment in every mode, or `plan` one (mode, granularity, budget).

Why this module exists:
1. Users size runs before they have GPUs: `simulate` compares the pipelines on a preset, a
   custom cluster or a recorded trace; `plan` recommends a setting and says why.
2. The entry point is a plain function `main(argv)` so the project's `thundersync` console
   command can dispatch to it and tests can call it without a subprocess.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from thundersync_verl.cli_args import Parser, choice_list, existing_file, param_count, positive_float, positive_int, usage_errors
from thundersync_verl.sim.sim_config import (ALGOS, ALL_MODES, GRANULARITIES, MODES, TAIL_MODE, TAIL_ROUNDS,
                                             SimConfig)
from thundersync_verl.sim.dists import lognormal, pareto
from thundersync_verl.sim.sim_engine import simulate
from thundersync_verl.sim.hardware import B200, H100, ClusterSpec, ModelSpec, learner_costs_from_hardware, weight_sync_seconds
from thundersync_verl.sim.metrics import comparison_table
from thundersync_verl.sim.planner import plan
from thundersync_verl.sim.tail import prompt_source
from thundersync_verl.sim.presets import (PAPER_CHUNK_OVERHEAD_S, PAPER_OPTIMIZER_S, PAPER_ROLLOUT, PAPER_WEIGHT_SYNC_FIXED_S,
                      PAPER_WORKLOAD, Setting, paper_setting, scale_setting)
from thundersync_verl.sim.trace import TraceSource, load_trace, replay
from thundersync_verl.sim.workload import SyntheticSource

GPUS = {"B200": B200, "H100": H100}


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=existing_file, help="recorded trace (JSONL) whose trajectories to replay")
    p.add_argument("--groups", type=positive_int, help="prompt groups per step (default: the preset's)")
    p.add_argument("--group-size", type=positive_int, help="trajectories per group")
    p.add_argument("--turns-median", type=positive_float, help="median turns per trajectory")
    p.add_argument("--turns-sigma", type=positive_float, default=0.8, help="lognormal sigma of turns")
    p.add_argument("--tail", choices=("lognormal", "pareto"), default="lognormal", help="shape of the turn tail")
    p.add_argument("--slots", type=positive_int, help="rollout slots (engines x concurrent sequences)")
    p.add_argument("--steps", type=positive_int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--algo", choices=ALGOS, default="grpo")


def _workload(args, base_workload, base_rollout):
    w = base_workload
    if args.groups:
        w = replace(w, groups_per_step=args.groups)
    if args.group_size:
        w = replace(w, group_size=args.group_size)
    if args.turns_median:
        shape = lognormal(args.turns_median, args.turns_sigma) if args.tail == "lognormal" else \
            pareto(args.turns_median / 2 ** (1 / 1.6), 1.6)  # Pareto(alpha 1.6) with that median
        w = replace(w, turns=shape)
    slots = args.slots or (w.batch_size if (args.groups or args.group_size) else base_rollout.slots)
    return w, replace(base_rollout, slots=slots)


def _source(args, setting: Setting):
    """(source, setting) from a trace or from the setting's distributions."""
    if args.trace:
        trace = load_trace(args.trace)
        src = TraceSource(trace)
        slots = max(s["n_rollout_slots"] for s in trace.steps)
        args.algo = trace.algo
        return src, replace(setting, rollout=replace(setting.rollout, slots=slots))
    return SyntheticSource(setting.workload, setting.rollout, seed=args.seed), setting


def cmd_simulate(args) -> int:
    with usage_errors("thundersync simulate"):  # settings that several arguments decide together
        setting, source, costs, configs = _simulate_settings(args)
    results = [simulate(cfg, source, costs) for cfg in configs]
    print(comparison_table(results))
    if args.timeline:
        from thundersync_verl.sim.plot import plot_timelines

        print("timeline:", plot_timelines(results, args.timeline))
    if args.json:
        print(json.dumps({f"{r.mode}/{r.granularity}": r.summary() for r in results}, default=float))
    return 0


def _simulate_settings(args):
    """(setting, source, costs, one checked SimConfig per mode): every refusal before the first simulation."""
    if args.preset == "scale":
        setting = scale_setting(args.gpus, args.model, args.tail)
    else:
        setting = paper_setting()
        w, r = _workload(args, setting.workload, setting.rollout)
        setting = replace(setting, workload=w, rollout=r)
    source, setting = _source(args, setting)
    modes = args.modes.split(",")
    if TAIL_MODE in modes:  # every mode then trains the same prompts (prompts.py: attempt 0 = the usual batches)
        source = prompt_source(source)
    costs, base = setting.costs, None
    if args.trace and args.fit_costs:  # the trace's own learner, chunking, calibration; other modes played on it
        base, source, costs = replay(load_trace(args.trace))
        setting = replace(setting, rollout=replace(setting.rollout, slots=base.rollout_slots))
    configs = []
    for mode in modes:
        cfg = SimConfig(mode=mode, algo=args.algo,
                        granularity=args.granularity if mode in ("thundersync", TAIL_MODE) else None,
                        steps=args.steps, rollout_slots=setting.rollout.slots, budget_groups=args.budget_groups,
                        gpus=setting.cluster.gpus, bytes_per_buffer=setting.bytes_per_buffer,
                        record_timeline=bool(args.timeline), tail_eta=args.tail_eta,
                        tail_max_deferrals=args.tail_max_deferrals, tail_rounds=args.tail_rounds)
        if base is not None:
            cfg = replace(cfg, mini_batch=base.mini_batch, staleness_threshold=base.staleness_threshold, min_chunk=1,
                          max_chunk=base.max_chunk if mode == "thundersync" else None,
                          shared_cores=base.shared_cores)
        cfg.validate(source.batch_size)
        configs.append(cfg)
    return setting, source, costs, configs


def cmd_plan(args) -> int:
    with usage_errors("thundersync plan"):  # the cluster's shape is checked before anything is priced
        model = ModelSpec("custom", args.params, args.layers, args.hidden)
        cluster = ClusterSpec(gpus=args.gpus, learner_gpus=args.learner_gpus or args.gpus // 2, tp=args.tp,
                              pp=args.pp, cp=args.cp, grad_sharded_over_dp=not args.replicated_grads)
    gpu = GPUS[args.gpu]
    changed = _changed_fraction(args)
    wsync = weight_sync_seconds(model, args.sync_gbps, PAPER_WEIGHT_SYNC_FIXED_S, changed)
    dense_s = weight_sync_seconds(model, args.sync_gbps, PAPER_WEIGHT_SYNC_FIXED_S)
    print(f"weight push at {args.sync_gbps:g} GB/s: dense {dense_s:.2f} s" + ("" if changed is None else
          f", sparse at density {changed:.4f}{' (measured)' if args.changed_fraction_from else ''}: {wsync:.2f} s"))
    costs = learner_costs_from_hardware(model, gpu, cluster, args.mfu, chunk_overhead_s=args.chunk_overhead,
                                        optimizer_s=PAPER_OPTIMIZER_S, weight_sync_s=wsync)
    w, r = _workload(args, PAPER_WORKLOAD, PAPER_ROLLOUT)
    setting = Setting("plan", model, gpu, cluster, w, r, costs, args.mfu)
    source, setting = _source(args, setting)
    result = plan(setting, source, algo=args.algo, steps=args.steps, host_mem_gb_per_rank=args.host_mem_gb,
                  bucket_device=args.bucket_device)
    print(result.render())
    return 0


def _changed_fraction(args) -> float | None:
    """``--changed-fraction``, or the density ``benchmarks/weight_sync.py`` measured (``--changed-fraction-from``)."""
    if not args.changed_fraction_from:
        return args.changed_fraction
    with open(args.changed_fraction_from) as f:
        return float(json.load(f)["density"])


def at_least_one(text: str) -> float:
    """A number >= 1 (the tail policy's launch factor)."""
    value = positive_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1 (1 launches exactly the batch)")
    return value


def build_parser() -> argparse.ArgumentParser:
    from thundersync_verl.core.bucket_memory import BUCKET_DEVICES  # here: importing the simulator pulls no torch

    ap = Parser(prog="thundersync", description="ThunderSync pipeline simulator and planner")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("simulate", help="compare pipeline modes on a preset, cluster or trace")
    s.add_argument("--preset", choices=("paper", "scale"), default="paper")
    s.add_argument("--gpus", type=positive_int, default=64, help="scale preset: total GPUs")
    s.add_argument("--model", choices=("30B", "235B"), default="30B", help="scale preset: model size")
    s.add_argument("--modes", type=choice_list(ALL_MODES), default=",".join(MODES),
                   help=f"comma-separated, of {', '.join(ALL_MODES)} (default: all but {TAIL_MODE})")
    s.add_argument("--tail-eta", type=at_least_one, default=1.25,
                   help=f"{TAIL_MODE}: prompt groups launched per step over those the batch needs (>= 1)")
    s.add_argument("--tail-max-deferrals", type=positive_int, default=2,
                   help=f"{TAIL_MODE}: a prompt aborted this many times is kept on its next run (>= 1)")
    s.add_argument("--tail-rounds", choices=TAIL_ROUNDS, default="dedicated",
                   help=f"{TAIL_MODE}: queued prompts run in rounds of their own, or beside fresh ones (mixed)")
    s.add_argument("--granularity", choices=GRANULARITIES)
    s.add_argument("--budget-groups", type=positive_int, help="thundersync: most GRPO groups holding buffers")
    s.add_argument("--fit-costs", action="store_true", help="with --trace: fit learner costs from its records")
    s.add_argument("--timeline", help="write a utilisation timeline PNG here")
    s.add_argument("--json", action="store_true", help="also print the summaries as JSON")
    _add_workload_args(s)
    s.set_defaults(func=cmd_simulate)
    p = sub.add_parser("plan", help="recommend mode, granularity and memory budget for a deployment")
    p.add_argument("--params", type=param_count, required=True, help="trainable parameters, e.g. 30B or 3e10")
    p.add_argument("--layers", type=positive_int, default=64)
    p.add_argument("--hidden", type=positive_int, default=5120)
    p.add_argument("--gpus", type=positive_int, required=True)
    p.add_argument("--learner-gpus", type=positive_int, help="default: half of the GPUs")
    p.add_argument("--tp", type=positive_int, default=1)
    p.add_argument("--pp", type=positive_int, default=1)
    p.add_argument("--cp", type=positive_int, default=1, help="context/sequence parallel size")
    p.add_argument("--replicated-grads", action="store_true", help="gradients not sharded over data parallel")
    p.add_argument("--gpu", choices=sorted(GPUS), default="B200")
    p.add_argument("--mfu", type=positive_float, default=0.39)
    p.add_argument("--host-mem-gb", type=positive_float, help="host memory per learner rank for accumulators")
    p.add_argument("--bucket-device", choices=BUCKET_DEVICES, default="auto",
                   help="where the learner keeps group buckets (auto: host on GPUs), as thundersync.bucket_device")
    p.add_argument("--sync-gbps", type=positive_float, default=10.0, help="effective weight-push bandwidth (GB/s)")
    p.add_argument("--changed-fraction", type=float, help="sparse weight push: share of weights that change")
    p.add_argument("--changed-fraction-from", type=existing_file, metavar="JSON",
                   help="sparse weight push: the density measured by benchmarks/weight_sync.py (its results JSON)")
    p.add_argument("--chunk-overhead", type=float, default=PAPER_CHUNK_OVERHEAD_S)
    _add_workload_args(p)
    p.set_defaults(func=cmd_plan)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
