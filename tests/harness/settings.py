"""The comparison's setting flags as one pipeline (``benchmarks/equivalence.py`` points 13-16).

Why:
1. Each setting verl users turn on (packed rows, token budgets, bf16, MoE with expert parallel, LoRA) lives in its
   own harness module with the same four parts: its arguments, its refusals, what it changes in verl's config (both
   the stream and verl's update read it from there), and the keys and name suffix it adds to the result. They run
   here in one fixed order, so the benchmark names each part once and a new setting is one more module in a list.
2. The order of the name suffixes is the order of the modules: batching, precision, MoE, LoRA, policy loss, rollout
   correction, OPD's distillation settings (the result files already written keep their names).
"""

from __future__ import annotations

from thundersync_harness import batching, lora, moe, opd_steps, policy_loss, precision, rollout_correction


def add_arguments(parser) -> None:
    batching.add_batching_arguments(parser)
    precision.add_precision_arguments(parser)
    moe.add_moe_arguments(parser)
    lora.add_lora_arguments(parser)
    policy_loss.add_policy_loss_arguments(parser)
    rollout_correction.add_rollout_correction_arguments(parser)
    opd_steps.add_distillation_arguments(parser)


def check(parser, args):
    """``args`` when every setting fits the comparison, else ``parser.error`` from the first that does not."""
    args = batching.check_batching(parser, args)
    args = precision.check_precision(parser, args)
    args = moe.check_moe(parser, args)
    args = lora.check_lora(parser, args)
    args = policy_loss.check_policy_loss(parser, args)
    args = rollout_correction.check_rollout_correction(parser, args)
    args.rc_spec = policy_loss.policy_loss_spec(  # one spec: its drawn log-probs and counts, the loss's agg mode
        args, rollout_correction.rollout_correction_spec(args))
    return opd_steps.check_distillation(parser, args)


def apply(config, args) -> None:
    """The settings verl's config carries for both paths (batching is applied by the config builders)."""
    precision.apply_precision(config, args.dtype, args.engine)
    moe.apply_moe_args(config, args)
    lora.apply_lora(config, args)
    policy_loss.apply_policy_loss(config, args)


def result_name(args, result: dict, name: str, runs: dict) -> str:
    """Add every setting's keys to ``result``; the result's name with their suffixes (point 2)."""
    name = batching.batching_result(args, result, name, runs)
    name = precision.precision_result(args, result, name, runs)
    name = moe.moe_result(args, result, name)
    name = lora.lora_result(args, result, name, runs)
    name = policy_loss.policy_loss_result(args, result, name)
    name = rollout_correction.rollout_correction_result(args, result, name, getattr(args, "rc_spec", None))
    return opd_steps.distillation_result(args, result, name, getattr(args, "verl_config", None))
