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
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass

import torch

from thundersync_verl.core import GRPOEstimator, StreamingGradientAccumulator
from thundersync_verl.results import add_results_dir_argument, write_result


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer seeds")
    parser.add_argument("--numel", type=int, default=1 << 16, help="float32 values per buffer (P)")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
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
    write_result(
        "accumulator_memory",
        {
            "peak_open_groups": headline.peak_open_groups,
            "peak_bytes": headline.peak_bytes,
            "budget_bytes": headline.budget_bytes,
        },
        args.results_dir,
    )


if __name__ == "__main__":
    main()
