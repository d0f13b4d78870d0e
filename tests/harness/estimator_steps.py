"""Advantage estimators beyond GRPO: verl's oracle, and one engine step two ways with any estimator.

Why:
1. ``verl_advantages`` runs verl's registered estimator on a batch laid out as verl's trainer lays it
   out (outcome reward on the last valid token, int64 response mask, ``uid`` groups, the algorithm
   config with gamma and the GRPO std flag): the oracle of the core tests.
2. ``EstimatorSpec`` is the estimator's spec for ``engine_steps.sync_step`` / ``stream_step``: verl's
   synchronous step with ``algorithm.adv_estimator`` set (``compute_log_prob``, the trainer-side
   ``compute_advantage(data, adv_estimator=name, config=...)``, ``update_actor``) against the stream
   planner with the same estimator driving the streaming worker, as the trainer does.
3. ``run_estimator`` builds both for ``benchmarks/equivalence.py --estimator NAME``: the same
   trajectories as the GRPO comparison (groups of 4, lengths 2-14, binary rewards with ties), the noise
   floor from verl's update with the rows regrouped, and the JSON keys listing which of verl's
   estimators stream and why the others are refused. ``--loss-agg-mode`` reaches both sides (the actor's
   ``loss_agg_mode`` and the planner's); the engine is ``--engine``'s (``megatron_breadth.policy_config``), and on
   Megatron at token-mean the diagnostics of ``equivalence.py`` point 7 run too (``megatron_breadth.add_diagnostics``).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from thundersync_harness.engine_setup import GROUP_SIZE, make_trajectories
from thundersync_harness.engine_steps import PolicySpec, stream_step, sync_step, train
from thundersync_verl.core.batch_estimators import Outcome
from thundersync_verl.core.estimators import REFUSED, STREAMED


def algorithm_config(norm_adv_by_std_in_grpo: bool = True):
    """The ``algorithm`` keys verl's estimators read (gamma, lam, the GRPO std flag)."""
    from omegaconf import OmegaConf

    return OmegaConf.create({"gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo})


def _verl_layout(outcomes: list[Outcome], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """token_level_rewards [B, T] (score on the last valid token), int64 response mask [B, T], uid [B]."""
    width = max(o.length for o in outcomes) + 2  # padding beyond the longest response
    rewards = torch.zeros(len(outcomes), width, dtype=dtype)  # [B, T]
    mask = torch.zeros(len(outcomes), width, dtype=torch.int64)  # [B, T]
    for b, o in enumerate(outcomes):
        mask[b, : o.length] = 1
        rewards[b, o.length - 1] = o.reward
    return rewards, mask, np.array([f"g{o.group}" for o in outcomes], dtype=object)


def verl_advantages(name: str, outcomes: list[Outcome], dtype: torch.dtype, norm: bool = True) -> list[float]:
    """verl's registered estimator on the batch, rows in the given order; one advantage per row.

    Checks on the way that verl's advantage is the same on every valid token and 0 on padding, the
    property that lets a streamed row carry one coefficient.
    """
    from verl.trainer.ppo import core_algos as ca

    rewards, mask, index = _verl_layout(outcomes, dtype)
    fn = ca.get_adv_estimator_fn(name)
    adv, _ = fn(token_level_rewards=rewards, response_mask=mask, index=index, config=algorithm_config(norm))
    per_row = adv[:, 0]  # [B]
    for b, o in enumerate(outcomes):
        if not (torch.equal(adv[b, : o.length], per_row[b].expand(o.length)) and not adv[b, o.length :].any()):
            raise AssertionError(f"verl's {name} advantage of row {b} is not one scalar on its valid tokens")
    return per_row.tolist()


def estimator_lists() -> dict:
    """The JSON keys: verl 0.9.1's estimators that stream, and the refused ones with the reason."""
    return {"estimators_streamed": list(STREAMED), "estimators_refused": dict(REFUSED)}


# ----- one step on the engine, two ways ---------------------------------------------------------
class EstimatorSpec(PolicySpec):
    """``PolicySpec`` with verl's trainer-side ``compute_advantage(adv_estimator=name, config=...)`` (gamma, lam,
    the GRPO std flag, ``num_repeat``); the stream planner and the worker's batch meta take the same name."""

    def advantages(self, data):
        from verl.trainer.ppo.ray_trainer import compute_advantage

        return compute_advantage(data, adv_estimator=self.adv_estimator, gamma=1.0, lam=1.0, num_repeat=GROUP_SIZE,
                                 norm_adv_by_std_in_grpo=True, config=algorithm_config())


def run_estimator(args, model_path, pad_id: int, vocab: int, groups: int, micro: int, regrouped) -> tuple[dict, dict]:
    """sync_a (rows in order), sync_b (rows regrouped by ``regrouped(n)``) and stream, ``args.steps`` steps each.

    The caller shuts Ray down. Returns the runs for ``equivalence.report`` and the JSON's estimator keys.
    """
    from thundersync_harness.megatron_breadth import (add_diagnostics, loss_scale_factor, policy_config,
                                                      start_policy_workers)

    if getattr(args, "kl", False) or getattr(args, "entropy", False):
        raise SystemExit("--estimator compares the policy term alone: run it without --kl / --entropy")
    mode = getattr(args, "loss_agg_mode", "token-mean")
    config = policy_config(args, model_path, groups=groups, micro=micro, loss_agg_mode=mode,
                           adv_estimator=args.estimator)  # FSDP2 or Megatron
    batches = [make_trajectories(1000 + 100 * args.seed + s, groups, vocab) for s in range(args.steps)]
    wg, _ = start_policy_workers(config, args)
    spec = EstimatorSpec(adv_estimator=args.estimator, loss_agg_mode=mode, loss_scale_factor=loss_scale_factor(mode))
    steps = {"sync_a": [], "sync_b": [], "stream": []}
    diagnostics = getattr(args, "engine", "fsdp") == "megatron" and mode == "token-mean"  # equivalence.py point 7
    for trajs, arrival in batches:
        steps["sync_a"].append(partial(sync_step, wg, trajs, list(range(len(trajs))), pad_id, spec))
        steps["sync_b"].append(partial(sync_step, wg, trajs, regrouped(len(trajs)), pad_id, spec))
        steps["stream"].append(partial(stream_step, wg, trajs, arrival, pad_id, spec))
        if diagnostics:
            add_diagnostics(steps, wg, trajs, arrival, pad_id, spec)
    runs = {kind: train(wg, fns) for kind, fns in steps.items()}
    return runs, {"adv_estimator": args.estimator, "loss_agg_mode": mode, **estimator_lists()}
