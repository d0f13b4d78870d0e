"""Several optimizer steps per batch on the engine: verl's sync mini-batch loop and the streamed one.

Why:
1. ``benchmarks/equivalence.py --mini-batches K [--ppo-epochs E]`` and the engine test compare the
   streamed step (``MiniBatchPlanner`` driving the streaming worker: mini-batch 1 streamed at ratio 1,
   later mini-batches and epochs as PPO chunks, one ``finalize_step`` per mini-batch) with verl's OWN
   ``update_actor`` running K mini-batches for E epochs (verl's ``ppo_loss``: ratio and clip against
   the old log-probs, per-mini-batch normaliser, one optimizer step per mini-batch, the LR step once).
2. Same partition on both sides: the streamed mini-batch j is the j-th ``ppo_mini_batch_size`` groups
   to COMPLETE in the arrival order; verl is fed the batch ordered by that partition with its shuffle
   off (``dataloader_kwargs={"shuffle": False}``), so its j-th mini-batch holds the same groups. With DP > 1
   the order is rank-major (``verl_order``): verl's ``update_actor`` hands rank r the r-th contiguous 1/dp of the
   batch and each rank cuts its mini-batches from its own share, so global mini-batch j is every rank's j-th
   slice; ordered by partition alone, mini-batch j would mix rows of several partitions (measured at DP 2: verl's
   own update then moves by 10-65% when the rows are regrouped).
3. Old log-probs: verl's ``compute_log_prob`` at the batch's weights on both sides. The streamed side
   receives them as the rollout's log-probs (what a rollout at the batch's weights reports, with no
   engine mismatch here), which is where the trainer takes them from (``learner_forward=fused``).
4. The floor is verl's update on the SAME partition with every mini-batch's rows regrouped: the stride
   permutation inside each mini-batch when it spans several micro-batches, else micro-batches of half
   the size (a mini-batch of one micro-batch has no other companions to give its rows).
5. ``MiniBatchSpec`` is the feature's spec for ``engine_steps.sync_step`` / ``stream_step``; its client adds
   the PPO chunks and the per-mini-batch optimizer steps to the harness client.
6. With ``--kl`` / ``--entropy`` the reference model lives in its own worker group
   (``kl_entropy_steps``): verl's side takes the whole batch's reference log-probs before
   ``update_actor`` (``calculate_entropy`` on), the streamed side each chunk's just before its backward,
   PPO chunks of later mini-batches and epochs included.
7. The config and the worker group come from ``megatron_breadth`` (``policy_config``, ``start_policy_workers``):
   the same comparison on verl's FSDP2 engine or, with ``--engine megatron``, on its Megatron engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

from thundersync_harness.engine_setup import GROUP_SIZE, Traj, make_trajectories
from thundersync_harness.engine_steps import (PolicySpec, StreamingLearnerClient, TrajFeed, rollout_batch, stream_step,
                                             sync_step, traj_name, train)
from thundersync_verl.learner.minibatch_loss import build_ppo_chunk
from thundersync_verl.step.minibatch_plan import MiniBatchPlanner, PPOBackwardOp, StepOp
from thundersync_verl.step.stream_plan import INDEPENDENT_BUCKETS_KEY


# ----- the partition -------------------------------------------------------------------------
def completion_order(trajs: list[Traj], arrival: list[int]) -> list[int]:
    """Group ids in the order their last trajectory arrives."""
    seen, order = {}, []
    for i in arrival:
        gid = trajs[i].gid
        seen[gid] = seen.get(gid, 0) + 1
        if seen[gid] == GROUP_SIZE:
            order.append(gid)
    return order


def partition_rows(trajs: list[Traj], arrival: list[int], mb_groups: int) -> list[list[int]]:
    """Row indices of each mini-batch: its groups (in completion order), each group's rows in order."""
    gids = completion_order(trajs, arrival)
    parts = [gids[j:j + mb_groups] for j in range(0, len(gids), mb_groups)]
    return [[i for g in part for i, t in enumerate(trajs) if t.gid == g] for part in parts]


def regrouped(parts: list[list[int]], micro: int) -> tuple[list[int], int]:
    """The floor's row order and micro-batch size (point 4): rows regrouped inside every mini-batch."""
    if len(parts[0]) > micro:
        stride = max(1, len(parts[0]) // micro)
        return [p[i] for p in parts for i in sorted(range(len(p)), key=lambda i: (i % stride, i))], micro
    return [i for p in parts for i in p], max(1, micro // 2)


def verl_order(parts: list[list[int]], dp: int = 1) -> list[int]:
    """The row order that makes verl's global mini-batch j the rows of ``parts[j]`` on ``dp`` data-parallel ranks
    (point 2): rank by rank, the rank's share of every mini-batch in turn."""
    if any(len(p) % dp for p in parts):
        raise ValueError(f"mini-batches of {[len(p) for p in parts]} rows do not split over {dp} data-parallel ranks")
    return [i for r in range(dp) for p in parts for i in p[r * len(p) // dp:(r + 1) * len(p) // dp]]


def _split_like(order: list[int], parts: list[list[int]]) -> list[list[int]]:
    out, start = [], 0
    for p in parts:
        out.append(order[start:start + len(p)])
        start += len(p)
    return out


# ----- the step, two ways ---------------------------------------------------------------------
@dataclass(frozen=True)
class MiniBatchSpec(PolicySpec):
    """The GRPO spec (KL and entropy as ``kl_spec``) with mini-batches of ``mb_groups`` groups and ``epochs``
    epochs. verl: ``update_actor`` with mini-batches of ``mb_groups`` x GROUP_SIZE rows, no shuffle (the rows
    come in partition order). Streamed: ``MiniBatchPlanner``; the old log-probs are verl's ``compute_log_prob``
    of the whole batch at its weights, taken before the stream begins (point 3)."""

    mb_groups: int = 1
    epochs: int = 1

    def mini_rows(self, n_rows: int) -> int:
        return self.mb_groups * GROUP_SIZE

    def feed(self, wg, trajs, pad_token_id, max_chunk):
        """``independent_buckets``: the worker's actor has a KL loss or an entropy bonus (minibatch_plan point 7)."""
        terms = self.ref_wg is not None or self.entropy
        planner = MiniBatchPlanner(self.planner(max_chunk), minibatch_groups=self.mb_groups, epochs=self.epochs,
                                   independent_buckets=terms)
        old = rollout_batch(wg, trajs, list(range(len(trajs))), pad_token_id).batch["old_log_probs"]  # [B, R]
        rollout_lp = {traj_name(t): old[i, : len(t.response)].tolist() for i, t in enumerate(trajs)}
        client = MiniBatchClient(wg, pad_token_id=pad_token_id, ref_group=self.ref_wg, rollout_lp=rollout_lp)
        meta = {**self.meta(len({t.gid for t in trajs})), INDEPENDENT_BUCKETS_KEY: terms}
        return MiniBatchFeed(planner, client, trajs, meta)


class MiniBatchClient(StreamingLearnerClient):
    """The harness client plus the mini-batch planner's ops: a ``PPOBackwardOp`` (verl's PPO loss against the
    rollout's log-probs, reference log-probs attached) and a ``StepOp`` (the mini-batch's optimizer step, then
    the next mini-batch begins with the same meta)."""

    def __init__(self, worker_group, *, rollout_lp: dict, **kwargs):
        super().__init__(worker_group, **kwargs)
        self.rollout_lp, self.meta = rollout_lp, None

    def begin_batch(self, meta: dict) -> None:
        self.meta = meta
        super().begin_batch(meta)

    def run(self, ops, trajectories) -> list:
        for op in ops:
            if isinstance(op, StepOp):
                self.wg.finalize_step(op.scale, op.lr_step)
                self.begin_batch(self.meta)
            elif isinstance(op, PPOBackwardOp):
                rows = [trajectories[item] for item in op.items]
                chunk = build_ppo_chunk([r[0] for r in rows], [r[1] for r in rows], op.coefs,
                                        [self.rollout_lp[t] for _, t in op.items], dp_size=self.dp_size,
                                        pad_token_id=self.pad_token_id)
                self.attach_ref(chunk)
                self.wg.stream_backward(chunk)
            else:
                super().run([op], trajectories)
        return []


class MiniBatchFeed(TrajFeed):
    kinds = ("direct", "bucket", "fold", "ppo", "steps")

    def figures(self, final) -> dict:
        return {**self.planner.metrics(), "ref_calls": self.client.ref_calls}


def minibatch_steps(wg, batches, pad_token_id: int, micro: int, *, mb_groups: int, epochs: int, ref_wg=None,
                    entropy: bool = False) -> dict:
    """sync_a: verl on the streamed partition; sync_b: the same with rows regrouped (the floor); stream."""
    from thundersync_verl import verl_adapter as va

    spec = MiniBatchSpec(mb_groups=mb_groups, epochs=epochs, ref_wg=ref_wg, entropy=entropy)
    steps, dp = {"sync_a": [], "sync_b": [], "stream": []}, va.actor_dp_size(wg)
    for trajs, arrival in batches:
        parts = partition_rows(trajs, arrival, mb_groups)
        order_b, micro_b = regrouped(parts, micro)
        order_b = verl_order(_split_like(order_b, parts), dp)
        steps["sync_a"].append(partial(sync_step, wg, trajs, verl_order(parts, dp), pad_token_id, spec))
        steps["sync_b"].append(partial(sync_step, wg, trajs, order_b, pad_token_id, spec, micro=micro_b))
        steps["stream"].append(partial(stream_step, wg, trajs, arrival, pad_token_id, spec))
    return steps


def run_minibatches(args, model_path, pad_id: int, vocab: int, groups: int, micro: int, work=None) -> tuple[dict, dict]:
    """The comparison of ``equivalence.py --mini-batches K --ppo-epochs E [--kl] [--entropy]``: (runs, JSON extras).
    Ray is left up; ``work`` holds the reference model with ``--kl``."""
    from thundersync_harness import kl_entropy_steps as kle
    from thundersync_harness.megatron_breadth import policy_config, start_policy_workers

    if groups % args.mini_batches:
        raise SystemExit(f"--mini-batches {args.mini_batches} must divide the {groups} groups of a step")
    mb_groups = groups // args.mini_batches
    kl_type = args.kl_type if getattr(args, "kl", False) else None
    entropy = bool(getattr(args, "entropy", False))
    config = policy_config(args, model_path, groups=groups, micro=micro, mini_batches=args.mini_batches,
                           epochs=args.ppo_epochs, kl_type=kl_type, entropy=entropy)  # FSDP2 or Megatron
    batches = [make_trajectories(1000 + 100 * args.seed + s, groups, vocab) for s in range(args.steps)]
    ref_path = kle.build_reference(model_path, work / "ref") if kl_type else None
    wg, ref_wg = start_policy_workers(config, args, ref_path, terms=bool(kl_type or entropy))
    t0 = time.time()
    runs = {kind: train(wg, fns) for kind, fns in minibatch_steps(wg, batches, pad_id, micro, mb_groups=mb_groups,
                                                                   epochs=args.ppo_epochs, ref_wg=ref_wg,
                                                                   entropy=entropy).items()}
    infos = runs["stream"][1]
    _, micro_b = regrouped(partition_rows(*batches[0], mb_groups), micro)
    extra = {"mini_batches": args.mini_batches, "ppo_epochs": args.ppo_epochs, "mini_batch_groups": mb_groups,
             "optimizer_steps_per_batch": infos[0]["thundersync/optimizer_steps"],
             "policy_lag_max": max(i["thundersync/minibatch_policy_lag/max"] for i in infos),
             "rerun_rows": sum(i["thundersync/minibatch_rerun_rows"] for i in infos),
             "floor_regrouping": "stride permutation inside each mini-batch" if micro_b == micro
             else f"micro-batches of {micro_b} rows inside each mini-batch (verl: {micro})",
             "kl_loss_type": kl_type, "kl_loss_coef": kle.KL_COEF if kl_type else 0.0,
             "entropy_coeff": kle.ENTROPY_COEF if entropy else 0.0, "ref_calls": sum(i["ref_calls"] for i in infos),
             "seconds_compare": time.time() - t0}
    return runs, extra
