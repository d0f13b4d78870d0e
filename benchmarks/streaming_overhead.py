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
   including the accumulator's work and the barrier's normalisation; medians over repeats,
   modes interleaved.
3. Trajectories arrive in a long-tailed order (log-normal completion times with a shared
   per-group factor), as in agentic rollouts; the batched baseline sees all of them at once.
4. Headline: the pre-declared chunked setting (wake every 8 arrivals, chunks of at most 16)
   on equal-length responses, where the batched baseline wastes nothing on padding.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import torch

from thundersync_harness import tiny_lm as C
from thundersync_verl.core import GRPOEstimator, token_weights
from thundersync_verl.run.results import add_results_dir_argument, write_result

HEADLINE = "chunks k=8 min4"


def arrival_order(trajs, seed: int) -> list[int]:
    """Log-normal completion times; a per-group factor makes members finish together."""
    rng = random.Random(seed)
    group_factor = {t.gid: rng.gauss(0.0, 0.8) for t in trajs}
    times = [math.exp(group_factor[t.gid] + rng.gauss(0.0, 0.5)) for t in trajs]
    return sorted(range(len(trajs)), key=lambda k: times[k])


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


def _timed(fn) -> float:
    """CPU seconds of this process: stable when other jobs share the cores (one thread)."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def run_setting(model, spec, trajs, repeats: int, label: str) -> dict[str, float]:
    tokens = sum(len(t.prompt) + len(t.response) for t in trajs)
    order = arrival_order(trajs, seed=1)
    modes = {
        "batched": lambda: batched(model, spec, trajs),
        "per trajectory": lambda: streamed(model, spec, trajs, order, 1, 1),
        "chunks k=4": lambda: streamed(model, spec, trajs, order, 4, 16),
        "chunks k=8": lambda: streamed(model, spec, trajs, order, 8, 16),
        "chunks k=16": lambda: streamed(model, spec, trajs, order, 16, 32),
        HEADLINE: lambda: streamed(model, spec, trajs, order, 8, 16, min_open=4),
        "closed groups k=8": lambda: streamed(model, spec, trajs, order, 8, 16, min_open=10**9),
    }
    modes["batched"]()  # warm-up, and the reference gradient every mode must reproduce
    reference = [p.grad.clone() for p in model.parameters()]
    for m, fn in modes.items():
        fn()
        err = C.relative_error([p.grad for p in model.parameters()], reference)
        assert err <= 1e-5, f"{m}: streamed gradient differs from the batched one ({err:.2e})"
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(repeats):
        for m, fn in modes.items():
            times[m].append(_timed(fn))
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"\n{label}: {len(trajs)} trajectories, {tokens} tokens, median of {repeats}")
    print(f"{'mode':<22}{'seconds':>10}{'tokens/s':>12}{'ratio':>8}")
    for m, s in med.items():
        print(f"{m:<22}{s:>10.4f}{tokens / s:>12.0f}{med['batched'] / s:>8.2f}")
    return {m: med["batched"] / s for m, s in med.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    repeats = 3 if args.quick else 9
    model = C.tiny_qwen2(0, torch.float32, hidden=64, layers=2, vocab=128)
    spec = C.LossSpec(estimator="grpo", loss_agg_mode="token-mean")
    print(f"tiny Qwen2: hidden 64, 2 layers, vocab 128, {sum(p.numel() for p in model.parameters())} parameters")
    equal = C.make_batch(0, [8] * 8, "binary", prompt_len=(16, 16), response_len=(64, 64))
    varied = C.make_batch(0, [8] * 8, "binary", prompt_len=(16, 16), response_len=(16, 112))
    ratios = run_setting(model, spec, equal, repeats, "equal-length responses (64 tokens)")
    run_setting(model, spec, varied, repeats, "variable-length responses (16-112 tokens, batched pads)")
    print(f"\nheadline: '{HEADLINE}' on equal-length responses")
    write_result("streaming_overhead", {"throughput_ratio": round(ratios[HEADLINE], 3)}, args.results_dir)


if __name__ == "__main__":
    main()
