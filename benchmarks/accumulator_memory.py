"""Accumulator memory under long-tailed arrivals: open groups and bytes, with and without ranking.

Why:
1. Every open group holds about two full gradients (affine path), so peak memory is set by
   how many groups are open at once. With long-tailed completion times (agentic rollouts)
   a naive learner opens nearly every group early and keeps it open until its slowest member
   finishes.
2. The trace: B groups x n trajectories launched together; completion time = group factor x
   individual factor (both log-normal, or a Pareto individual tail), rewards known at
   completion. One learner processes one trajectory per ``service`` seconds, sized so its
   total work is ``load`` x the rollout span (0.5: keeps up; 0.9: falls behind).
3. Policies: "fifo" (completion order, no budget: the unbounded reference), "fifo+budget"
   (completion order, the oldest ready trajectory waits when it does not fit: head-of-line
   blocking), "ranked+budget" (StreamingGradientAccumulator.rank_ready: closed groups first,
   then groups holding buffers, then new groups while the budget allows).
4. Figures: peak open groups, peak bytes (exact accounting of the real accumulator, P =
   ``--numel`` float32 values per buffer), the budget, and the learner's tail: seconds from
   the last reward to the last backward (what the step waits for), plus the time the learner
   sat idle with work it could not admit.
5. Headline: the log-normal trace, load 0.9, ranked, budget of 4 open groups.
6. ``--engine megatron [--tp 2] [--pp 2] [--dp 2 [--distributed-optimizer]]``: the same accounting
   on verl's real Megatron engine (TP x PP x DP Ray workers over gloo, the equivalence benchmark's
   model and trajectories). A bucket is a copy of the rank's grad-buffer shard, so its size is
   PREDICTED from the grad buffer Megatron built (its values on this rank: P / (TP x PP) plus
   replicated norms; with the distributed optimizer, that buffer / DP): the streamed steps' measured
   ``peak_bucket_bytes`` must equal that shard x the peak number of open buckets, on every rank.
   Then the same steps run under a budget of ``--budget-buckets`` buckets (the planner's reservations
   and the learner's ``memory_budget_bytes``): trajectories of new groups wait, and the update must be
   the same (``gap_over_floor``: streamed-under-budget vs verl's ``update_actor``, over the floor of
   ``benchmarks/equivalence.py``, verl against itself with the rows in another micro-batch order).
7. ``--bucket-device host --budget-buckets 2``: after the core figures, the streaming worker on verl's
   FSDP2 engine (CPU) with its buckets placed by ``thundersync.bucket_device`` under a budget of that
   many buckets, against the same stream unbudgeted with device buckets (``accumulator_memory_engine.py``);
   the core figures and the engine's go into ONE JSON line / ``results/accumulator_memory.json``.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from thundersync_verl.core import GRPOEstimator, StreamingGradientAccumulator
from thundersync_verl.run.results import add_results_dir_argument, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules: equivalence.py, accumulator_memory_engine.py


@dataclass(frozen=True)
class Completion:
    time: float
    gid: int
    tid: int
    reward: float


def make_trace(kind: str, groups: int, n: int, seed: int) -> list[Completion]:
    rng = random.Random(seed)
    out = []
    for gid in range(groups):
        g = math.exp(rng.gauss(0.0, 0.6))  # prompt difficulty shared by the group
        for tid in range(n):
            if kind == "lognormal":
                x = math.exp(rng.gauss(0.0, 1.0))
            else:  # Pareto tail, alpha 1.5, scale 0.5
                x = 0.5 / (1.0 - rng.random()) ** (1.0 / 1.5)
            out.append(Completion(g * x, gid, tid, float(rng.random() < 0.5)))
    return sorted(out, key=lambda c: c.time)


@dataclass
class Outcome:
    peak_open_groups: int
    peak_bytes: int
    budget_bytes: int | None
    tail_s: float
    blocked_s: float


def _pick(acc, policy: str, ready: list) -> tuple | None:
    if not ready:
        return None
    if policy == "fifo":
        return ready[0]
    if policy == "fifo+budget":
        return ready[0] if acc.rank_ready([ready[0]]).run else None
    hint = acc.rank_ready(ready)
    return hint.run[0] if hint.run else None


def simulate(
    trace: list[Completion], n: int, policy: str, budget_groups: int | None, numel: int, load: float
) -> Outcome:
    params = [torch.zeros(numel)]
    grad = [torch.ones(numel)]
    probe = StreamingGradientAccumulator(params, estimator=GRPOEstimator())
    budget = None if budget_groups is None else (1 + 2 * budget_groups) * probe.layout.buffer_bytes
    acc = StreamingGradientAccumulator(params, estimator=GRPOEstimator(), budget_bytes=budget)
    groups = sorted({c.gid for c in trace})
    acc.begin_batch({g: n for g in groups})
    service = load * trace[-1].time / len(trace)  # total learner work = load x rollout span
    t, busy_until, i, blocked = 0.0, 0.0, 0, 0.0
    ready: list = []
    while i < len(trace) or ready:
        while i < len(trace) and trace[i].time <= t:
            c = trace[i]
            acc.report_reward(c.gid, c.tid, c.reward)
            ready.append((c.gid, c.tid))
            i += 1
        if busy_until <= t:
            item = _pick(acc, policy, ready)
            if item is not None:
                ready.remove(item)
                acc.add_policy_grad(item[0], item[1], grad, 1)
                busy_until = t + service
                continue
        nxt = min(trace[i].time if i < len(trace) else math.inf, busy_until if busy_until > t else math.inf)
        if nxt == math.inf:
            raise RuntimeError("no progress possible: the schedule deadlocked")
        if busy_until <= t and ready:
            blocked += nxt - t  # idle learner with ready work it may not admit
        t = nxt
    finish = max(busy_until, t)
    assert acc.pending_work() == []
    return Outcome(acc.peak_open_groups, acc.peak_bytes, budget, finish - trace[-1].time, blocked)


def build_parser() -> argparse.ArgumentParser:
    """The command line (``ci/gpu_check.py --dry-run`` parses its arguments with it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer seeds (megatron: 2 steps)")
    parser.add_argument("--numel", type=int, default=1 << 16, help="float32 values per buffer (P)")
    parser.add_argument("--engine", default="core", choices=["core", "megatron"],
                        help="core: simulated arrivals on the core accumulator; megatron: verl's Megatron engine")
    parser.add_argument("--tp", type=int, default=1, choices=[1, 2], help="megatron: tensor parallel size")
    parser.add_argument("--pp", type=int, default=1, choices=[1, 2], help="megatron: pipeline parallel size")
    parser.add_argument("--dp", type=int, default=1, choices=[1, 2], help="megatron: data parallel size")
    parser.add_argument("--distributed-optimizer", action="store_true", help="megatron: shard the optimizer over DP")
    parser.add_argument("--budget-buckets", type=int, default=2,
                        help="megatron / --bucket-device: open buckets the budgeted run may hold")
    parser.add_argument("--bucket-device", choices=["host", "device", "auto"],
                        help="also run the streaming worker on verl's FSDP2 engine with its buckets there, under the budget")
    add_results_dir_argument(parser)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.engine == "megatron" or args.bucket_device:
        if args.budget_buckets < 2:
            parser.error("--budget-buckets must be >= 2: a group of binary rewards needs up to 2 buckets")
    if args.engine == "megatron":
        megatron_main(args)
        return
    groups, n = 32, 8
    seeds = [0] if args.quick else [0, 1, 2]
    budgets = [2, 4, 8]
    buf = 4 * args.numel
    print(f"{groups} groups x {n} trajectories; buffer = {args.numel} float32 = {buf} bytes (P); "
          f"budget k groups = (1 + 2k) buffers; max over seeds {seeds}")
    print(f"{'trace':<10}{'load':>5} {'policy':<15}{'budget':>7}{'peak groups':>12}{'peak bytes':>12}"
          f"{'= x P':>7}{'tail s':>8}{'blocked s':>10}")
    headline = None
    for kind in ("lognormal", "pareto"):
        for load in (0.5, 0.9):
            configs = [("fifo", None)] + [(p, b) for b in budgets for p in ("fifo+budget", "ranked+budget")]
            for policy, b in configs:
                traces = [make_trace(kind, groups, n, s) for s in seeds]
                runs = [simulate(tr, n, policy, b, args.numel, load) for tr in traces]
                worst = max(runs, key=lambda o: (o.peak_bytes, o.peak_open_groups))
                label = "-" if b is None else f"{b} grp"
                print(f"{kind:<10}{load:>5} {policy:<15}{label:>7}{worst.peak_open_groups:>12}{worst.peak_bytes:>12}"
                      f"{worst.peak_bytes // buf:>7}{max(o.tail_s for o in runs):>8.2f}"
                      f"{max(o.blocked_s for o in runs):>10.2f}")
                assert worst.budget_bytes is None or worst.peak_bytes <= worst.budget_bytes
                if (kind, load, policy, b) == ("lognormal", 0.9, "ranked+budget", 4):
                    headline = worst
    assert headline is not None
    result = {"peak_open_groups": headline.peak_open_groups, "peak_bytes": headline.peak_bytes,
              "budget_bytes": headline.budget_bytes}
    if args.bucket_device:
        from accumulator_memory_engine import engine_bucket_run  # point 7

        result.update(engine_bucket_run(args))
    write_result("accumulator_memory", result, args.results_dir)


# ----- --engine megatron ---------------------------------------------------------------------
def predicted_shards(probes: list[dict]) -> list[int]:
    """Bytes of one bucket on each rank, from the grad buffer Megatron built: the whole buffer
    (P / (TP x PP) values), or with the distributed optimizer the region this rank keeps (buffer / DP)."""
    out = []
    for p in probes:
        values = p["buffer_numel"] // p["dp"] if p["distributed_optimizer"] else p["buffer_numel"]
        out.append(values * p["element_size"])
    return out


def megatron_runs(args, groups: int, steps: int) -> tuple[list[dict], dict]:
    """One worker group: verl's update twice (the floor), the stream unbudgeted, the stream under the budget."""
    import ray

    from equivalence import transposed_order  # the floor's row order, as benchmarks/equivalence.py defines it
    from thundersync_harness import megatron_engine as me
    from thundersync_harness.engine_setup import make_trajectories, prepare_environment
    from thundersync_harness.engine_steps import sync_step, train

    work = Path(tempfile.mkdtemp(prefix="ts_accumulator_"))
    ray_tmp = prepare_environment()
    try:
        model_path, pad_id, vocab = me.build_megatron_model(work / "model")
        config = me.megatron_config(model_path, groups=groups, micro=4, tp=args.tp, pp=args.pp,
                                    distributed_optimizer=args.distributed_optimizer)
        batches = [make_trajectories(1000 + s, groups, vocab) for s in range(steps)]
        wg = me.start_megatron_workers(config, args.tp * args.pp * args.dp, probe=True)
        probes = wg.probe_grad_buffer()
        shard = max(predicted_shards(probes))

        def stream(budget):
            return [partial(me.budgeted_stream_step, wg, trajs, arrival, pad_id, grad_numel=shard // 4,
                            bucket_bytes=shard, budget_buckets=budget) for trajs, arrival in batches]

        runs = {"sync_a": [partial(sync_step, wg, t, list(range(len(t))), pad_id) for t, _ in batches],
                "sync_b": [partial(sync_step, wg, t, transposed_order(len(t), 4), pad_id) for t, _ in batches],
                "stream": stream(None), "budget": stream(args.budget_buckets)}
        return probes, {kind: train(wg, fns) for kind, fns in runs.items()}
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def bucket_peaks(infos: list[dict], shards: list[int]) -> tuple[int, int, int, bool]:
    """(peak bytes, predicted shard, peak open buckets) of the rank and step with the largest peak, and
    whether peak bytes == shard x peak open buckets held on every rank in every step."""
    rows = [(r["thundersync/peak_bucket_bytes"], shards[k], r["stream/peak_buckets"])
            for info in infos for k, r in enumerate(info["ranks"])]
    return (*max(rows), all(peak == shard * n for peak, shard, n in rows))


def megatron_main(args) -> None:
    from thundersync_harness.engine_steps import relative_gap

    groups, steps = 4, 2 if args.quick else 3
    probes, runs = megatron_runs(args, groups, steps)
    shards = predicted_shards(probes)
    (da, _), (db, _) = runs["sync_a"], runs["sync_b"]
    (ds, info_s), (dq, info_q) = runs["stream"], runs["budget"]
    peak, shard, open_buckets, exact = bucket_peaks(info_s, shards)
    q_peak, _, q_open, q_exact = bucket_peaks(info_q, shards)
    print(f"engine=megatron tp={args.tp} pp={args.pp} dp={args.dp} distributed_optimizer={args.distributed_optimizer}: "
          f"{groups} groups x 4 per step, {steps} steps")
    for k, p in enumerate(probes):
        print(f"  rank {k}: grad buffer {p['buffer_numel']} x {p['element_size']} B (local parameters "
              f"{p['param_numel']}, dp {p['dp']}) -> predicted bucket {shards[k]} B")
    print(f"unbudgeted: peak bucket bytes {peak} = {open_buckets} open x {shard} predicted: "
          f"{'yes' if exact else 'NO'} (every rank, every step)")
    print(f"budget {args.budget_buckets} buckets: peak {q_peak} B ({q_open} open; = open x predicted: "
          f"{'yes' if q_exact else 'NO'}), waits " + ", ".join(str(i["waits"]) for i in info_q) + " per step")
    print(f"{'step':>4} | {'floor':>10} | {'gap stream':>10} | {'gap budget':>10} | {'budget/floor':>12} | ops d/b/f budget")
    worst, worst_stream = 0.0, 0.0
    for s in range(steps):
        floor = relative_gap(db[s], da[s])
        gap_s, gap_q = relative_gap(ds[s], da[s]), relative_gap(dq[s], da[s])
        worst, worst_stream = max(worst, gap_q / floor), max(worst_stream, gap_s / floor)
        i = info_q[s]
        print(f"{s + 1:>4} | {floor:>10.3e} | {gap_s:>10.3e} | {gap_q:>10.3e} | {gap_q / floor:>12.2f} | "
              f"{i['ops/direct']}/{i['ops/bucket']}/{i['ops/fold']}")
    write_result(
        f"accumulator_memory_megatron_tp{args.tp}_pp{args.pp}_dp{args.dp}" + ("_distopt" if args.distributed_optimizer else ""),
        {"engine": "megatron", "tp": args.tp, "pp": args.pp, "dp": args.dp, "peak_bucket_bytes": peak,
         "predicted_bucket_bytes": shard, "peak_open_buckets": open_buckets, "peak_equals_predicted": exact,
         "budget_buckets": args.budget_buckets, "budget_peak_bucket_bytes": q_peak, "budget_peak_open_buckets": q_open,
         "waits": sum(i["waits"] for i in info_q), "gap_over_floor": worst, "gap_over_floor_unbudgeted": worst_stream,
         "budget_vs_unbudgeted_gap": max(relative_gap(q, u) for q, u in zip(dq, ds))},
        args.results_dir,
    )


if __name__ == "__main__":
    main()
