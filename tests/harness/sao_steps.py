"""One SAO actor step on the engine, two ways: verl's ``update_actor`` (loss ``sao``) and the streamed one.

Why:
1. The synchronous path is verl's: the batch laid out as verl's trainer holds it (token-level rewards on
   the last agent token, the critic's values, the rollout log-probs as ``old_log_probs``: verl's bypass
   mode), advantages from the registered ``sao`` estimator (whitened GAE over agent tokens), then verl's
   ``update_actor`` whose policy loss is the registered ``sao`` loss (worker config ``loss_mode=sao``).
2. The streamed path is ``algos/sao/sao_streaming.py``: single-rollout trajectories arrive one by one in a
   random order; every ``every`` arrivals their chunks (direct + whitening bucket) run on the streaming
   worker; at the barrier the bucket is folded with -mean and the step is taken once. Both paths are
   ``SAOSpec`` run by ``engine_steps.sync_step`` / ``stream_step`` (``sao_step_pair``: their arguments).
3. No inference engine or critic runs here: the critic's values are seeded random numbers (the learner
   only reads them), and the rollout log-probs are the learner's own at the step-start weights plus a
   fixed per-token perturbation (the inference engine's mismatch), so the band mask drops some tokens.
   Both paths get the same numbers. Multi-turn trajectories (observation tokens masked) exercise GAE's skip.
4. ``run_sao_equivalence`` gives sync_a, sync_b (rows regrouped across micro-batches: the noise floor)
   and stream, ``steps`` optimizer steps each, for ``benchmarks/sao.py`` and the engine test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from thundersync_harness.engine_setup import TurnTraj, make_turn_trajectories, start_workers, verl_config
from thundersync_harness.engine_steps import Feed, StepSpec, gap_rows, old_log_probs, stream_step, sync_step, train
from thundersync_verl import verl_adapter as va
from thundersync_verl.algos.sao.sao_streaming import SAOStreamClient, SAOStreamPlanner, SAOTrajectory

EPS_LOW, EPS_HIGH = 0.3, 5.0  # the recipe's band (reasoning setting)
GAMMA, LAM = 1.0, 0.95  # the recipe's discount and GAE lambda
ROLLOUT_NOISE = 0.3  # std of the emulated rollout-vs-learner log-prob mismatch, nats


SAO_KEYS = {"actor_rollout_ref.actor.policy_loss.loss_mode": "sao", "actor_rollout_ref.actor.clip_ratio_low": EPS_LOW,
            "actor_rollout_ref.actor.clip_ratio_high": EPS_HIGH, "algorithm.adv_estimator": "sao"}


def sao_config(model_path, *, groups: int, micro: int, optimizer: str = "SGD"):
    """verl's config of the engine harness with SAO's actor loss, band and estimator."""
    from omegaconf import OmegaConf

    config = verl_config(model_path, groups=groups, micro=micro, optimizer=optimizer)
    for key, value in SAO_KEYS.items():
        OmegaConf.update(config, key, value, merge=False)
    return config


def make_sao_batch(seed: int, groups: int, vocab: int) -> dict:
    """Multi-turn trajectories (one per prompt in SAO's sense), rewards, critic values, rollout noise, arrival order."""
    trajs = make_turn_trajectories(seed, groups, vocab)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rewards, values, noise = {}, {}, {}
    for t in trajs:
        n = len(t.response)
        r = [0.0] * n
        r[max(i for i, m in enumerate(t.mask) if m)] = float(rng.random() < 0.5)
        rewards[t.tid] = r
        values[t.tid] = (0.5 * torch.randn(n, generator=gen) + 0.3).tolist()
        noise[t.tid] = (ROLLOUT_NOISE * torch.randn(n, generator=gen)).tolist()
    arrival = list(range(len(trajs)))
    rng.shuffle(arrival)
    return {"trajs": trajs, "rewards": rewards, "values": values, "noise": noise, "arrival": arrival}


def _data_proto(rows: list[TurnTraj], batch: dict, pad_token_id: int):
    from thundersync_verl.step.chunk_layout import pad_batch

    tensors = pad_batch([t.prompt for t in rows], [t.response for t in rows], pad_token_id,
                        response_masks=[t.mask for t in rows])
    width = tensors["responses"].shape[1]
    extra = {}
    for key in ("rewards", "values", "noise"):
        out = torch.zeros(len(rows), width, dtype=torch.float32)  # [B, R]
        for b, t in enumerate(rows):
            out[b, : len(t.response)] = torch.tensor(batch[key][t.tid])
        extra[key] = out
    data = va.data_proto_cls().from_dict(
        tensors={**tensors, "token_level_rewards": extra["rewards"], "values": extra["values"]},
        non_tensors={"uid": np.array([f"t{t.tid}" for t in rows], dtype=object)}, meta_info={"temperature": 1.0})
    return data, extra["noise"]


def _rollout_log_probs(wg, data, noise: torch.Tensor) -> torch.Tensor:
    """The learner's log-probs at the step-start weights plus the fixed mismatch, on the response mask, [B, R]."""
    mask = data.batch["response_mask"].float()  # [B, R]
    return (old_log_probs(wg, data) + noise) * mask


@dataclass(frozen=True)
class SAOSpec(StepSpec):
    """SAO's actor step on ``batch`` (``make_sao_batch``). verl: the rollout log-probs as old_log_probs (bypass
    mode) -> the ``sao`` estimator -> ``update_actor`` (loss sao). Streamed: ``SAOStreamPlanner`` fed each
    trajectory with its rewards, values and rollout log-probs; the whitening bucket folded at the barrier."""

    batch: dict = field(default_factory=dict)
    train_batch_size: int = 1
    max_chunk: int = 3

    def verl_batch(self, wg, trajs, row_order, pad_token_id):
        from thundersync_verl.algos.sao.sao_verl import compute_sao_advantage_return

        data, noise = _data_proto([trajs[i] for i in row_order], self.batch, pad_token_id)
        data.batch["old_log_probs"] = _rollout_log_probs(wg, data, noise)
        adv, ret = compute_sao_advantage_return(token_level_rewards=data.batch["token_level_rewards"],
                                                response_mask=data.batch["response_mask"], values=data.batch["values"],
                                                gamma=GAMMA, lam=LAM)
        data.batch["advantages"], data.batch["returns"] = adv, ret
        return data

    def feed(self, wg, trajs, pad_token_id, max_chunk):
        data, noise = _data_proto(trajs, self.batch, pad_token_id)
        rollout = _rollout_log_probs(wg, data, noise)  # [B, R], stands in for the inference engine's
        planner = SAOStreamPlanner(eps_low=EPS_LOW, eps_high=EPS_HIGH, gamma=GAMMA, lam=LAM, max_chunk_size=max_chunk)
        client = SAOStreamClient(wg, pad_token_id=pad_token_id)
        planner.begin_batch([t.tid for t in trajs])
        client.begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": self.train_batch_size})
        return SAOFeed(planner, client, trajs, self.batch, rollout)


class SAOFeed(Feed):
    """Trajectories arrive with their per-token rewards, values and rollout log-probs; the barrier first folds
    the whitening bucket with -mean (queued as a ``FoldOp`` when pipelined)."""

    kinds = ("chunks",)

    def __init__(self, planner, client, trajs: list[TurnTraj], batch: dict, rollout: torch.Tensor):
        super().__init__(planner, client)
        self.trajs, self.batch, self.rollout = trajs, batch, rollout

    def arrive(self, i: int) -> None:
        t, b = self.trajs[i], self.batch
        self.planner.arrive(SAOTrajectory(t.tid, t.prompt, t.response, t.mask, b["rewards"][t.tid], b["values"][t.tid],
                                          self.rollout[i, : len(t.response)].tolist()))

    def barrier(self):
        from thundersync_verl.core.sao_stream import SAO_BUCKET
        from thundersync_verl.step.stream_plan import FoldOp

        folds, final = self.planner.finalize()
        return [FoldOp(SAO_BUCKET, folds)], final

    def figures(self, final) -> dict:
        return {"barrier_scale": final.scale}


def sao_step_pair(batch: dict, train_batch_size: int) -> tuple[list, list, SAOSpec]:
    """``(trajs, arrival, spec)``: what ``engine_steps.sync_step`` / ``stream_step`` take for ``batch``."""
    return batch["trajs"], batch["arrival"], SAOSpec(batch=batch, train_batch_size=train_batch_size)


def regrouped(n_rows: int, micro: int) -> list[int]:
    """A stride permutation: every row gets new micro-batch companions (the noise floor's regrouping)."""
    stride = max(1, n_rows // micro)
    return sorted(range(n_rows), key=lambda i: (i % stride, i))


def run_sao_equivalence(model_path, pad_id: int, vocab: int, *, groups: int = 2, micro: int = 4, steps: int = 2,
                        seed: int = 0, dp: int = 1, wg=None) -> dict:
    """sync_a, sync_b (regrouped) and stream for ``steps`` steps; per step gap, floor and gap/floor."""
    if wg is None:
        wg = start_workers(sao_config(model_path, groups=groups, micro=micro), dp=dp)
    batches = [make_sao_batch(500 + 100 * seed + s, groups, vocab) for s in range(steps)]
    n_rows = len(batches[0]["trajs"])
    runs = {"sync_a": [], "sync_b": [], "stream": []}
    for trajs, arrival, spec in (sao_step_pair(b, groups) for b in batches):
        runs["sync_a"].append(partial(sync_step, wg, trajs, list(range(n_rows)), pad_id, spec))
        runs["sync_b"].append(partial(sync_step, wg, trajs, regrouped(n_rows, micro), pad_id, spec))
        runs["stream"].append(partial(stream_step, wg, trajs, arrival, pad_id, spec))
    out = {kind: train(wg, fns) for kind, fns in runs.items()}
    return {"steps": gap_rows(out, chunks="ops/chunks"), "rows": n_rows, "wg": wg}
