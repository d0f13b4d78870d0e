"""One optimizer step on the engine, two ways: verl's batch-synchronous update and the streamed one.

Why:
1. The synchronous path is verl's OWN functions (``compute_log_prob``, ``compute_advantage``,
   ``update_actor``; for OPD, verl's distillation loss with the teacher log-probs in the batch),
   so it is the oracle the streamed path is measured against.
2. The streamed path is the planners (``StreamPlanner``, ``OPDTurnPlanner``) driving the
   streaming worker as the trainer does: trajectories or scored turns arrive in a given order
   and are backpropagated in chunks while the rest are still arriving.
3. ``train`` resets the actor and records each step's dθ, so two paths compare from the same
   weights; ``relative_gap`` is the yardstick. Used by ``benchmarks/equivalence.py`` and the
   engine tests.
4. ``StreamingLearnerClient`` sends the planner's ops one blocking call at a time (the trainer
   queues them through ``stream_exec.OpPipeline``): the simplest driver, for tests and comparisons.
"""

from __future__ import annotations

import time

import torch

from thundersync_harness.engine_setup import GROUP_SIZE, Traj, TurnTraj
from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingInputError
from thundersync_verl.core.errors import rule_message
from thundersync_verl.step.chunk_layout import build_stream_chunk
from thundersync_verl.step.stream_plan import BackwardOp, FinalizeOp, FoldOp


# ----- the batch-synchronous path: verl's own functions --------------------------------------
def _verl_update(wg, data, n: int, calculate_entropy: bool = False, micro: int | None = None) -> dict:
    """verl's ``update_actor`` on a DataProto batch: one epoch, one mini-batch of ``n`` rows (micro-batches of
    ``micro`` rows when given, else the worker's configured size)."""
    import numpy as np

    td = va.to_no_padding(data.to_tensordict())
    va.assign_non_tensor(td, calculate_entropy=calculate_entropy, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=n, mini_batch_size=n, epochs=1, seed=42,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    if micro is not None:
        va.assign_non_tensor(td, micro_batch_size_per_gpu=int(micro))
    metrics = va.td_get(wg.update_actor(td), "metrics")
    return {"grad_norm": float(np.mean(metrics["grad_norm"]))}


def _old_log_probs(wg, data) -> torch.Tensor:
    td = va.to_no_padding(data.to_tensordict())
    va.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
    return va.unpad_response(va.td_get(wg.compute_log_prob(td), "log_probs"), td).float()  # [B, R]


def sync_step(wg, trajs: list[Traj], row_order: list[int], pad_token_id: int, advantage_scale: float = 1.0,
              micro: int | None = None) -> dict:
    """compute_log_prob -> compute_advantage (GRPO) -> update_actor, as verl's trainer does.

    ``advantage_scale`` (a diagnostic) multiplies every advantage: with the gradient norm above verl's clip
    the clipped step is mathematically unchanged, only verl's per-token loss scalars round differently."""
    data = rollout_batch(wg, trajs, row_order, pad_token_id)
    data = va.grpo_compute_advantage(data, adv_estimator="grpo")
    if advantage_scale != 1.0:
        data.batch["advantages"] = data.batch["advantages"] * advantage_scale
    return _verl_update(wg, data, len(row_order), micro=micro)


def rollout_batch(wg, trajs: list[Traj], row_order: list[int], pad_token_id: int):
    """The rows as verl's trainer holds them before its advantage: a DataProto with the outcome reward on each
    response's last token, the group uid, and the old log-probs from ``compute_log_prob``."""
    import numpy as np

    from thundersync_verl.step.chunk_layout import pad_batch

    rows = [trajs[i] for i in row_order]
    tensors = pad_batch([t.prompt for t in rows], [t.response for t in rows], pad_token_id)
    rewards = torch.zeros(tensors["response_mask"].shape, dtype=torch.float32)  # [B, R]
    for b, t in enumerate(rows):
        rewards[b, len(t.response) - 1] = t.reward
    data = va.data_proto_cls().from_dict(tensors={**tensors, "token_level_rewards": rewards},
                                         non_tensors={"uid": np.array([f"g{t.gid}" for t in rows], dtype=object)},
                                         meta_info={"temperature": 1.0})
    data.batch["old_log_probs"] = _old_log_probs(wg, data)
    return data


def traj_name(t: Traj) -> str:
    return f"{t.gid}:{t.tid}"  # trajectory ids unique across groups, as verl's are


def row_table(trajs: list[Traj]) -> dict:
    """``(gid, name) -> (prompt, response)``: where the learner clients read a planned row from."""
    return {(t.gid, traj_name(t)): (t.prompt, t.response) for t in trajs}


def drive_arrivals(planner, trajs: list[Traj], arrival: list[int], every: int, send) -> dict:
    """Trajectories arrive one by one in ``arrival`` order; every ``every`` arrivals (and after the last) the
    planner's ops go to ``send(ops)``. Returns the op counts by kind."""
    kinds = {"direct": 0, "bucket": 0, "fold": 0}
    for k, i in enumerate(arrival):
        t = trajs[i]
        planner.arrive(t.gid, traj_name(t), t.reward, len(t.response))
        if (k + 1) % every == 0 or k + 1 == len(arrival):
            ops = planner.next_ops()
            for op in ops:
                kinds["fold" if isinstance(op, FoldOp) else ("direct" if op.dest == "direct" else "bucket")] += 1
            send(ops)
    return kinds


def sync_opd_step(wg, trajs: list[TurnTraj], row_order: list[int], pad_token_id: int, teacher_rows: dict) -> dict:
    """verl's OPD update: teacher log-probs in the batch, old log-probs, ``update_actor`` (distillation loss).

    ``teacher_rows`` maps a trajectory to its teacher log-probs, one per response token.
    """
    import numpy as np

    from thundersync_verl.step.chunk_layout import pad_batch

    rows = [trajs[i] for i in row_order]
    tensors = pad_batch([t.prompt for t in rows], [t.response for t in rows], pad_token_id,
                        response_masks=[t.mask for t in rows])
    n, width = tensors["input_ids"].shape
    p_width = tensors["prompts"].shape[1]
    teacher = torch.zeros(n, width, 1, dtype=torch.float32)  # [B, S, 1]: position p holds log p(x_{p+1} | x_<=p)
    for b, t in enumerate(rows):
        teacher[b, p_width - 1 : p_width - 1 + len(t.response), 0] = torch.tensor(teacher_rows[t.tid])
    data = va.data_proto_cls().from_dict(
        tensors={**tensors, "teacher_logprobs": teacher,
                 "teacher_ids": tensors["input_ids"].unsqueeze(-1).to(torch.int32)},  # read for top-k modes only
        non_tensors={"uid": np.array([f"t{t.tid}" for t in rows], dtype=object)}, meta_info={"temperature": 1.0})
    old = _old_log_probs(wg, data)  # [B, R]
    data.batch["old_log_probs"] = old
    data.batch["advantages"] = torch.zeros_like(old)  # task-reward term: read by verl's ppo_loss, then dropped
    return _verl_update(wg, data, len(rows))


# ----- the streamed paths: planners + streaming worker ---------------------------------------
class StreamingLearnerClient:
    """Executes the planner's ops on a worker group of ``StreamingActorWorker``, in order.

    ``trajectories`` maps (group_id, traj_id) to (prompt_ids, response_ids[, response_mask]).
    Every call waits for its result: the worker is an asyncio actor whose plain methods may run
    concurrently, and a fold must never overtake the backward that fills its bucket.
    """

    def __init__(self, worker_group, *, pad_token_id: int, temperature: float = 1.0, dp_size: int | None = None):
        self.wg = worker_group
        self.pad_token_id = int(pad_token_id)
        self.temperature = float(temperature)
        self.dp_size = int(dp_size or va.actor_dp_size(worker_group))  # verl's split: TP/PP peers share a part

    def begin_batch(self, meta: dict) -> None:
        self.wg.stream_begin_batch(meta)

    def run(self, ops, trajectories) -> list:
        """Send ``ops`` (BackwardOp / FoldOp) in order; returns the backward results."""
        results = []
        for op in ops:
            if isinstance(op, BackwardOp):
                rows = [trajectories[item] for item in op.items]
                masks = [r[2] for r in rows] if all(len(r) > 2 for r in rows) else None
                chunk = build_stream_chunk([r[0] for r in rows], [r[1] for r in rows], op.coefs, op.dest,
                                           dp_size=self.dp_size, pad_token_id=self.pad_token_id,
                                           temperature=self.temperature, response_masks=masks)
                results.append(self.wg.stream_backward(chunk))
            elif isinstance(op, FoldOp):
                self.wg.stream_fold(op.folds)
            else:
                raise StreamingInputError(
                    rule_message(
                        f"unknown op {type(op).__name__}",
                        "the worker executes backward chunks and folds; the barrier is finalize()",
                        "pass the list returned by StreamPlanner.next_ops()",
                    )
                )
        return results

    def finalize(self, op: FinalizeOp) -> dict:
        """The barrier; returns rank 0's metrics (grad_norm, lr, bucket memory)."""
        return self.wg.finalize_step(op.scale)[0]

def stream_step(wg, trajs: list[Traj], arrival: list[int], pad_token_id: int, *, every: int = 2,
                max_chunk: int = 4, loss_agg_mode: str = "token-mean", pipeline: int | None = None,
                finished: list | None = None) -> dict:
    """Trajectories arrive one by one; every ``every`` arrivals the planner's ops are sent.

    ``pipeline``: send them through ``OpPipeline`` with that depth (queued calls) instead of one
    blocking call each; ``finished`` then receives ``(op, t_start, t_end)`` per op, in order.
    """
    from thundersync_verl.step.stream_exec import OpPipeline
    from thundersync_verl.step.stream_plan import StreamPlanner

    planner = StreamPlanner(adv_estimator="grpo", loss_agg_mode=loss_agg_mode, max_chunk_size=max_chunk)
    client = StreamingLearnerClient(wg, pad_token_id=pad_token_id)
    groups = sorted({t.gid for t in trajs})
    planner.begin_batch({g: GROUP_SIZE for g in groups})
    client.begin_batch({"loss_agg_mode": loss_agg_mode, "train_batch_size": len(groups), "adv_estimator": "grpo"})
    table = row_table(trajs)
    rows = {traj_name(t): {"prompt": t.prompt, "response": t.response, "mask": [1] * len(t.response)} for t in trajs}
    if pipeline is None:
        kinds = drive_arrivals(planner, trajs, arrival, every, lambda ops: client.run(ops, table))
    else:
        done = finished if finished is not None else []
        pipe = OpPipeline(wg, pad_token_id=pad_token_id, temperature=1.0, depth=pipeline,
                          on_done=lambda op, stats, t0, t1: done.append((op, t0, t1)))
        kinds = drive_arrivals(planner, trajs, arrival, every, lambda ops: [pipe.submit(op, rows) for op in ops])
        pipe.drain()
    metrics = client.finalize(planner.finalize())
    return {**metrics, **{f"ops/{k}": v for k, v in kinds.items()}}


def stream_opd_step(wg, trajs: list[TurnTraj], turns: dict, arrival: list[tuple[int, int]], pad_token_id: int, *,
                    every: int = 3, max_chunk: int = 4) -> dict:
    """Scored turns arrive in ``arrival`` order; every ``every`` arrivals the ready turns are backpropagated."""
    from thundersync_verl.algos.opd.opd_stream import OPDStreamClient, OPDTurnPlanner

    planner = OPDTurnPlanner(loss_agg_mode="token-mean", max_chunk_size=max_chunk)
    client = OPDStreamClient(wg, pad_token_id=pad_token_id)
    planner.begin_batch([t.tid for t in trajs])
    client.begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": len(trajs) // GROUP_SIZE})
    chunks = 0
    for k, (tid, j) in enumerate(arrival):
        planner.add_turn(turns[tid][j])
        if j == len(turns[tid]) - 1:
            planner.end_trajectory(tid, len(turns[tid]))  # may come before its earlier turns
        if (k + 1) % every == 0 or k + 1 == len(arrival):
            ops = planner.next_ops()
            chunks += len(ops)
            client.run(ops)
    metrics = client.finalize(planner.finalize())
    return {**metrics, "ops/turn_chunks": chunks, "turns": len(arrival)}


# ----- comparison ----------------------------------------------------------------------------
def train(wg, steps, reset: str = "reset_actor") -> tuple[list[torch.Tensor], list[dict]]:
    """Reset the model (``reset``: the actor's ``reset_actor``, the critic's ``reset``), run each step function
    (one optimizer step each), return each dθ and info."""
    getattr(wg, reset)()
    theta = wg.gather_flat_params()[0]
    deltas, infos = [], []
    for step in steps:
        t0 = time.perf_counter()
        info = step()
        info["seconds"] = time.perf_counter() - t0
        new = wg.gather_flat_params()[0]
        deltas.append(new - theta)
        infos.append(info)
        theta = new
    return deltas, infos


def gap_rows(out: dict, **figures) -> list[dict]:
    """Per step of ``out`` (``train`` results of sync_a, sync_b (verl regrouped) and stream): the stream's gap to
    verl, the floor, gap/floor, update and grad norms, seconds; ``figures``: name -> the stream info's key."""
    (da, info_a), (db, _), (ds, info_s) = out["sync_a"], out["sync_b"], out["stream"]
    rows = []
    for a, b, s, ia, is_ in zip(da, db, ds, info_a, info_s):
        gap, floor = relative_gap(s, a), relative_gap(b, a)
        rows.append({"gap": gap, "floor": floor, "gap_over_floor": gap / floor if floor > 0 else float("inf"),
                     "update_norm": float(a.norm()), "grad_norm_sync": ia["grad_norm"],
                     "grad_norm_stream": is_["grad_norm"], **{k: is_[v] for k, v in figures.items()},
                     "seconds_stream": is_["seconds"], "seconds_sync": ia["seconds"]})
    return rows


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())
