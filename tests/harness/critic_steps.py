"""One critic step on verl's FSDP2 critic engine, two ways: verl's ``train_mini_batch`` (value loss) and the streamed one.

Why:
1. The critic worker group is built as verl's V1 trainer builds it (``verl_adapter.critic_worker_group``:
   ``TrainingWorkerConfig(model_type="value_model")``, ``reset``, ``set_loss_fn(partial(value_loss, ...))``),
   running ``StreamingCriticWorker``, so verl's own ``train_mini_batch`` on the same group is the oracle.
2. The value model is the tiny Qwen2 with a seeded value head (``models/value_model.write_value_model``; verl
   loads it as ``AutoModelForTokenClassification`` with num_labels=1): every ``reset`` starts from the same weights.
3. Each step values its batch at the step-start weights with verl's ``infer_batch`` (as ``_compute_values``:
   once for the whole batch on the synchronous path, per arrival group on the streamed one), the targets are
   the Monte-Carlo returns over agent tokens (``core/sao_stream.trajectory_gae``, the ``sao`` estimator's),
   multi-turn trajectories with masked observation tokens arrive in a random order, every ``every`` arrivals
   their chunks run, and the barrier steps with 1/N.
4. ``run_critic_equivalence`` gives per step the gap ||d_stream - d_verl|| / ||d_verl|| and the noise floor
   (verl's own update with the rows regrouped into other micro-batches), as ``sao_steps.py`` does for the actor.
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import torch

from thundersync_harness.engine_setup import GROUP_SIZE, TurnTraj, make_turn_trajectories
from thundersync_harness.engine_steps import gap_rows, relative_gap, train
from thundersync_harness.sao_steps import GAMMA, LAM, regrouped
from thundersync_verl import verl_adapter as va
from thundersync_verl.core.sao_stream import trajectory_gae
from thundersync_verl.algos.sao.critic_stream import LATER_EPOCHS_KEY, CriticRow, CriticStreamClient, CriticStreamPlanner
from thundersync_verl.algos.sao.critic_worker import StreamingCriticWorker
from thundersync_verl.step.chunk_layout import pad_batch

CRITIC_LR = 0.05


def critic_config(value_path: Path, *, groups: int, micro: int, epochs: int = 1, lr: float = CRITIC_LR,
                  clip_grad: float = 1e9, loss_agg_mode: str = "token-mean"):
    """verl's ppo_trainer.yaml with the critic on the CPU: fp32, SGD, one mini-batch per batch, no clipping
    by default (a clipped step lr g/||g|| would hide a wrong normaliser)."""
    critic, fsdp = "critic", "critic.fsdp"
    overrides = [
        f"actor_rollout_ref.model.path={value_path}", f"actor_rollout_ref.rollout.n={GROUP_SIZE}",
        f"data.train_batch_size={groups}", "critic.enable=true", f"{critic}.strategy=fsdp2",
        f"{critic}.model.path={value_path}", f"{critic}.model.use_remove_padding=false",
        f"+{critic}.model.override_config.attn_implementation=sdpa",
        f"{critic}.ppo_mini_batch_size={groups}", f"{critic}.ppo_micro_batch_size_per_gpu={micro}",
        f"{critic}.ppo_epochs={epochs}", f"{critic}.shuffle=false", f"{critic}.loss_agg_mode={loss_agg_mode}",
        f"{critic}.optim.optimizer=SGD", f"{critic}.optim.lr={lr}", f"{critic}.optim.weight_decay=0.0",
        f"{critic}.optim.clip_grad={clip_grad}", f"{critic}.grad_clip={clip_grad}",
        f"{fsdp}.model_dtype=fp32", f"{fsdp}.use_torch_compile=false",
        *(f"+{fsdp}.mixed_precision.{k}=fp32" for k in ("param_dtype", "reduce_dtype", "buffer_dtype")),
    ]
    return va.compose_ppo_config(overrides)


def start_critic(config, dp: int = 1):
    """ray.init with ``dp`` logical device slots, then verl's critic worker group of ``StreamingCriticWorker``."""
    from thundersync_harness.engine_setup import start_ray

    start_ray(dp)
    wg, _ = va.critic_worker_group(StreamingCriticWorker, config, n_workers=dp)
    return wg


def bind_critic_config(wg, config) -> None:
    """Bind verl's value loss with ``config.critic`` into the group (what the worker's streaming checks read),
    as verl's trainer does at start-up; e.g. a config with another ``critic.ppo_epochs`` on the same weights."""
    wg.set_loss_fn(va.value_loss_fn(va.critic_config_of(config)))


def make_critic_batch(seed: int, groups: int, vocab: int) -> dict:
    """Multi-turn trajectories, a 0/1 reward on each last agent token, MC returns, a random arrival order."""
    trajs = make_turn_trajectories(seed, groups, vocab)
    rng = random.Random(seed)
    returns = {}
    for t in trajs:
        r = [0.0] * len(t.response)
        r[max(i for i, m in enumerate(t.mask) if m)] = float(rng.random() < 0.5)
        _, ret = trajectory_gae(r, [0.0] * len(r), t.mask, gamma=GAMMA, lam=LAM)  # MC returns: value-free
        returns[t.tid] = ret.tolist()
    arrival = list(range(len(trajs)))
    rng.shuffle(arrival)
    return {"trajs": trajs, "returns": returns, "arrival": arrival}


def _padded(rows: list[TurnTraj], pad_token_id: int, dp: int = 1):
    """verl's left/right padded TensorDict of ``rows`` (repeated to a multiple of ``dp``); the number of real rows."""
    from tensordict import TensorDict

    n = len(rows)
    rows = rows + [rows[-1]] * ((-n) % dp)
    tensors = pad_batch([t.prompt for t in rows], [t.response for t in rows], pad_token_id,
                        response_masks=[t.mask for t in rows])
    return TensorDict(tensors, batch_size=[len(rows)]), n


def critic_values(wg, rows: list[TurnTraj], pad_token_id: int, dp: int = 1) -> list[list[float]]:
    """The critic's values of ``rows`` at its current weights, as verl's ``_compute_values`` (infer_batch, no loss)."""
    td, n = _padded(rows, pad_token_id, dp)
    td = va.to_no_padding(td)
    va.assign_non_tensor(td, compute_loss=False, temperature=1.0)
    values = va.unpad_response(va.td_get(_result(wg.infer_batch(td)), "values"), td).float()  # [B, R]
    return [values[b, : len(t.response)].tolist() for b, t in enumerate(rows[:n])]


def _result(output):
    """A non-blocking worker-group call's collected result (verl's ``DataProtoFuture.get``, as its trainer reads it)."""
    return output.get() if hasattr(output, "get") and callable(output.get) and not hasattr(output, "keys") else output


def sync_critic_step(wg, batch: dict, row_order: list[int], pad_token_id: int, *, epochs: int = 1,
                     dp: int = 1, values: dict | None = None) -> dict:
    """verl: ``infer_batch`` values -> ``train_mini_batch`` with verl's value loss, one mini-batch, ``epochs``."""
    rows = [batch["trajs"][i] for i in row_order]
    if values is None:
        values = dict(zip([t.tid for t in rows], critic_values(wg, rows, pad_token_id, dp)))
    return _verl_critic_update(wg, rows, batch, values, pad_token_id, epochs=epochs, dp=dp)


def _verl_critic_update(wg, rows, batch, values: dict, pad_token_id: int, *, epochs: int, dp: int) -> dict:
    import numpy as np

    td, n = _padded(rows, pad_token_id, dp)
    assert n == len(rows) and td.batch_size[0] == n, "verl's batch must split evenly over data-parallel ranks"
    width = td["responses"].shape[1]
    for key, table in (("values", values), ("returns", batch["returns"])):
        out = torch.zeros(n, width, dtype=torch.float32)  # [B, R]
        for b, t in enumerate(rows):
            out[b, : len(t.response)] = torch.tensor(table[t.tid], dtype=torch.float32)
        td[key] = out
    td = va.to_no_padding(td)
    va.assign_non_tensor(td, global_batch_size=n, mini_batch_size=n, epochs=int(epochs), seed=42,
                         dataloader_kwargs={"shuffle": False}, temperature=1.0)
    metrics = va.td_get(_result(wg.train_mini_batch(td)), "metrics")
    return {"grad_norm": float(np.mean(metrics["grad_norm"])), "values": values}


def stream_critic_step(wg, batch: dict, pad_token_id: int, *, train_batch_size: int, every: int = 2,
                       max_chunk: int = 3, dp: int = 1, scale_factor: float = 1.0, later_epochs: int = 0,
                       wait: bool = True) -> dict:
    """Trajectories arrive in ``batch["arrival"]`` order, valued on arrival (every ``every``); their chunks run.

    ``scale_factor`` multiplies the barrier scale (1: verl's 1/N; the control leaves the normaliser off).
    ``later_epochs``: verl's ``train_mini_batch`` runs that many more epochs on the batch after the barrier.
    ``wait=False``: the backwards are sent without waiting (``stream_token_backward_nowait``).
    """
    trajs = batch["trajs"]
    planner = CriticStreamPlanner(max_chunk_size=max_chunk)
    client = CriticStreamClient(wg, pad_token_id=pad_token_id, dp_size=dp)
    planner.begin_batch([t.tid for t in trajs])
    client.begin_batch({"train_batch_size": train_batch_size, LATER_EPOCHS_KEY: later_epochs})
    values, pending, results = {}, [], []
    for k, i in enumerate(batch["arrival"]):
        pending.append(trajs[i])
        if (k + 1) % every == 0 or k + 1 == len(trajs):
            for t, v in zip(pending, critic_values(wg, pending, pad_token_id, dp)):  # at the step-start weights
                values[t.tid] = v
                planner.arrive(CriticRow(t.tid, t.prompt, t.response, t.mask, v, batch["returns"][t.tid]))
            pending = []
            results += client.run(planner.next_chunks(), wait=wait)
    if not wait:
        results = client.wait()
    scale = planner.finalize()
    metrics = client.finalize(scale * scale_factor)
    if later_epochs:
        ordered = sorted(trajs, key=lambda t: t.tid)
        _verl_critic_update(wg, ordered, batch, values, pad_token_id, epochs=later_epochs, dp=dp)
    drift = max(float(r["ts_value_drift_max"].max()) for r in results)
    return {**metrics, "chunks": len(results), "barrier_scale": scale, "drift": drift, "values": values}


def train_critic(wg, steps) -> tuple[list[torch.Tensor], list[dict]]:
    """``engine_steps.train`` for the critic (its reset: verl's ``reset``, weights from the checkpoint)."""
    return train(wg, steps, reset="reset")


def run_critic_equivalence(wg, pad_id: int, vocab: int, *, groups: int = 2, micro: int = 4, steps: int = 2,
                           seed: int = 0, dp: int = 1) -> dict:
    """verl (rows in order), verl regrouped (the noise floor) and the stream, ``steps`` steps each; per step
    gap, floor, gap/floor, and the control (the stream with the normaliser left off)."""
    batches = [make_critic_batch(700 + 100 * seed + s, groups, vocab) for s in range(steps)]
    n_rows = len(batches[0]["trajs"])
    runs = {
        "sync_a": [partial(sync_critic_step, wg, b, list(range(n_rows)), pad_id, dp=dp) for b in batches],
        "sync_b": [partial(sync_critic_step, wg, b, regrouped(n_rows, micro), pad_id, dp=dp) for b in batches],
        "stream": [partial(stream_critic_step, wg, b, pad_id, train_batch_size=groups, dp=dp) for b in batches],
        "control": [partial(stream_critic_step, wg, b, pad_id, train_batch_size=groups, dp=dp,
                            scale_factor=float(sum(sum(t.mask) for t in b["trajs"]))) for b in batches[:1]],
    }
    out = {kind: train_critic(wg, fns) for kind, fns in runs.items()}
    control = relative_gap(out["control"][0][0], out["sync_a"][0][0])
    return {"steps": gap_rows(out, chunks="chunks", drift="drift"), "rows": n_rows, "control_gap": control}
