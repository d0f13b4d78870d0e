"""Several mini-batches and other advantage estimators on verl's MEGATRON engine: the config and the world.

Why:
1. ``benchmarks/equivalence.py --mini-batches K [--ppo-epochs E]`` and ``--estimator NAME`` compare the trainer's
   streamed step with verl's ``update_actor`` (``minibatch_steps``, ``estimator_steps``). Nothing in those
   comparisons is engine-specific: the specs drive verl's worker API (``compute_log_prob``, ``update_actor``)
   and the streaming worker's, whatever engine sits behind them. On Megatron only two things differ, and they
   live here: the config (``megatron_engine.megatron_config``, or ``megatron_kl_entropy`` with KL / entropy,
   plus the mini-batch, epoch, estimator and loss-aggregation keys) and the number of Ray workers (one per
   TP x PP x DP rank, not one per DP rank).
2. ``policy_config`` is the one place that maps the comparison's settings onto a verl config for either engine,
   so the FSDP2 and Megatron runs of a comparison differ in the engine alone: ``loss_agg_mode`` reaches the actor
   (and ``seq-mean-token-sum-norm`` its fixed divisor, ``loss_scale_factor``), ``adv_estimator`` the algorithm.
3. The worker group is the plain streaming worker on both engines (``engine_setup.start_workers`` with
   ``world(args)`` workers), or the actor and reference groups with ``--kl`` (``kl_entropy_steps``); the
   reference inherits the actor's Megatron layout.
4. ``check_breadth``: the flags these comparisons do not honour are refused before anything is built, never
   ignored (a run named after a setting it did not use would be a false figure): ``--loss-agg-mode`` other than
   token-mean with several mini-batches (the mini-batch planner's PPO chunks are compared at token-mean), the
   plain comparison's Megatron experiments (``--per-token-loss``, ``--float64-sum``, ``--moe``, ``--ep``).
5. ``add_diagnostics``: on Megatron at token-mean, the estimator comparison also runs the diagnostics of
   ``equivalence.py`` point 7 (the stream with verl's rounding of 1/N, verl's update with its advantages x16
   and x24, verl's update with one row per micro-batch), so its JSON says how much of the gap is rounding that
   no streamed row can share with verl, as the plain GRPO comparison's does.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

ACTOR = "actor_rollout_ref.actor"
CONTROL_POW2, CONTROL_OTHER = 16.0, 24.0  # equivalence.py point 7's advantage multipliers


def world(args) -> int:
    """Ray workers of the comparison's actor group: TP x PP x DP ranks on Megatron, DP ranks on FSDP2."""
    return args.dp * (args.tp * args.pp if getattr(args, "engine", "fsdp") == "megatron" else 1)


def loss_scale_factor(loss_agg_mode: str) -> int | None:
    """``seq-mean-token-sum-norm`` needs verl's fixed divisor (``kl_entropy_steps.LOSS_SCALE_FACTOR``); else None."""
    from thundersync_harness.kl_entropy_steps import LOSS_SCALE_FACTOR

    return LOSS_SCALE_FACTOR if loss_agg_mode == "seq-mean-token-sum-norm" else None


def policy_config(args, model_path: Path, *, groups: int, micro: int, mini_batches: int = 1, epochs: int = 1,
                  kl_type: str | None = None, entropy: bool = False, loss_agg_mode: str = "token-mean",
                  adv_estimator: str = "grpo"):
    """verl's config for one comparison on ``args.engine``: mini-batches of ``groups / mini_batches`` groups for
    ``epochs`` epochs, verl's KL loss / entropy bonus, ``loss_agg_mode`` and ``adv_estimator`` (point 2)."""
    from omegaconf import OmegaConf

    from thundersync_harness import kl_entropy_steps as kle
    from thundersync_harness.engine_setup import verl_config

    if groups % mini_batches:
        raise ValueError(f"{groups} groups cannot be cut into {mini_batches} equal mini-batches")
    if getattr(args, "engine", "fsdp") == "megatron":
        from thundersync_harness.megatron_engine import megatron_config
        from thundersync_harness.megatron_kl_entropy import megatron_kl_entropy_config

        layout = {"tp": args.tp, "pp": args.pp, "distributed_optimizer": args.distributed_optimizer}
        if kl_type or entropy:
            config = megatron_kl_entropy_config(model_path, groups=groups, micro=micro, kl_type=kl_type,
                                                entropy=entropy, loss_agg_mode=loss_agg_mode, **layout)
        else:
            config = megatron_config(model_path, groups=groups, micro=micro, loss_agg_mode=loss_agg_mode, **layout)
    elif kl_type or entropy:
        config = kle.kl_entropy_config(model_path, groups=groups, micro=micro, kl_type=kl_type, entropy=entropy,
                                       loss_agg_mode=loss_agg_mode, optimizer=args.optimizer)
    else:
        config = verl_config(model_path, groups=groups, micro=micro, optimizer=args.optimizer,
                             loss_agg_mode=loss_agg_mode)
    changes = {f"{ACTOR}.ppo_mini_batch_size": groups // mini_batches, f"{ACTOR}.ppo_epochs": epochs,
               "algorithm.adv_estimator": adv_estimator}
    if loss_scale_factor(loss_agg_mode) is not None:
        changes[f"{ACTOR}.loss_scale_factor"] = loss_scale_factor(loss_agg_mode)
    for key, value in changes.items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


def start_policy_workers(config, args, ref_path: Path | None = None, *, terms: bool = False):
    """``(actor group, reference group or None)`` for ``world(args)`` ranks (point 3); ``terms``: the run has verl's
    KL loss or entropy bonus (the actor group then leaves slots for a reference group)."""
    from thundersync_harness import kl_entropy_steps as kle
    from thundersync_harness.engine_setup import start_workers

    if terms:
        return kle.start_kl_workers(config, world(args), ref_path)
    return start_workers(config, world(args)), None


def check_breadth(parser, args) -> None:
    """``parser.error`` for what ``--estimator`` / ``--mini-batches`` / ``--ppo-epochs`` cannot run (point 4)."""
    if args.algo != "grpo":
        parser.error("--estimator / --mini-batches / --ppo-epochs run --algo grpo")
    if args.estimator != "grpo" and (args.mini_batches > 1 or args.ppo_epochs > 1):
        parser.error("--estimator runs the one-step comparison: leave --mini-batches and --ppo-epochs at 1")
    if (args.mini_batches > 1 or args.ppo_epochs > 1) and args.loss_agg_mode != "token-mean":
        parser.error("--mini-batches / --ppo-epochs compare loss_agg_mode token-mean only (--loss-agg-mode)")
    others = [flag for flag, on in (("--per-token-loss", args.per_token_loss), ("--float64-sum", args.float64_sum),
                                    ("--moe", getattr(args, "moe", False)), ("--ep", getattr(args, "ep", 1) > 1))
              if on]
    if others:
        parser.error(f"{', '.join(others)}: the plain GRPO comparison only, not --estimator / --mini-batches")


def add_diagnostics(steps: dict, wg, trajs, arrival, pad_id: int, spec) -> None:
    """Append one batch's diagnostic step functions of point 5 to ``steps`` (``sync_step`` / ``stream_step``
    with ``spec``: a ``PolicySpec`` at token-mean), under the kinds ``equivalence.report`` reads."""
    from thundersync_harness.engine_steps import stream_step, sync_step
    from thundersync_harness.megatron_engine import PrescaledFeed

    prescaled = type(f"Prescaled{type(spec).__name__}", (type(spec),), {"feed_class": PrescaledFeed})
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    order, scaled = list(range(len(trajs))), partial(dataclasses.replace, spec)
    kinds = {
        "stream_prescaled": partial(stream_step, wg, trajs, arrival, pad_id, prescaled(**fields)),
        "sync_pow2": partial(sync_step, wg, trajs, order, pad_id, scaled(advantage_scale=CONTROL_POW2)),
        "sync_other": partial(sync_step, wg, trajs, order, pad_id, scaled(advantage_scale=CONTROL_OTHER)),
        "sync_fine": partial(sync_step, wg, trajs, order, pad_id, spec, micro=1),
    }
    for kind, fn in kinds.items():
        steps.setdefault(kind, []).append(fn)
