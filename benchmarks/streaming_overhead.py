"""Learner throughput: streamed backward (per trajectory or per ready chunk) vs one batched backward.

Why:
1. Streaming moves the learner's work earlier; it must not make that work much slower. The
   same batch (B groups x n trajectories, tiny Qwen2) is backpropagated (a) as ONE padded
   batch with the final advantages, (b) one trajectory at a time through the accumulator,
   (c) in chunks: the learner wakes every k arrivals and backpropagates the ready set in
   chunks whose loss weights are fixed (closed groups, or one open group's same-reward
   members), (d) per closed group only (group granularity: no buffers at all).
2. Throughput = prompt + response tokens per CPU-second of the learner process (one thread;
   CPU time rather than wall time, so other jobs on a shared machine do not distort it),
   including the accumulator's work and the barrier's normalisation; modes interleaved, each repeat
   runs every mode once, and a mode's ratio is the median over repeats of that repeat's batched time
   over the mode's (paired: the machine's drift between repeats cancels).
3. Trajectories arrive in a long-tailed order (log-normal completion times with a shared
   per-group factor), as in agentic rollouts; the batched baseline sees all of them at once.
4. Headline: the pre-declared chunked setting (wake every 8 arrivals, chunks of at most 16)
   on equal-length responses, where the batched baseline wastes nothing on padding.
5. The product's split (``worker ...`` and ``coalescing ...`` rows): the driver's ``StreamPlanner`` plans and a
   learner runs its ops as the FSDP2 streaming worker does (a direct chunk into ``.grad``, a bucket chunk with
   ``.grad`` set aside, folds, one scale at the barrier). Only the learner's CPU enters the ratio; the planner's
   (the driver's, another process in a run) is printed beside it.
6. ``coalescing load L``: the product's policy on a virtual clock. Rows land over 1/L of one batched backward's
   learner time; whenever the learner is free it gets one call with what has landed. At load 1 a learner that
   lost nothing to streaming would finish with the last landing. ``tail`` is the learner's work left after the
   last landing, over one batched backward (the batched learner's tail is 1).
7. The ratio is set by a call's fixed cost (framework dispatch: the HF forward's Python, autograd) against a
   row's work. ``call_fixed_ms`` and ``row_ms`` are a least-squares line through one-call backwards of 1, 2, 4, 8
   and 16 rows; ``fixed_cost_rows`` is their quotient. ``--hidden/--layers/--response-len`` size the model and
   rows (results named after them): the default tiny model's row is about one fixed cost, where a GPU learner's
   row of thousands of tokens is many.
8. ``efficient load L``: the coalescing above (the headline at load 1: the product's default) with the chunk sizing
   of ``thundersync.call_efficiency`` 0.9 (off by default, ``core/call_cost.call_waits``): an idle learner's call
   waits for more rows while those still to land would make its fixed cost at most a tenth of it. The call-cost
   model is the run's own: fitted on point 7's one-call backwards (a run's earlier steps) and fed every call's
   measured time. Its chunks may hold the whole batch (``thundersync.chunk_size`` 64): the batched baseline shows
   that one call can.
9. CPU time includes the page faults of fresh allocations: glibc returns freed blocks above its mmap threshold to
   the system, and whether the batched call's large tensors fault again depended on the process's history (the
   batched baseline took 75 or 93 ms from one run to the next). The allocator keeps freed memory here
   (``mallopt``), as an accelerator's caching allocator does, so every mode reuses its memory.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import random
import statistics
import time

import torch

from thundersync_harness import tiny_lm as C
from thundersync_verl.core import BufferPool, GradLayout, GRPOEstimator, token_weights
from thundersync_verl.core.call_cost import CallCost, call_waits
from thundersync_verl.core.buffers import axpy_, copy_into_
from thundersync_verl.step.stream_plan import BackwardOp, FinalizeOp, FoldOp, StreamPlanner
from thundersync_verl.run.results import add_results_dir_argument, write_result

HEADLINE = "coalescing load 1"  # the product's default policy, rows landing over one batched backward
PRE_DECLARED = "chunks k=8 min4"  # the headline until 2026-12-07: a fixed wake-up, not a policy of the product
LOADS = (0.5, 1, 2, 4)  # arrivals over 1/load of one batched backward's learner time
EFFICIENCY = 0.9  # thundersync.call_efficiency's default
MODEL_SIZE_MINIMUMS = {"hidden": 8, "layers": 1, "response_len": 1}  # point 7's flags (hidden: 4 heads of an even size)


def tokens_of(trajs) -> int:
    """Prompt and response tokens of ``trajs``: a call's size in the call-cost model, and the throughput's numerator."""
    return sum(len(t.prompt) + len(t.response) for t in trajs)


def arrival_order(trajs, seed: int) -> list[int]:
    """Log-normal completion times (``arrival_fractions``); a per-group factor makes members finish together."""
    fractions = arrival_fractions(trajs, seed)
    return sorted(range(len(trajs)), key=lambda k: fractions[k])


def batched(model, spec, trajs) -> None:
    """One padded forward/backward with the final coefficients (advantages known)."""
    est = GRPOEstimator()
    by_group: dict[int, list] = {}
    for t in trajs:
        by_group.setdefault(t.gid, []).append(t)
    coef = {}
    for gid, members in by_group.items():
        for t, a in zip(members, est.advantages([m.reward for m in members])):
            coef[(t.gid, t.tid)] = -a
    logp, mask, _ = C.response_log_probs(model, trajs)
    w = token_weights(spec.loss_agg_mode, mask, dtype=logp.dtype)  # [B, T]
    c = torch.tensor([coef[(t.gid, t.tid)] for t in trajs], dtype=logp.dtype)  # [B]
    model.zero_grad(set_to_none=True)
    ((logp * w).sum(dim=-1) * c).sum().backward()
    scale = 1.0 / float(mask.sum())
    for p in model.parameters():
        p.grad.mul_(scale)


def streamed(model, spec, trajs, order, wake_every: int, max_chunk: int, min_open: int = 1) -> None:
    """Arrivals in ``order``; every ``wake_every`` arrivals the learner runs ready chunks.

    ``min_open`` defers open-group chunks smaller than that (see split_into_chunks); a huge
    value means closed groups only (group granularity).
    """
    acc = C.make_accumulator(model, spec, "affine")
    acc.begin_batch({t.gid: sum(1 for u in trajs if u.gid == t.gid) for t in trajs})
    params = list(model.parameters())
    by_key = {(t.gid, t.tid): t for t in trajs}
    ready: list = []
    for i, k in enumerate(order):
        t = trajs[k]
        acc.report_reward(t.gid, t.tid, t.reward)
        ready.append((t.gid, t.tid))
        if (i + 1) % wake_every and i + 1 < len(order):
            continue
        last = i + 1 == len(order)
        chunks, ready = acc.split_into_chunks(ready, max_chunk, 1 if last else min_open)
        for chunk in chunks:
            plan = acc.plan_chunk(chunk)
            members = [by_key[it] for it in chunk]
            logp, mask, _ = C.response_log_probs(model, members)
            w = token_weights(spec.loss_agg_mode, mask, dtype=logp.dtype)  # [C, T]
            weights = torch.tensor(plan.loss_weights, dtype=logp.dtype)  # [C]
            model.zero_grad(set_to_none=True)
            ((logp * w).sum(dim=-1) * weights).sum().backward()
            acc.add_chunk_grad(plan, [p.grad for p in params], [len(m.response) for m in members])
    assert not ready and acc.pending_work() == []
    acc.finish_batch(params)  # normalise and write .grad, as the barrier does before the step


class WorkerLearner:
    """The learner's side of a streamed step, op for op as the FSDP2 streaming worker runs it
    (``learner/engines/fsdp.py``): a direct chunk backpropagates into ``.grad``, where the batch gradient
    accumulates; a bucket chunk runs with ``.grad`` set aside and its gradient goes into the bucket; a fold is
    ``.grad += A(r) * bucket``; the barrier multiplies ``.grad`` by the deferred scale. ``cpu_s`` counts this
    side's CPU only: in a run the planning is the driver's, in another process."""

    def __init__(self, model, spec, trajs):
        self.model, self.spec = model, spec
        self.params = list(model.parameters())
        self.pool = BufferPool(GradLayout.from_tensors(self.params))
        self.by_key = {(t.gid, t.tid): t for t in trajs}
        self.buckets: dict[str, list[torch.Tensor]] = {}
        self.cpu_s = 0.0
        self.calls = 0  # backward calls
        self.rows = 0  # rows backpropagated

    def run(self, ops) -> None:
        t0 = time.process_time()
        for op in ops:
            if isinstance(op, FoldOp):
                self._fold(op)
            elif isinstance(op, FinalizeOp):
                torch._foreach_mul_([p.grad for p in self.params], op.scale)
            else:
                self._backward(op)
                self.calls += 1
                self.rows += len(op.items)
        self.cpu_s += time.process_time() - t0

    def _backward(self, op) -> None:
        members = [self.by_key[it] for it in op.items]
        logp, mask, _ = C.response_log_probs(self.model, members)
        w = token_weights(self.spec.loss_agg_mode, mask, dtype=logp.dtype)  # [C, T]
        coefs = torch.tensor(op.coefs, dtype=logp.dtype)  # worker convention: coef x grad(-sum_t w log pi)
        loss = -((logp * w).sum(dim=-1) * coefs).sum()
        if op.dest == "direct":
            loss.backward()
            return
        stash = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        loss.backward()
        grads = [p.grad for p in self.params]
        if op.dest in self.buckets:
            axpy_(self.buckets[op.dest], grads, 1.0)
        else:
            self.pool.reserve(op.dest, 1, is_group=True)
            self.buckets[op.dest] = self.pool.allocate(op.dest)
            copy_into_(self.buckets[op.dest], grads)
        for p, g in zip(self.params, stash):
            p.grad = g

    def _fold(self, op) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for key, coef in op.folds.items():
            axpy_([p.grad for p in self.params], self.buckets.pop(key), coef)
            self.pool.release(key)


def _open_batch(model, spec, trajs, max_chunk: int):
    """The driver's planner with the batch's groups declared, and a learner with ``.grad`` cleared."""
    planner = StreamPlanner(adv_estimator="grpo", loss_agg_mode=spec.loss_agg_mode, max_chunk_size=max_chunk,
                            stats_dtype=next(model.parameters()).dtype)
    sizes: dict[int, int] = {}
    for t in trajs:
        sizes[t.gid] = sizes.get(t.gid, 0) + 1
    planner.begin_batch(sizes)
    model.zero_grad(set_to_none=True)
    return planner, WorkerLearner(model, spec, trajs)


def worker_stream(model, spec, trajs, order, wake_every: int, max_chunk: int) -> dict[str, float]:
    """The product's split of a streamed step: the driver's ``StreamPlanner`` turns arrivals into ops
    (every ``wake_every`` arrivals it plans every ready row, chunks of at most ``max_chunk``), the
    ``WorkerLearner`` runs them. Returns the CPU seconds of each side."""
    t0 = time.process_time()
    planner, learner = _open_batch(model, spec, trajs, max_chunk)
    planner_s = time.process_time() - t0
    for i, k in enumerate(order):
        t = trajs[k]
        t0 = time.process_time()
        planner.arrive(t.gid, t.tid, t.reward, len(t.response))
        last = i + 1 == len(order)
        ops = planner.next_ops() if last or (i + 1) % wake_every == 0 else []
        if last:
            ops.append(planner.finalize())
        planner_s += time.process_time() - t0
        learner.run(ops)
    assert not learner.buckets and learner.pool.reserved_bytes == 0
    return {"learner": learner.cpu_s, "planner": planner_s, "calls": learner.calls}


def arrival_fractions(trajs, seed: int) -> list[float]:
    """Log-normal completion times with a shared per-group factor, as fractions of the batch's arrival span
    (first 0, last 1)."""
    rng = random.Random(seed)
    group_factor = {t.gid: rng.gauss(0.0, 0.8) for t in trajs}
    times = [math.exp(group_factor[t.gid] + rng.gauss(0.0, 0.5)) for t in trajs]
    lo, hi = min(times), max(times)
    return [(x - lo) / (hi - lo) if hi > lo else 0.0 for x in times]


def coalescing_stream(model, spec, trajs, fractions, span_s: float, max_chunk: int, cost: CallCost | None = None,
                      efficiency: float = 0.0) -> dict[str, float]:
    """The product's planning policy on a virtual clock: trajectory k lands at ``fractions[k] * span_s``; whenever
    the learner is free, the planner hands it ONE call (``next_ops(max_backwards=1)``: the queued folds and the
    best-ranked chunk of what has landed), and the clock advances by that call's learner CPU time. A learner that
    falls behind finds more rows landed at its next call, so its chunks grow (``core/call_cost.py`` plans the
    next call just in time for the same effect in a run). With ``cost`` and ``efficiency`` (point 8) a free learner's
    call waits for more landings while ``call_waits`` says so, as the streamed step's does; ``cost`` learns from
    every call."""
    t0 = time.process_time()
    planner, learner = _open_batch(model, spec, trajs, max_chunk)
    row_tokens = tokens_of(trajs) / len(trajs)  # the step's landed-row mean
    order = sorted(range(len(trajs)), key=lambda k: fractions[k])
    trajs_by_key = {(t.gid, t.tid): t for t in trajs}
    planner_s = time.process_time() - t0
    clock, landed, rows_before_last = 0.0, 0, 0
    while True:
        t0 = time.process_time()
        while landed < len(order) and fractions[order[landed]] * span_s <= clock:
            t = trajs[order[landed]]
            planner.arrive(t.gid, t.tid, t.reward, len(t.response))
            landed += 1
        waits = cost is not None and call_waits(cost, chunk_tokens=planner.next_chunk_size() * row_tokens,
                                                ready_tokens=planner.ready_count * row_tokens,
                                                coming_tokens=(len(order) - landed) * row_tokens,
                                                full_tokens=max_chunk * row_tokens, efficiency=efficiency)
        ops = planner.next_ops(max_backwards=1) if (planner.ready_count or planner.queued_folds) and not waits else []
        done = landed == len(order) and not ops and not planner.ready_count
        if done:
            ops = [planner.finalize()]
        planner_s += time.process_time() - t0
        if not ops:
            clock = fractions[order[landed]] * span_s  # idle until the next landing
            continue
        before = learner.cpu_s
        rows = [trajs_by_key[it] for op in ops if isinstance(op, BackwardOp) for it in op.items]
        if landed < len(order):
            rows_before_last = learner.rows + len(rows)
        learner.run(ops)
        clock += learner.cpu_s - before
        if cost is not None and rows:
            cost.observe("backward", tokens_of(rows), learner.cpu_s - before)
        if done:
            break
    assert not learner.buckets and learner.pool.reserved_bytes == 0
    return {"learner": learner.cpu_s, "planner": planner_s, "calls": learner.calls, "tail": max(0.0, clock - span_s),
            "rows_after_last_landing": learner.rows - rows_before_last}


def call_costs(model, spec, trajs, repeats: int) -> dict[str, float]:
    """(point 7) The learner's fixed cost per call and work per row: one batched backward of the first k rows,
    k = 1, 2, 4, 8, 16, each the median of ``repeats`` CPU times, and the least-squares line through them."""
    sizes = [k for k in (1, 2, 4, 8, 16) if k <= len(trajs)]
    seconds = []
    for k in sizes:
        rows = trajs[:k]
        batched(model, spec, rows)  # warm-up at this shape
        seconds.append(statistics.median(_timed(lambda: batched(model, spec, rows))["learner"] for _ in range(repeats)))
    tokens = [tokens_of(trajs[:k]) for k in sizes]
    return {**cost_line(sizes, seconds), "samples": list(zip(tokens, seconds))}


def fitted_cost(samples: list[tuple[int, float]]) -> CallCost:
    """A run's call-cost model after its earlier steps' calls (point 8): fed the one-call backwards."""
    cost = CallCost()
    for tokens, seconds in samples:
        cost.observe("backward", tokens, seconds)
    return cost


def cost_line(rows: list[int], seconds: list[float]) -> dict[str, float]:
    """The least-squares line ``seconds = fixed + row x rows`` in ms, and the fixed cost in rows of work."""
    mx, my = statistics.mean(rows), statistics.mean(seconds)
    slope = sum((x - mx) * (y - my) for x, y in zip(rows, seconds)) / sum((x - mx) ** 2 for x in rows)
    fixed = my - slope * mx
    return {"call_fixed_ms": 1e3 * fixed, "row_ms": 1e3 * slope,
            "fixed_cost_rows": fixed / slope if slope > 0 else float("inf")}


def _timed(fn) -> dict[str, float]:
    """CPU seconds of this process (stable when other jobs share the cores; one thread): the learner's, and
    the planner's where ``fn`` separates them (the driver's work in a run)."""
    t0 = time.process_time()
    parts = fn()
    total = time.process_time() - t0
    return parts if parts is not None else {"learner": total, "planner": 0.0}


def run_setting(model, spec, trajs, repeats: int, label: str, samples: list) -> dict[str, dict[str, float]]:
    tokens = tokens_of(trajs)
    order = arrival_order(trajs, seed=1)
    modes = {
        "batched": lambda: batched(model, spec, trajs),
        "per trajectory": lambda: streamed(model, spec, trajs, order, 1, 1),
        "chunks k=4": lambda: streamed(model, spec, trajs, order, 4, 16),
        "chunks k=8": lambda: streamed(model, spec, trajs, order, 8, 16),
        "chunks k=16": lambda: streamed(model, spec, trajs, order, 16, 32),
        "chunks k=8 min4": lambda: streamed(model, spec, trajs, order, 8, 16, min_open=4),
        "closed groups k=8": lambda: streamed(model, spec, trajs, order, 8, 16, min_open=10**9),
        "worker k=8": lambda: worker_stream(model, spec, trajs, order, 8, 16),
        "worker k=16": lambda: worker_stream(model, spec, trajs, order, 16, 32),
    }
    modes["batched"]()  # warm-up, and the reference gradient every mode must reproduce
    span_s = statistics.median(_timed(modes["batched"])["learner"] for _ in range(3))  # load 1: one batched backward
    fractions = arrival_fractions(trajs, seed=1)
    for load in LOADS:
        modes[f"coalescing load {load}"] = lambda load=load: coalescing_stream(
            model, spec, trajs, fractions, span_s / load, 16)
    for load in LOADS:
        modes[f"efficient load {load}"] = lambda load=load: coalescing_stream(
            model, spec, trajs, fractions, span_s / load, len(trajs), fitted_cost(samples), EFFICIENCY)
    reference = [p.grad.clone() for p in model.parameters()]
    for m, fn in modes.items():
        fn()
        err = C.relative_error([p.grad for p in model.parameters()], reference)
        assert err <= 1e-5, f"{m}: streamed gradient differs from the batched one ({err:.2e})"
    times: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(repeats):
        for m, fn in modes.items():
            times[m].append(_timed(fn))
    base = statistics.median(t["learner"] for t in times["batched"])
    print(f"\n{label}: {len(trajs)} trajectories, {tokens} tokens, median of {repeats}")
    print(f"{'mode':<22}{'learner s':>10}{'tokens/s':>12}{'ratio':>8}{'planner s':>12}{'calls':>7}{'tail':>7}")
    out = {}
    for m, ts in times.items():
        learner = statistics.median(t["learner"] for t in ts)
        planner = statistics.median(t["planner"] for t in ts)
        tail = statistics.median(t["tail"] for t in ts) / base if "tail" in ts[0] else None
        paired = statistics.median(b["learner"] / t["learner"] for b, t in zip(times["batched"], ts))
        out[m] = {"ratio": paired, "planner_share": planner / learner, "tail": tail}
        shown = f"{planner:>12.4f}" if m.startswith(("worker", "coalescing", "efficient")) else "(in learner)" if m != "batched" else ""
        calls = f"{statistics.median(t['calls'] for t in ts):>7.0f}" if "calls" in ts[0] else " " * 7
        print(f"{m:<22}{learner:>10.4f}{tokens / learner:>12.0f}{paired:>8.2f}{shown:>12}{calls}"
              + (f"{tail:>7.2f}" if tail is not None else ""))
    return out


def keep_freed_memory() -> None:
    """Point 9: glibc keeps freed blocks (no mmap for large ones, no trimming), so no mode pays fresh page faults."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator's own policy stands
        return
    libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: blocks below 1 GiB come from the heap
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: freed heap memory stays with the process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--hidden", type=int, default=64, help="the model's hidden size (point 7)")
    parser.add_argument("--layers", type=int, default=2, help="the model's layers (point 7)")
    parser.add_argument("--response-len", type=int, default=64,
                        help="equal-length responses' tokens; the variable ones span 1/4 to 7/4 of it (point 7)")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    for name, least in MODEL_SIZE_MINIMUMS.items():
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}")
    if args.hidden % 8:
        parser.error("--hidden must be a multiple of 8 (4 attention heads of an even size)")
    torch.set_num_threads(1)
    keep_freed_memory()
    repeats = 3 if args.quick else 9
    model = C.tiny_qwen2(0, torch.float32, hidden=args.hidden, layers=args.layers, vocab=128)
    spec = C.LossSpec(estimator="grpo", loss_agg_mode="token-mean")
    print(f"Qwen2: hidden {args.hidden}, {args.layers} layers, vocab 128, "
          f"{sum(p.numel() for p in model.parameters())} parameters", flush=True)
    n = args.response_len
    equal = C.make_batch(0, [8] * 8, "binary", prompt_len=(16, 16), response_len=(n, n))
    varied = C.make_batch(0, [8] * 8, "binary", prompt_len=(16, 16), response_len=(max(1, n // 4), n * 7 // 4))
    costs = call_costs(model, spec, equal, repeats)
    samples = costs.pop("samples")
    print("one call: {call_fixed_ms:.2f} ms fixed + {row_ms:.2f} ms a row ({fixed_cost_rows:.2f} rows)".format(**costs))
    ratios = run_setting(model, spec, equal, repeats, f"equal-length responses ({n} tokens)", samples)
    run_setting(model, spec, varied, repeats, samples=samples, label=f"variable-length responses ({max(1, n // 4)}-{n * 7 // 4} tokens, batched pads)")
    print(f"\nheadline: '{HEADLINE}' on equal-length responses")
    result = {"hidden": args.hidden, "layers": args.layers, "response_len": n,
              **{k: round(v, 3) for k, v in costs.items()},
              "throughput_ratio": round(ratios[HEADLINE]["ratio"], 3),
              "throughput_ratio_chunks_k8_min4": round(ratios[PRE_DECLARED]["ratio"], 3),
              "throughput_ratio_worker_k8": round(ratios["worker k=8"]["ratio"], 3)}
    for load in LOADS:
        for policy in ("coalescing", "efficient"):
            row = ratios[f"{policy} load {load}"]
            result[f"throughput_ratio_{policy}_load_{load}"] = round(row["ratio"], 3)
            result[f"tail_over_batched_{policy}_load_{load}"] = round(row["tail"], 3)
    result["planner_share_load_1"] = round(ratios["coalescing load 1"]["planner_share"], 3)
    default = all(getattr(args, name) == parser.get_default(name) for name in MODEL_SIZE_MINIMUMS)
    name = "streaming_overhead" + ("" if default else f"_h{args.hidden}_l{args.layers}_r{args.response_len}")
    write_result(name, result, args.results_dir)


if __name__ == "__main__":
    main()
