"""One optimizer step on the engine, two ways: verl's batch-synchronous update and the streamed one.

Why:
1. Every feature (GRPO, another advantage estimator, the KL loss and entropy bonus, several
   mini-batches, OPD, SAO) is compared the same way, so the comparison is written once: a feature
   is a ``StepSpec`` (what its verl batch carries, which update settings, how its stream is fed) and
   ``sync_step`` / ``stream_step`` run any spec. Adding a feature means writing its spec. The critic
   (``critic_steps``) is not one: verl trains it through ``infer_batch`` / ``train_mini_batch``, and its
   stream values the arrivals on the way and may send its backwards without waiting.
2. The synchronous path is verl's OWN functions (``compute_log_prob``, ``compute_advantage``,
   ``update_actor``; the spec adds the reference log-probs, teacher log-probs, SAO's values), so it
   is the oracle the streamed path is measured against.
3. The streamed path is the spec's planner driving the streaming worker as the trainer does:
   trajectories (or scored turns) arrive in a given order and are backpropagated in chunks, every
   ``every`` arrivals, while the rest are still arriving; one barrier at the end. ``pipeline`` sends the
   ops through the trainer's ``OpPipeline`` (queued calls) instead of one blocking call each.
4. ``StreamingLearnerClient`` sends the planner's ops one blocking call at a time (the trainer
   queues them through ``stream_exec.OpPipeline``): the simplest driver, for tests and comparisons.
   With a reference group it scores each chunk just before its backward (verl's KL loss).
5. ``train`` resets the model and records each step's dθ, so two paths compare from the same
   weights; ``relative_gap`` is the yardstick, ``gap_rows`` the per-step table of the benchmarks. Where the
   learner records it (FSDP2 and Megatron), each step's info also carries ``applied``: the clipped gradient the optimizer
   step applied, the update before fp32 parameter storage rounds it (``learner/engines/fsdp.py`` point 5), and
   ``params``: the parameters after the step (``benchmarks/equivalence_storage.py``).
   The GRPO-family spec (``PolicySpec``) and OPD's (``OPDSpec``) live here; the others in their modules.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch

from thundersync_harness.engine_setup import GROUP_SIZE, Traj, TurnTraj
from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingInputError
from thundersync_verl.core.errors import rule_message
from thundersync_verl.step.chunk_layout import attach_ref_log_probs, build_stream_chunk, pad_batch
from thundersync_verl.step.stream_plan import BackwardOp, FinalizeOp, FoldOp


# ----- the generic step ----------------------------------------------------------------------
class StepSpec:
    """One feature of the comparison. Sync side: ``verl_batch`` (the DataProto verl's trainer hands
    ``update_actor``: old log-probs and advantages in it), ``entropy``, ``epochs``, ``mini_rows``.
    Stream side: ``feed`` (the step's planner and client, begun), ``every`` and ``max_chunk`` defaults."""

    entropy, epochs, every, max_chunk = False, 1, 2, 4

    def verl_batch(self, wg, trajs: list, row_order: list[int], pad_token_id: int):
        raise NotImplementedError

    def mini_rows(self, n_rows: int) -> int:
        return n_rows  # one mini-batch

    def feed(self, wg, trajs: list, pad_token_id: int, max_chunk: int) -> Feed:
        raise NotImplementedError


class Feed:
    """One streamed step of a spec: ``arrive`` one item, ``send`` the planner's ops (blocking), ``barrier``
    (fold ops to send, then the ``FinalizeOp``), ``figures`` (the spec's own info keys)."""

    kinds: tuple = ("direct", "bucket", "fold")  # op counts reported as ``ops/<kind>`` even when zero
    rows: dict = {}  # what ``OpPipeline.submit`` reads the ops' rows from (ops that carry their rows: none)

    def __init__(self, planner, client):
        self.planner, self.client = planner, client

    def arrive(self, item) -> None:
        raise NotImplementedError

    def send(self, ops) -> None:
        self.client.run(ops)

    def barrier(self) -> tuple[list, FinalizeOp]:
        return [], self.planner.finalize()

    def figures(self, final: FinalizeOp) -> dict:
        return {}


def sync_step(wg, trajs: list, row_order: list[int], pad_token_id: int, spec: StepSpec | None = None, *,
              micro: int | None = None, max_token_len: int | None = None) -> dict:
    """verl's trainer on the rows in ``row_order``: the spec's batch (old log-probs, advantages), then
    ``update_actor`` (micro-batches of ``micro`` rows when given, else the worker's configured size; with
    ``use_dynamic_bsz``, ``max_token_len`` replaces the configured token budget of the update's micro-batches)."""
    spec = spec or PolicySpec()
    data = spec.verl_batch(wg, trajs, row_order, pad_token_id)
    return verl_update(wg, data, spec.mini_rows(len(row_order)), epochs=spec.epochs, calculate_entropy=spec.entropy,
                       micro=micro, max_token_len=max_token_len)


def stream_step(wg, trajs: list, arrival: list, pad_token_id: int, spec: StepSpec | None = None, *,
                every: int | None = None, max_chunk: int | None = None, pipeline: int | None = None,
                finished: list | None = None) -> dict:
    """Items arrive one by one in ``arrival`` order; every ``every`` arrivals (and after the last) the planner's
    ops are sent, then the barrier. ``pipeline``: through ``OpPipeline`` with that depth; ``finished`` then
    receives ``(op, t_start, t_end)`` per op, in order. Returns rank 0's metrics, ``ops/<kind>`` and the spec's."""
    from thundersync_verl.step.stream_exec import OpPipeline

    spec = spec or PolicySpec()
    every = every or spec.every
    feed = spec.feed(wg, trajs, pad_token_id, max_chunk or spec.max_chunk)
    pipe, done = None, finished if finished is not None else []
    if pipeline is not None:
        pipe = OpPipeline(wg, pad_token_id=pad_token_id, temperature=1.0, depth=pipeline,
                          on_done=lambda op, stats, t0, t1: done.append((op, t0, t1)))
    kinds = Counter(dict.fromkeys(feed.kinds, 0))
    for k, item in enumerate(arrival):
        feed.arrive(item)
        if (k + 1) % every == 0 or k + 1 == len(arrival):
            ops = feed.planner.next_ops()
            kinds.update(count_key(op) for op in ops)
            if pipe is None:
                feed.send(ops)
            else:
                for op in ops:
                    pipe.submit(op, feed.rows)
    closing, final = feed.barrier()
    for op in closing:
        if pipe is not None:
            pipe.submit(op, feed.rows)
        elif op.folds:
            wg.stream_fold(op.folds)
    if pipe is not None:
        pipe.drain()
    metrics = wg.finalize_step(final.scale)[0]  # the barrier; rank 0's metrics (grad_norm, lr, bucket memory)
    return {**metrics, **{f"ops/{k}": v for k, v in kinds.items()}, **feed.figures(final)}


def count_key(op) -> str:
    """The ``ops/<key>`` an op is counted under."""
    from thundersync_verl.algos.opd.opd_stream import TurnBackwardOp
    from thundersync_verl.algos.sao.sao_streaming import SAOBackwardOp
    from thundersync_verl.step.minibatch_plan import PPOBackwardOp, StepOp

    for cls, key in ((StepOp, "steps"), (PPOBackwardOp, "ppo"), (TurnBackwardOp, "turn_chunks"),
                     (SAOBackwardOp, "chunks"), (FoldOp, "fold")):
        if isinstance(op, cls):
            return key
    return "direct" if op.dest == "direct" else "bucket"


# ----- verl's side ---------------------------------------------------------------------------
def verl_update(wg, data, mini_rows: int, *, epochs: int = 1, calculate_entropy: bool = False,
                micro: int | None = None, max_token_len: int | None = None) -> dict:
    """verl's ``update_actor`` on a DataProto batch: mini-batches of ``mini_rows`` rows for ``epochs`` epochs,
    no shuffle (micro-batches of ``micro`` rows, or a token budget of ``max_token_len``, when given, else the
    worker's configured ones; ``micro`` switches a configured token budget off for this call)."""
    import numpy as np

    td = va.to_no_padding(data.to_tensordict())
    va.assign_non_tensor(td, calculate_entropy=calculate_entropy, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=mini_rows, mini_batch_size=mini_rows, epochs=epochs, seed=42,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    if micro is not None:  # fixed micro-batches of that size, also where the worker cuts by a token budget
        va.assign_non_tensor(td, micro_batch_size_per_gpu=int(micro), use_dynamic_bsz=False)
    if max_token_len is not None:
        va.assign_non_tensor(td, max_token_len_per_gpu=int(max_token_len))
    metrics = va.td_get(wg.update_actor(td), "metrics")
    return {"grad_norm": float(np.mean(metrics["grad_norm"]))}


def old_log_probs(wg, data) -> torch.Tensor:
    """verl's ``compute_log_prob`` of a DataProto batch at the current weights, [B, R]."""
    td = va.to_no_padding(data.to_tensordict())
    va.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
    return va.unpad_response(va.td_get(wg.compute_log_prob(td), "log_probs"), td).float()  # [B, R]


def rollout_batch(wg, trajs: list[Traj], row_order: list[int], pad_token_id: int):
    """The rows as verl's trainer holds them before its advantage: a DataProto with the outcome reward on each
    response's last token, the group uid, and the old log-probs from ``compute_log_prob``."""
    import numpy as np

    rows = [trajs[i] for i in row_order]
    tensors = pad_batch([t.prompt for t in rows], [t.response for t in rows], pad_token_id)
    rewards = torch.zeros(tensors["response_mask"].shape, dtype=torch.float32)  # [B, R]
    for b, t in enumerate(rows):
        rewards[b, len(t.response) - 1] = t.reward
    data = va.data_proto_cls().from_dict(tensors={**tensors, "token_level_rewards": rewards},
                                         non_tensors={"uid": np.array([f"g{t.gid}" for t in rows], dtype=object)},
                                         meta_info={"temperature": 1.0})
    data.batch["old_log_probs"] = old_log_probs(wg, data)
    return data


def attach_ref_rows(ref_wg, data) -> None:
    """verl's ``_compute_ref_log_prob`` on a whole padded batch: ``data.batch["ref_log_prob"]`` [B, R]."""
    ref_td = va.to_no_padding(data.to_tensordict())
    va.assign_non_tensor(ref_td, calculate_entropy=False, compute_loss=False)
    data.batch["ref_log_prob"] = va.unpad_response(va.td_get(ref_wg.compute_ref_log_prob(ref_td), "log_probs"),
                                                   ref_td).float()  # [B, R]


# ----- GRPO and its relatives: PolicySpec ----------------------------------------------------
class TrajFeed(Feed):
    """Whole trajectories arrive (their outcome reward known); the client reads a planned row from ``table``."""

    def __init__(self, planner, client, trajs: list[Traj], meta: dict):
        super().__init__(planner, client)
        self.trajs, self.table = trajs, row_table(trajs)
        self.rows = {traj_name(t): {"prompt": t.prompt, "response": t.response, "mask": [1] * len(t.response)}
                     for t in trajs}
        planner.begin_batch({g: GROUP_SIZE for g in sorted({t.gid for t in trajs})})
        client.begin_batch(meta)

    def arrive(self, i: int) -> None:
        t = self.trajs[i]
        self.planner.arrive(t.gid, traj_name(t), t.reward, len(t.response))

    def send(self, ops) -> None:
        self.client.run(ops, self.table)

    def figures(self, final: FinalizeOp) -> dict:
        return {"barrier_scale": final.scale, "ref_calls": self.client.ref_calls}


@dataclass(frozen=True)
class PolicySpec(StepSpec):
    """verl's outcome-reward policy update on trajectory rows: ``adv_estimator`` (GRPO by default), verl's KL
    loss with the reference group ``ref_wg`` and the entropy bonus (``calculate_entropy`` on verl's side; the
    worker's config holds the coefficients). ``advantage_scale`` (a diagnostic) multiplies verl's advantages:
    with the gradient norm above verl's clip the clipped step is unchanged, only the rounding moves."""

    adv_estimator: str = "grpo"
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    ref_wg: object = None
    entropy: bool = False
    advantage_scale: float = 1.0
    feed_class = TrajFeed  # the stream's feed (not a field; a diagnostic may change what it sends)

    def verl_batch(self, wg, trajs, row_order, pad_token_id):
        """compute_log_prob (-> compute_ref_log_prob) -> compute_advantage, as verl's trainer does."""
        data = rollout_batch(wg, trajs, row_order, pad_token_id)
        if self.ref_wg is not None:
            attach_ref_rows(self.ref_wg, data)
        data = self.advantages(data)
        if self.advantage_scale != 1.0:
            data.batch["advantages"] = data.batch["advantages"] * self.advantage_scale
        return data

    def advantages(self, data):
        return va.grpo_compute_advantage(data, adv_estimator=self.adv_estimator)

    def planner(self, max_chunk: int):
        from thundersync_verl.step.stream_plan import StreamPlanner

        return StreamPlanner(adv_estimator=self.adv_estimator, loss_agg_mode=self.loss_agg_mode,
                             loss_scale_factor=self.loss_scale_factor, max_chunk_size=max_chunk)

    def meta(self, groups: int) -> dict:
        return {"loss_agg_mode": self.loss_agg_mode, "train_batch_size": groups, "adv_estimator": self.adv_estimator}

    def feed(self, wg, trajs, pad_token_id, max_chunk):
        planner = self.planner(max_chunk)
        return self.feed_class(planner, StreamingLearnerClient(wg, pad_token_id=pad_token_id, ref_group=self.ref_wg),
                               trajs, self.meta(len({t.gid for t in trajs})))


def traj_name(t: Traj) -> str:
    return f"{t.gid}:{t.tid}"  # trajectory ids unique across groups, as verl's are


def row_table(trajs: list[Traj]) -> dict:
    """``(gid, name) -> (prompt, response)``: where the learner clients read a planned row from."""
    return {(t.gid, traj_name(t)): (t.prompt, t.response) for t in trajs}


class StreamingLearnerClient:
    """Executes the planner's ops on a worker group of ``StreamingActorWorker``, in order.

    ``trajectories`` maps (group_id, traj_id) to (prompt_ids, response_ids[, response_mask]).
    Every call waits for its result: the worker is an asyncio actor whose plain methods may run
    concurrently, and a fold must never overtake the backward that fills its bucket. With
    ``ref_group`` every chunk's reference log-probs are computed just before its backward.
    """

    def __init__(self, worker_group, *, pad_token_id: int, temperature: float = 1.0, dp_size: int | None = None,
                 ref_group=None, row_log_probs: dict | None = None):
        self.wg, self.ref_wg, self.ref_calls = worker_group, ref_group, 0
        self.row_log_probs = row_log_probs  # (gid, traj_id) -> the rollout engine's log-probs, sent with each row
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
                lps = None if self.row_log_probs is None else [self.row_log_probs[item] for item in op.items]
                chunk = build_stream_chunk([r[0] for r in rows], [r[1] for r in rows], op.coefs, op.dest,
                                           dp_size=self.dp_size, pad_token_id=self.pad_token_id,
                                           temperature=self.temperature, response_masks=masks, rollout_log_probs=lps)
                self.attach_ref(chunk)
                results.append(self.wg.stream_backward(chunk))
            elif isinstance(op, FoldOp):
                self.wg.stream_fold(op.folds)
            else:
                raise StreamingInputError(rule_message(
                    f"unknown op {type(op).__name__}", "the worker executes backward chunks and folds; the barrier "
                    "is the step's finalize_step", "pass the list returned by StreamPlanner.next_ops()"))
        return results

    def attach_ref(self, chunk) -> None:
        """The chunk's reference log-probs, just before its backward (none without a reference group)."""
        if self.ref_wg is not None:
            attach_ref_log_probs(chunk, self.ref_wg, dp_size=self.dp_size)
            self.ref_calls += 1


# ----- OPD: teacher log-probs per scored turn ------------------------------------------------
@dataclass(frozen=True)
class OPDSpec(StepSpec):
    """verl's OPD update: ``teacher_rows`` (a trajectory's teacher log-probs, one per response token) ride in
    verl's batch. ``loss`` (``opd_config.OPDLoss``, None: the project's k1 policy gradient) is the distillation
    term; with ``loss.use_task_rewards`` verl's batch carries GRPO advantages of the trajectories' rewards and the
    stream feeds landed trajectories too (``thundersync_harness.opd_steps``), else the task advantages are zero.
    Streamed: the scored ``turns`` arrive as ``(tid, j)`` (a landing as ``(tid, None)``) and every ``every`` (3)
    arrivals the ready ops are sent."""

    teacher_rows: dict | None = None
    turns: dict | None = None
    every: int = 3
    loss: object = None

    @property
    def task_rewards(self) -> bool:
        return self.loss is not None and self.loss.use_task_rewards

    def verl_batch(self, wg, trajs: list[TurnTraj], row_order, pad_token_id):
        import numpy as np

        rows = [trajs[i] for i in row_order]
        tensors = pad_batch([t.prompt for t in rows], [t.response for t in rows], pad_token_id,
                            response_masks=[t.mask for t in rows])
        n, width = tensors["input_ids"].shape
        p_width = tensors["prompts"].shape[1]
        teacher = torch.zeros(n, width, 1, dtype=torch.float32)  # [B, S, 1]: position p holds log p(x_{p+1} | x_<=p)
        for b, t in enumerate(rows):
            teacher[b, p_width - 1 : p_width - 1 + len(t.response), 0] = torch.tensor(self.teacher_rows[t.tid])
        rewards = torch.zeros(tensors["response_mask"].shape, dtype=torch.float32)  # [B, R]: the reward on the last token
        for b, t in enumerate(rows):
            rewards[b, len(t.response) - 1] = t.reward
        data = va.data_proto_cls().from_dict(
            tensors={**tensors, "teacher_logprobs": teacher, "token_level_rewards": rewards,
                     "teacher_ids": tensors["input_ids"].unsqueeze(-1).to(torch.int32)},  # read for top-k modes only
            non_tensors={"uid": np.array([f"g{t.tid // GROUP_SIZE}" for t in rows], dtype=object)},
            meta_info={"temperature": 1.0})
        old = old_log_probs(wg, data)  # [B, R]
        data.batch["old_log_probs"] = old
        if self.task_rewards:  # verl's trainer: compute_advantage (GRPO) on the task rewards
            return va.grpo_compute_advantage(data, adv_estimator="grpo")
        data.batch["advantages"] = torch.zeros_like(old)  # task-reward term: read by verl's ppo_loss, then dropped
        return data

    def feed(self, wg, trajs, pad_token_id, max_chunk):
        from thundersync_verl.algos.opd.opd_stream import OPDStreamClient, OPDTurnPlanner

        if self.task_rewards:
            from thundersync_harness.opd_steps import task_feed

            return task_feed(self, wg, trajs, pad_token_id, max_chunk)
        planner = OPDTurnPlanner(loss_agg_mode="token-mean", max_chunk_size=max_chunk, loss=self.loss)
        client = OPDStreamClient(wg, pad_token_id=pad_token_id)
        planner.begin_batch([t.tid for t in trajs])
        client.begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": len(trajs) // GROUP_SIZE})
        return TurnFeed(planner, client, self.turns)


class TurnFeed(Feed):
    kinds = ("turn_chunks",)

    def __init__(self, planner, client, turns: dict):
        super().__init__(planner, client)
        self.turns, self.count = turns, 0

    def arrive(self, item: tuple[int, int | None]) -> None:
        tid, j = item
        if j is None:  # a trajectory landed: its reward has no term without task rewards
            return
        self.planner.add_turn(self.turns[tid][j])
        if j == len(self.turns[tid]) - 1:
            self.planner.end_trajectory(tid, len(self.turns[tid]))  # may come before its earlier turns
        self.count += 1

    def figures(self, final: FinalizeOp) -> dict:
        return {"turns": self.count}


# ----- comparison ----------------------------------------------------------------------------
def train(wg, steps, reset: str = "reset_actor") -> tuple[list[torch.Tensor], list[dict]]:
    """Reset the model (``reset``: the actor's ``reset_actor``, the critic's ``reset``), run each step function
    (one optimizer step each), return each dθ and info."""
    getattr(wg, reset)()
    theta = wg.gather_flat_params()[0]
    record = hasattr(wg, "gather_applied_gradient")
    if record:
        wg.gather_applied_gradient()  # arms the recording (point 5)
    deltas, infos = [], []
    for step in steps:
        t0 = time.perf_counter()
        info = step()
        info["seconds"] = time.perf_counter() - t0
        applied = wg.gather_applied_gradient()[0] if record else None
        if applied is not None:
            info["applied"] = applied
        new = wg.gather_flat_params()[0]
        info["params"] = new  # the parameters after the step (equivalence_storage.py)
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
