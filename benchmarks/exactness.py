"""Exactness of the streamed update vs verl's batch-synchronous update on a tiny transformer.

Why:
1. The project's central promise is that streaming changes WHEN gradients are computed, not
   WHAT the update is. This benchmark measures it across streaming modes (affine, buckets,
   reward arriving late, ready-set chunks, canonical order), estimators (GRPO, Dr.GRPO-style
   GRPO without std, RLOO), every verl loss_agg_mode, in float32 and float64.
2. Per case: 3 training steps with AdamW on two copies of the model, one driven by verl's own
   batch-synchronous loss (one padded forward through verl's estimator, vanilla policy loss,
   kl_penalty, agg_loss), one by the streaming accumulator (per-trajectory backward in a
   shuffled arrival order, barrier with optimizer step). Reported: the largest relative
   gradient error over the steps (both gradients taken at the streamed model's weights, so
   the figure isolates the streaming error) and the largest parameter difference between the
   two copies after 3 steps (what the error does to training).
3. Canonical order: the same batch streamed in many random orders must give bitwise equal
   gradients.
"""

from __future__ import annotations

import argparse
import random

import torch

from thundersync_harness import tiny_lm as C
from thundersync_verl.run.results import add_results_dir_argument, write_result

ESTIMATORS = ("grpo", "grpo_no_std", "rloo")
AGG = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
STEPS = 3
LR = 1e-3


def run_case(mode: str, estimator: str, agg: str, dtype: torch.dtype, seed: int) -> tuple[float, float]:
    """(max relative gradient error over the steps, max |param diff| after STEPS steps)."""
    spec = C.LossSpec(
        estimator=estimator,
        loss_agg_mode=agg,
        loss_scale_factor=16 if agg == "seq-mean-token-sum-norm" else None,
        entropy_coeff=0.01,
        kl_coef=0.05,
    )
    streamed, synced, ref = C.tiny_qwen2(0, dtype), C.tiny_qwen2(0, dtype), C.tiny_qwen2(1, dtype)
    opt_s = torch.optim.AdamW(streamed.parameters(), lr=LR)
    opt_o = torch.optim.AdamW(synced.parameters(), lr=LR)
    worst = 0.0
    for step in range(STEPS):
        trajs = C.make_batch(seed * 100 + step, [4, 3, 1, 4], ("binary", "ties", "continuous")[step % 3])
        order = list(range(len(trajs)))
        random.Random(seed + step).shuffle(order)
        acc = C.make_accumulator(streamed, spec, mode)
        C.stream_batch(acc, streamed, ref, spec, trajs, order, mode)
        worst = max(worst, C.relative_error(acc.compute_batch_gradient(), C.oracle_gradient(streamed, ref, spec, trajs)))
        acc.finish_batch(list(streamed.parameters()), optimizer=opt_s)
        for p, g in zip(synced.parameters(), C.oracle_gradient(synced, ref, spec, trajs)):
            p.grad = g
        opt_o.step()
        opt_o.zero_grad(set_to_none=True)
    with torch.no_grad():
        diff = max(float((a - b).abs().max()) for a, b in zip(streamed.parameters(), synced.parameters()))
    return worst, diff


def canonical_bitwise(permutations: int) -> bool:
    model, ref = C.tiny_qwen2(0, torch.float32), C.tiny_qwen2(1, torch.float32)
    spec = C.LossSpec(estimator="grpo", loss_agg_mode="token-mean", entropy_coeff=0.01, kl_coef=0.05)
    trajs = C.make_batch(7, [4, 4, 2, 3], "continuous")
    rng = random.Random(0)
    first = None
    for _ in range(permutations):
        order = list(range(len(trajs)))
        rng.shuffle(order)
        acc = C.make_accumulator(model, spec, "canonical")
        C.stream_batch(acc, model, ref, spec, trajs, order, "canonical")
        bits = [g.view(torch.int32).clone() for g in acc.compute_batch_gradient()]
        if first is None:
            first = bits
        elif not all(torch.equal(a, b) for a, b in zip(first, bits)):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a representative subset of the grid")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    estimators = ("grpo", "rloo") if args.quick else ESTIMATORS
    aggs = ("token-mean", "seq-mean-token-mean") if args.quick else AGG
    worst = {name: 0.0 for name in DTYPES}
    cases = 0
    print(f"{'mode':<11}{'estimator':<13}{'loss_agg_mode':<25}{'dtype':<6}{'rel err':>10}{'param diff':>12}")
    for mode in C.STREAM_MODES:
        for est in estimators:
            for agg in aggs:
                for name, dtype in DTYPES.items():
                    err, diff = run_case(mode, est, agg, dtype, seed=cases)
                    worst[name] = max(worst[name], err)
                    cases += 1
                    print(f"{mode:<11}{est:<13}{agg:<25}{name:<6}{err:>10.2e}{diff:>12.2e}")
    perms = 5 if args.quick else 20
    bitwise = canonical_bitwise(perms)
    print(f"\ncanonical order, {perms} random arrival orders, float32: bitwise identical = {bitwise}")
    print(f"max relative error: fp32 {worst['fp32']:.2e} (target <= 1e-6), fp64 {worst['fp64']:.2e} (target <= 1e-12)")
    write_result(
        "exactness",
        {
            "max_rel_err_fp32": float(f"{worst['fp32']:.3e}"),
            "max_rel_err_fp64": float(f"{worst['fp64']:.3e}"),
            "canonical_bitwise": bitwise,
            "cases": cases,
        },
        args.results_dir,
    )


if __name__ == "__main__":
    main()
