"""Several optimizer steps per batch on the engine: verl's sync mini-batch loop and the streamed one.

Why:
1. ``benchmarks/equivalence.py --mini-batches K [--ppo-epochs E]`` and the engine test compare the
   streamed step (``MiniBatchPlanner`` driving the streaming worker: mini-batch 1 streamed at ratio 1,
   later mini-batches and epochs as PPO chunks, one ``finalize_step`` per mini-batch) with verl's OWN
   ``update_actor`` running K mini-batches for E epochs (verl's ``ppo_loss``: ratio and clip against
   the old log-probs, per-mini-batch normaliser, one optimizer step per mini-batch, the LR step once).
2. Same partition on both sides: the streamed mini-batch j is the j-th ``ppo_mini_batch_size`` groups
   to COMPLETE in the arrival order; verl is fed the batch ordered by that partition with its shuffle
   off (``dataloader_kwargs={"shuffle": False}``), so its j-th mini-batch holds the same groups.
3. Old log-probs: verl's ``compute_log_prob`` at the batch's weights on both sides. The streamed side
   receives them as the rollout's log-probs (what a rollout at the batch's weights reports, with no
   engine mismatch here), which is where the trainer takes them from (``learner_forward=fused``).
4. The floor is verl's update on the SAME partition with every mini-batch's rows regrouped: the stride
   permutation inside each mini-batch when it spans several micro-batches, else micro-batches of half
   the size (a mini-batch of one micro-batch has no other companions to give its rows).
5. With ``--kl`` / ``--entropy`` the reference model lives in its own worker group
   (``kl_entropy_steps``): verl's side takes the whole batch's reference log-probs before
   ``update_actor`` (``calculate_entropy`` on), the streamed side each chunk's just before its backward,
   PPO chunks of later mini-batches and epochs included.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from thundersync_harness.engine_setup import GROUP_SIZE, Traj, make_trajectories, start_workers, verl_config
from thundersync_harness.engine_steps import _old_log_probs, train
from thundersync_harness.kl_entropy_steps import KLStreamingClient, attach_ref_rows, kl_entropy_config
from thundersync_verl import verl_adapter as va
from thundersync_verl.learner.minibatch_loss import build_ppo_chunk
from thundersync_verl.step.minibatch_plan import MiniBatchPlanner, PPOBackwardOp, StepOp
from thundersync_verl.step.stream_plan import INDEPENDENT_BUCKETS_KEY, FoldOp, StreamPlanner

ACTOR = "actor_rollout_ref.actor"


def minibatch_config(model_path, *, groups: int, micro: int, mini_batches: int, epochs: int, optimizer: str = "SGD",
                     kl_type: str | None = None, entropy: bool = False):
    """``engine_setup.verl_config`` with ``ppo_mini_batch_size = groups / K`` and ``ppo_epochs = E`` (point 5: KL / entropy)."""
    from omegaconf import OmegaConf

    if groups % mini_batches:
        raise ValueError(f"{groups} groups cannot be cut into {mini_batches} equal mini-batches")
    if kl_type or entropy:
        config = kl_entropy_config(model_path, groups=groups, micro=micro, kl_type=kl_type, entropy=entropy,
                                   optimizer=optimizer)
    else:
        config = verl_config(model_path, groups=groups, micro=micro, optimizer=optimizer)
    OmegaConf.update(config, f"{ACTOR}.ppo_mini_batch_size", groups // mini_batches)
    OmegaConf.update(config, f"{ACTOR}.ppo_epochs", epochs)
    return config


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


# ----- verl's sync mini-batch loop -----------------------------------------------------------
def _padded_batch(trajs: list[Traj], rows: list[int], pad_token_id: int):
    import numpy as np

    from thundersync_verl.step.chunk_layout import pad_batch

    chosen = [trajs[i] for i in rows]
    tensors = pad_batch([t.prompt for t in chosen], [t.response for t in chosen], pad_token_id)
    rewards = torch.zeros(tensors["response_mask"].shape, dtype=torch.float32)  # [B, R]
    for b, t in enumerate(chosen):
        rewards[b, len(t.response) - 1] = t.reward
    return va.data_proto_cls().from_dict(tensors={**tensors, "token_level_rewards": rewards},
                                         non_tensors={"uid": np.array([f"g{t.gid}" for t in chosen], dtype=object)},
                                         meta_info={"temperature": 1.0})


def sync_minibatch_step(wg, trajs: list[Traj], row_order: list[int], pad_token_id: int, *, mb_rows: int,
                        epochs: int, micro: int | None = None, ref_wg=None, entropy: bool = False) -> dict:
    """compute_log_prob (-> compute_ref_log_prob) -> compute_advantage -> update_actor with mini-batches of
    ``mb_rows`` rows, ``epochs`` epochs, no shuffle (the rows are already in partition order), as verl's trainer
    calls it."""
    import numpy as np

    data = _padded_batch(trajs, row_order, pad_token_id)
    data.batch["old_log_probs"] = _old_log_probs(wg, data)
    if ref_wg is not None:
        attach_ref_rows(ref_wg, data)
    data = va.grpo_compute_advantage(data, adv_estimator="grpo")
    td = va.to_no_padding(data.to_tensordict())
    va.assign_non_tensor(td, calculate_entropy=entropy, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=mb_rows, mini_batch_size=mb_rows, epochs=epochs, seed=42,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    if micro is not None:
        va.assign_non_tensor(td, micro_batch_size_per_gpu=micro)
    metrics = va.td_get(wg.update_actor(td), "metrics")
    return {"grad_norm": float(np.mean(metrics["grad_norm"]))}


# ----- the streamed loop -----------------------------------------------------------------------
def stream_minibatch_step(wg, trajs: list[Traj], arrival: list[int], pad_token_id: int, *, mb_groups: int,
                          epochs: int, every: int = 2, max_chunk: int = 4, ref_wg=None, terms: bool = False) -> dict:
    """Trajectories arrive one by one; every ``every`` arrivals the mini-batch planner's ops run in order.
    ``terms``: the worker's actor has a KL loss or an entropy bonus (companion buckets, minibatch_plan point 7)."""
    planner = MiniBatchPlanner(StreamPlanner(adv_estimator="grpo", loss_agg_mode="token-mean", max_chunk_size=max_chunk),
                               minibatch_groups=mb_groups, epochs=epochs, independent_buckets=terms)
    everything = list(range(len(trajs)))
    old = _old_log_probs(wg, _padded_batch(trajs, everything, pad_token_id))  # [B, R] at the batch's weights
    client = KLStreamingClient(wg, ref_wg, pad_token_id=pad_token_id)
    groups = sorted({t.gid for t in trajs})
    meta = {"loss_agg_mode": "token-mean", "train_batch_size": len(groups), "adv_estimator": "grpo",
            INDEPENDENT_BUCKETS_KEY: terms}
    planner.begin_batch({g: GROUP_SIZE for g in groups})
    client.begin_batch(meta)
    name = {id(t): f"{t.gid}:{t.tid}" for t in trajs}
    table = {(t.gid, name[id(t)]): (t.prompt, t.response) for t in trajs}
    rollout_lp = {name[id(t)]: old[i, : len(t.response)].tolist() for i, t in enumerate(trajs)}
    kinds = {"direct": 0, "bucket": 0, "fold": 0, "ppo": 0, "steps": 0}

    def run(op):
        if isinstance(op, StepOp):
            wg.finalize_step(op.scale, op.lr_step)
            client.begin_batch(meta)
            kinds["steps"] += 1
        elif isinstance(op, PPOBackwardOp):
            rows = [table[item] for item in op.items]
            chunk = build_ppo_chunk([r[0] for r in rows], [r[1] for r in rows], op.coefs,
                                    [rollout_lp[t] for _, t in op.items], dp_size=client.dp_size,
                                    pad_token_id=pad_token_id)
            client.attach_ref(chunk)
            wg.stream_backward(chunk)
            kinds["ppo"] += 1
        else:
            kinds["fold" if isinstance(op, FoldOp) else ("direct" if op.dest == "direct" else "bucket")] += 1
            client.run([op], table)

    for k, i in enumerate(arrival):
        t = trajs[i]
        planner.arrive(t.gid, name[id(t)], t.reward, len(t.response))
        if (k + 1) % every == 0 or k + 1 == len(arrival):
            for op in planner.next_ops():
                run(op)
    metrics = client.finalize(planner.finalize())
    return {**metrics, **{f"ops/{k}": v for k, v in kinds.items()}, **planner.metrics(), "ref_calls": client.ref_calls}


def minibatch_steps(wg, batches, pad_token_id: int, micro: int, *, mb_groups: int, epochs: int, ref_wg=None,
                    entropy: bool = False) -> dict:
    """sync_a: verl on the streamed partition; sync_b: the same with rows regrouped (the floor); stream."""
    steps = {"sync_a": [], "sync_b": [], "stream": []}
    for trajs, arrival in batches:
        parts = partition_rows(trajs, arrival, mb_groups)
        mb_rows = len(parts[0])
        order_b, micro_b = regrouped(parts, micro)
        terms = {"ref_wg": ref_wg, "entropy": entropy}
        steps["sync_a"].append(partial(sync_minibatch_step, wg, trajs, [i for p in parts for i in p], pad_token_id,
                                       mb_rows=mb_rows, epochs=epochs, **terms))
        steps["sync_b"].append(partial(sync_minibatch_step, wg, trajs, order_b, pad_token_id, mb_rows=mb_rows,
                                       epochs=epochs, micro=micro_b, **terms))
        steps["stream"].append(partial(stream_minibatch_step, wg, trajs, arrival, pad_token_id, mb_groups=mb_groups,
                                       epochs=epochs, ref_wg=ref_wg, terms=ref_wg is not None or entropy))
    return steps


def run_minibatches(args, model_path, pad_id: int, vocab: int, groups: int, micro: int, work=None) -> tuple[dict, dict]:
    """The comparison of ``equivalence.py --mini-batches K --ppo-epochs E [--kl] [--entropy]``: (runs, JSON extras).
    Ray is left up; ``work`` holds the reference model with ``--kl``."""
    from thundersync_harness import kl_entropy_steps as kle

    if groups % args.mini_batches:
        raise SystemExit(f"--mini-batches {args.mini_batches} must divide the {groups} groups of a step")
    mb_groups = groups // args.mini_batches
    kl_type = args.kl_type if getattr(args, "kl", False) else None
    entropy = bool(getattr(args, "entropy", False))
    config = minibatch_config(model_path, groups=groups, micro=micro, mini_batches=args.mini_batches,
                              epochs=args.ppo_epochs, optimizer=args.optimizer, kl_type=kl_type, entropy=entropy)
    batches = [make_trajectories(1000 + 100 * args.seed + s, groups, vocab) for s in range(args.steps)]
    if kl_type or entropy:
        ref_path = kle.build_reference(model_path, work / "ref") if kl_type else None
        wg, ref_wg = kle.start_kl_workers(config, args.dp, ref_path)
    else:
        wg, ref_wg = start_workers(config, args.dp), None
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
