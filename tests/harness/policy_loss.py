"""verl's other policy losses in the equivalence comparison (``--policy-loss NAME``).

Why:
1. ``actor.policy_loss.loss_mode`` selects verl's policy loss for verl's update; the stream reads the same config
   and, in the first mini-batch (ratio 1), backpropagates the gradient the table in ``core/policy_losses.py``
   derives for that loss. Setting the key on the one actor config tests exactly that derivation against verl's
   own function, with the same yardstick (gap <= 2 x floor).
2. The comparison is the plain GRPO one (FSDP2, one mini-batch), token-mean unless the loss is defined for another
   ``loss_agg_mode``: ``sapo`` runs with ``--loss-agg-mode seq-mean-token-mean`` (set on verl's actor config and on
   every path's spec, ``policy_loss_spec``) and is refused without it. The losses the table refuses are refused
   here too, each with the table's reason.
3. ``dro`` needs ``policy_loss.dro_beta > 0`` (verl raises without it): the comparison sets ``DRO_BETA``.
4. The result gets ``policy_loss`` and ``policy_losses_streamed`` (the table's list), and ``loss_agg_mode`` where the
   loss fixes it; its name gets ``_policy_<name>`` unless vanilla (vanilla names unchanged).
"""

from __future__ import annotations

from thundersync_verl.core.policy_losses import POLICY_LOSSES, streamed_policy_losses

DRO_BETA = 0.1


def add_policy_loss_arguments(parser) -> None:
    parser.add_argument("--policy-loss", default="vanilla", metavar="NAME",
                        help="actor.policy_loss.loss_mode for verl's update and the stream (core/policy_losses.py)")


def check_policy_loss(parser, args):
    """``args`` when ``--policy-loss`` fits the comparison, else ``parser.error`` (point 2)."""
    name = args.policy_loss
    if name == "vanilla":
        return args
    entry = POLICY_LOSSES.get(name)
    if entry is None or not entry.streams:
        parser.error(f"--policy-loss {name}: " + (entry.why if entry else "not in core/policy_losses.py")
                     + f"; streamed: {streamed_policy_losses()}")
    if entry.agg_mode is not None and args.loss_agg_mode != entry.agg_mode:
        parser.error(f"--policy-loss {name} needs --loss-agg-mode {entry.agg_mode} (verl defines {name} for it)")
    refused = [flag for flag, on in (
        ("--algo opd", args.algo != "grpo"), ("--engine megatron", args.engine != "fsdp"), ("--kl", args.kl),
        ("--entropy", args.entropy), ("--estimator", args.estimator != "grpo"),
        ("--mini-batches", args.mini_batches > 1), ("--ppo-epochs", args.ppo_epochs > 1)) if on]
    if refused:
        parser.error(f"--policy-loss {name} runs the plain GRPO comparison (fsdp, one mini-batch); "
                     f"not with {', '.join(refused)}")
    return args


def policy_loss_spec(args, spec):
    """The plain comparison's spec (``spec``, None: ``PolicySpec()``) with the ``loss_agg_mode`` the loss needs."""
    entry = POLICY_LOSSES.get(getattr(args, "policy_loss", "vanilla"))
    if entry is None or entry.agg_mode is None:
        return spec
    from dataclasses import replace

    from thundersync_harness.engine_steps import PolicySpec

    return replace(spec or PolicySpec(), loss_agg_mode=entry.agg_mode)


def apply_policy_loss(config, args):
    """Set ``actor.policy_loss.loss_mode`` (and dro's beta, point 3) on the composed ``config`` in place."""
    name = getattr(args, "policy_loss", "vanilla")
    if name == "vanilla":
        return config
    policy = config.actor_rollout_ref.actor.policy_loss
    policy.loss_mode = name
    if POLICY_LOSSES[name].agg_mode is not None:  # point 2: the mode the loss is defined for, checked above
        config.actor_rollout_ref.actor.loss_agg_mode = POLICY_LOSSES[name].agg_mode
    if name == "dro":
        policy.dro_beta = DRO_BETA
    return config


def policy_loss_result(args, result: dict, name: str) -> str:
    """Add point 4's keys to ``result``; the result's name with ``_policy_<name>`` unless vanilla."""
    loss = getattr(args, "policy_loss", "vanilla")
    result["policy_loss"] = loss
    result["policy_losses_streamed"] = streamed_policy_losses()
    if loss != "vanilla" and POLICY_LOSSES[loss].agg_mode is not None:
        result["loss_agg_mode"] = POLICY_LOSSES[loss].agg_mode  # point 2
    return name if loss == "vanilla" else f"{name}_policy_{loss}"
