"""bf16 parameters with fp32 gradients for the equivalence comparison (``--dtype bf16``).

Why:
1. Production verl runs compute in bf16 and keeps fp32 master weights and fp32 gradients. The comparison
   sets that up for verl's update AND the streamed step from the one actor config, as verl's trainer would:
   - FSDP2 (verl's ``fsdp_config``): ``model_dtype=fp32`` (the sharded master weights, the optimizer's
     parameters) and ``mixed_precision`` ``param_dtype=bf16`` (FSDP2 casts the all-gathered parameters to bf16
     for forward and backward; verl's ``forward_step`` runs under ``torch.autocast(bf16)``), ``reduce_dtype=fp32``
     (each backward's gradient is cast to fp32 and reduced into the fp32 ``p.grad``), ``buffer_dtype=fp32``;
   - Megatron (verl's ``megatron`` config): ``dtype=bfloat16`` (bf16 parameters in Megatron's ``Float16Module``,
     fp32 main parameters in Megatron's mixed-precision optimizer) and ``grad_reduce_in_fp32=true`` (the DDP
     grad buffer, ``main_grad``, in fp32; verl's default, pinned here so the comparison does not depend on it).
   The streamed step's buckets copy those fp32 gradients and its deferred normaliser scales them in fp32
   (``learner/engines/*.py``), so what bf16 changes is each backward's own arithmetic, for both sides alike.
2. bf16 keeps 8 significant bits, so every backward's gradient carries relative errors near 2^-9 where fp32
   carries 2^-24: the floor (verl's update with its micro-batches regrouped) grows by orders of magnitude,
   and the acceptance stays the same rule, gap <= 2 x floor. Updates are read on the fp32 master weights (FSDP2's
   sharded parameters; Megatron's main parameters, ``backends/megatron/grads.master_parameters``): the bf16 copies
   round one step's change to their ulp (Megatron's step-1 floor read on them: 2.2e-2 to 2.5e-2; on the masters 3e-3).
3. The setting applies to the plain GRPO comparison (``--algo grpo`` without KL/entropy, other estimators,
   mini-batches, packing or token budgets, the Megatron experiments), at one rank per layout: other
   combinations are refused, not ignored.
4. What bf16 adds to the gap, and where (``diagnostic_steps``): a row's backward rounds every product downstream
   of its loss seed (dloss / dlog pi) to bf16, so the rounding of the WHOLE backward depends on the seed's
   mantissa. verl seeds row i with fl(A_i * fl(1/N)); a streamed row is seeded with A_i (direct) or 1 (bucket)
   and 1/N comes at the barrier, in fp32 (the normaliser is unknown until the batch is complete). Two figures
   separate that from the streaming machinery: the stream fed every trajectory before its first op, with every
   coefficient rounded as verl rounds it (``PrescaledSpec``; its direct chunks are verl's micro-batches), against
   verl's update (``gap_all_arrived_verl_rounding``), and, on FSDP2, verl's own update with its advantages x24
   against x16 (both above the clip: the same step, mathematically; only the seeds' mantissas move), over the
   floor (``gap_verl_rescaled_over_floor``; Megatron's diagnostics run this control already). The floor re-seeds
   no row, so it sees that rounding only as far as regrouping changes a row's own backward; the control is verl's
   own sensitivity to it. Neither changes the acceptance: gap <= 2 x floor.
5. Results (``--quick --dtype bf16 --seeds 0,1,2``): ``equivalence_bf16_seeds.json`` (FSDP2) and
   ``equivalence_megatron_tp1_pp1_dp1_bf16_seeds.json`` under ``benchmarks/results/``.
"""

from __future__ import annotations

DTYPES = ("fp32", "bf16")
CONTROL_POW2, CONTROL_OTHER = 16.0, 24.0  # advantage multipliers of the control (as equivalence.py point 7)
MEGATRON_NAMES = {"fp32": None, "bf16": "bfloat16"}  # None: the harness platform's own (engine_setup.platform_dtype)


def add_precision_arguments(parser) -> None:
    parser.add_argument("--dtype", default="fp32", choices=DTYPES,
                        help="bf16: bf16 parameters, fp32 master weights and gradients, for verl's update and the stream")


def check_precision(parser, args):
    """``args`` when ``--dtype`` fits the comparison, else ``parser.error`` naming what is refused (point 3)."""
    if args.dtype == "fp32":
        return args
    refused = [flag for flag, on in (
        ("--algo opd", args.algo != "grpo"), ("--kl", args.kl), ("--entropy", args.entropy),
        ("--estimator", args.estimator != "grpo"), ("--mini-batches", args.mini_batches > 1),
        ("--ppo-epochs", args.ppo_epochs > 1), ("--per-token-loss", args.per_token_loss),
        ("--float64-sum", args.float64_sum), ("--remove-padding", args.remove_padding),
        ("--dynamic-bsz", args.dynamic_bsz), ("--dp 2", args.dp > 1), ("--tp 2", args.tp > 1),
        ("--pp 2", args.pp > 1), ("--distributed-optimizer", args.distributed_optimizer),
        ("--optimizer AdamW", args.optimizer != "SGD"), ("--moe", getattr(args, "moe", False))) if on]
    if refused:
        parser.error(f"--dtype {args.dtype} runs the plain GRPO comparison (fsdp or megatron, one rank, SGD); "
                     f"not with {', '.join(refused)}")
    return args


def apply_precision(config, dtype: str, engine: str):
    """Set ``dtype`` (point 1) on the composed trainer ``config`` (``engine_setup.verl_config`` or
    ``megatron_engine.megatron_config``, built fp32) in place; returns it."""
    if dtype == "fp32":
        return config
    actor = config.actor_rollout_ref.actor
    if engine == "megatron":
        actor.megatron.dtype = MEGATRON_NAMES[dtype]
        actor.megatron.override_ddp_config = {**dict(actor.megatron.get("override_ddp_config") or {}),
                                              "grad_reduce_in_fp32": True}
        return config
    actor.fsdp_config.model_dtype = "fp32"
    actor.fsdp_config.mixed_precision = {"param_dtype": dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    return config


def describe(args) -> str:
    """The header's precision words."""
    dtype = getattr(args, "dtype", "fp32")
    return "fp32" if dtype == "fp32" else f"{dtype} parameters, fp32 master weights and gradients"


def diagnostic_steps(args, wg, batches, pad_id: int) -> dict:
    """Below fp32: ``{kind: [step per batch]}`` of point 4's diagnostics (plain GRPO batches ``(trajs, arrival)``)."""
    from functools import partial

    from thundersync_harness.engine_steps import PolicySpec, stream_step, sync_step
    from thundersync_harness.megatron_engine import PrescaledSpec

    if getattr(args, "dtype", "fp32") == "fp32":
        return {}
    steps = {"stream_all_prescaled": [partial(stream_step, wg, trajs, arrival, pad_id, PrescaledSpec(), every=len(trajs))
                                      for trajs, arrival in batches]}
    if args.engine == "fsdp":
        for kind, scale in (("sync_x16", CONTROL_POW2), ("sync_x24", CONTROL_OTHER)):
            steps[kind] = [partial(sync_step, wg, trajs, list(range(len(trajs))), pad_id,
                                   PolicySpec(advantage_scale=scale)) for trajs, _ in batches]
    return steps


def diagnostic_figures(runs: dict) -> dict:
    """Print point 4's figures per step; their worst steps for the JSON."""
    from thundersync_harness.engine_steps import relative_gap

    da, db = runs["sync_a"][0], runs["sync_b"][0]
    floors = [relative_gap(b, a) for b, a in zip(db, da)]
    matched = [relative_gap(x, a) for x, a in zip(runs["stream_all_prescaled"][0], da)]
    print("  stream fed every trajectory first, coefficients rounded as verl rounds them (diagnostic), gap to verl "
          "per step: " + ", ".join(f"{g:.3e}" for g in matched))
    out = {"gap_all_arrived_verl_rounding": max(matched)}
    if "sync_x16" in runs:
        (d16, info16), d24 = runs["sync_x16"], runs["sync_x24"][0]
        control = [relative_gap(o, p) for o, p in zip(d24, d16)]
        clipped = all(i["grad_norm"] > 1.0 for i in info16)  # verl's clip: 1.0
        print(f"  control: verl's update with advantages x{CONTROL_OTHER:g} vs x{CONTROL_POW2:g} ("
              + ("both clipped, the same step" if clipped else "NOT all above the clip 1.0: no control")
              + "), gap (gap/floor) per step: " + ", ".join(f"{g:.3e} ({g / f:.2f})" for g, f in zip(control, floors)))
        out.update(gap_verl_rescaled_over_floor=max(g / f for g, f in zip(control, floors)), control_clipped=clipped)
    return out


def precision_result(args, result: dict, name: str, runs: dict | None = None) -> str:
    """Add the ``dtype`` key (and point 4's figures when ``runs`` has them) to ``result``; the result's name with
    ``_<dtype>`` unless fp32 (fp32 names unchanged)."""
    dtype = getattr(args, "dtype", "fp32")
    result["dtype"] = dtype
    if runs is not None and "stream_all_prescaled" in runs:
        result.update(diagnostic_figures(runs))
    return name if dtype == "fp32" else f"{name}_{dtype}"
