"""SAO in the ThunderSync trainer: single-rollout trajectories streamed into the actor's step as they land.

Why:
1. With ``algorithm.adv_estimator=sao`` (``thundersync_verl/algos/sao/sao_verl.py``) one rollout per prompt has no group
   barrier: a trajectory's coefficients are final once its reward and the critic's values of its tokens
   exist (``core/sao_stream.py`` point 1). So the streamed step runs verl's critic forward
   (``_compute_values``, the critic worker group verl builds for ``critic.enable=true``) on each arrival,
   at the step-start critic weights, and hands the trajectory to ``SAOStreamPlanner``: its GAE row goes
   straight into the batch gradient, its whitening row into the batch's one bucket.
2. ``SAOStepPlanner`` gives ``SAOStreamPlanner`` the interface ``StreamedStep`` drives (``ready_count``,
   ``next_ops``, ``finalize``): once the last trajectory is planned, its ``next_ops`` also returns the
   whitening fold (``FoldOp``: bucket x -mean), so the fold runs on the learner queue like GRPO's folds;
   ``finalize`` then hands the normaliser times inv_std to the one optimizer step.
3. The critic's update streams too (``CriticStream``, the worker in ``critic_worker.py``): once a trajectory has
   its values and Monte-Carlo returns its value-loss coefficients c_t = V_t - G_t are final, so its critic
   backward is sent at once (not waited for); the 1/N normaliser and the critic's optimizer step follow the
   actor's step. That is verl's first critic epoch; with ``critic.ppo_epochs`` = E > 1 the trainer then runs
   verl's own ``_update_critic`` with E - 1 epochs on the same batch (every epoch clips against the stored
   step-start values, so that is verl's epochs 2..E; ``tests/algos/test_critic_stream_engine_on_cpu.py``).
4. ``trainer.critic_warmup`` steps train the critic only, as verl's sync step does: the batch is collected
   whole (``collect_batch``), valued, and the critic updated; the actor takes no optimizer step at all (a
   zero-gradient step would still move AdamW's weights by weight decay).
5. What streaming SAO refuses (``validate_sao_config``, before any work): rollout.n != 1, no critic, a loss
   other than ``sao``, several optimizer steps per batch, KL loss or entropy bonus, rollout importance
   weights, ``learner_forward=separate`` (the band mask needs the rollout's log-probs in each chunk),
   OPD; for the critic: a strategy other than fsdp/fsdp2, ``critic.loss_agg_mode`` other than token-mean,
   several critic mini-batches per batch. The workers re-check (``sao_stream.sao_settings``,
   ``critic_worker.critic_settings``).
6. ``SAOAlgorithm`` is SAO as the trainer's algorithm (``step/contracts.TrainerAlgorithm``, chosen by
   ``step/algorithm.choose_algorithm`` with ``algorithm.adv_estimator=sao``): it swaps in the streaming critic
   worker, values each arrival with verl's critic forward (``critic_values``), owns the run's ``CriticStream``,
   and runs the warm-up steps (point 4) and the critic's update after the actor's step (point 3). Its step records
   keep the ``algo`` name ``grpo`` they had before SAO was an algorithm of its own.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingConfigError, StreamingStateError
from thundersync_verl.core.errors import rule_message
from thundersync_verl.algos.sao.critic_stream import (VERIFIED_STRATEGIES, CriticRow, CriticStreamClient,
                                                    CriticStreamPlanner, critic_stream_meta)
from thundersync_verl.algos.sao.sao_streaming import NAME, SAOBackwardOp, SAOStreamPlanner, SAOTrajectory
from thundersync_verl.step.stream_plan import FinalizeOp, FoldOp
from thundersync_verl.step.trajectory_source import TrajectoryNeverArrived, TrajectorySource
from thundersync_verl.step.chunk_layout import exact_micro_batch_size
from thundersync_verl.step.contracts import AlgorithmDefaults, PlannerDefaults, TrainerAlgorithmDefaults
from thundersync_verl.step.stream_exec import rollout_as_old_log_probs

BATCH_GROUP = "__sao_batch__"  # the FoldOp's group id: the whole batch is SAO's one "group"


def sao_enabled(config) -> bool:
    return str(config.algorithm.get("adv_estimator", "")) == NAME


def _get(node: Any, key: str, default: Any = None) -> Any:
    for part in key.split("."):
        node = None if node is None else node.get(part, None)
    return default if node is None else node


def validate_sao_config(config, ts) -> None:
    """Refuse what streamed SAO cannot do, naming the key (point 5)."""
    arr, actor = config.actor_rollout_ref, config.actor_rollout_ref.actor
    tbs = int(config.data.train_batch_size)
    rules = [
        (int(arr.rollout.n) == 1, "actor_rollout_ref.rollout.n=1",
         "SAO is single-rollout: the critic is the baseline, there is no group"),
        (bool(_get(config, "critic.enable", False)), "critic.enable=true",
         "SAO's advantages are GAE over the critic's values"),
        (_get(actor, "policy_loss.loss_mode", "vanilla") == NAME, "actor_rollout_ref.actor.policy_loss.loss_mode=sao",
         "the streamed chunk loss is SAO's double-sided mask"),
        (int(actor.get("ppo_epochs", 1)) == 1 and int(actor.ppo_mini_batch_size) == tbs,
         f"actor_rollout_ref.actor.ppo_epochs=1 and ppo_mini_batch_size={tbs}",
         "the coefficients are fixed at the step-start weights: one optimizer step per batch"),
        (not actor.get("use_kl_loss", False) and not float(actor.get("entropy_coeff", 0.0) or 0.0),
         "actor_rollout_ref.actor.use_kl_loss=false and entropy_coeff=0", "SAO chunks carry the policy term only"),
        (_get(config, "algorithm.rollout_correction.rollout_is") is None,
         "algorithm.rollout_correction.rollout_is=null", "SAO chunks do not carry rollout importance weights"),
        (bool(_get(config, "algorithm.rollout_correction.bypass_mode", False)),
         "algorithm.rollout_correction.bypass_mode=true",
         "the band mask is against the rollout's log-probs, as verl's sao loss sees them in bypass mode"),
        (ts.learner_forward == "fused", "thundersync.learner_forward=fused",
         "each chunk carries the rollout's log-probs for the band mask; fused takes them on arrival"),
        (_get(config, "critic.strategy") in VERIFIED_STRATEGIES, "critic.strategy=fsdp2",
         "the streamed critic update is verified on verl's FSDP critic engine only"),
        (_get(config, "critic.loss_agg_mode", "token-mean") == "token-mean", "critic.loss_agg_mode=token-mean",
         "the critic's deferred normaliser is the token mean"),
        (int(_get(config, "critic.ppo_mini_batch_size", tbs)) == tbs, f"critic.ppo_mini_batch_size={tbs}",
         "a later critic mini-batch would need values at weights that exist only after an earlier step"),
    ]
    bad = [(fix, why) for ok, fix, why in rules if not ok]
    if bad:
        raise StreamingConfigError(rule_message(
            "thundersync mode with algorithm.adv_estimator=sao needs " + ", ".join(f for f, _ in bad),
            "; ".join(w for _, w in bad), "set " + ", ".join(f for f, _ in bad)))


def planner_from_config(config, ts) -> "SAOStepPlanner":
    actor, algo = config.actor_rollout_ref.actor, config.algorithm
    clip = float(actor.get("clip_ratio", 0.2))
    inner = SAOStreamPlanner(
        eps_low=float(actor.get("clip_ratio_low", None) or clip), eps_high=float(actor.get("clip_ratio_high", None) or clip),
        gamma=float(algo.get("gamma", 1.0)), lam=float(algo.get("lam", 1.0)),
        loss_agg_mode=actor.get("loss_agg_mode", "token-mean"), loss_scale_factor=actor.get("loss_scale_factor", None),
        max_chunk_size=ts.chunk_size)
    return SAOStepPlanner(inner)


class SAOStepPlanner(PlannerDefaults):
    """``SAOStreamPlanner`` behind the planner interface of ``StreamedStep`` (point 2)."""

    verl_settings = {"adv_estimator": NAME}  # the batch meta: the worker checks the actor config for SAO

    def __init__(self, inner: SAOStreamPlanner):
        self.inner = inner
        self.loss_agg_mode, self.max_chunk_size = inner.loss_agg_mode, inner.max_chunk_size
        self._expected = 0

    def begin_batch(self, traj_ids: list) -> None:
        self.inner.begin_batch(traj_ids)
        self._expected, self._arrived, self._pending = len(traj_ids), 0, 0
        self._final: FinalizeOp | None = None
        self._fold_sent = False

    def arrive(self, traj: SAOTrajectory) -> None:
        self.inner.arrive(traj)
        self._arrived += 1
        self._pending += 1

    @property
    def ready_count(self) -> int:
        """Rows not planned yet, plus the fold once every trajectory is in (it is the last op to plan)."""
        return self._pending + int(self._arrived == self._expected > 0 and not self._fold_sent)

    def next_ops(self) -> list:
        ops: list = self.inner.next_ops()
        self._pending = 0
        if self._arrived == self._expected and not self._fold_sent:
            folds, self._final = self.inner.finalize()
            self._fold_sent = True
            if folds:
                ops.append(FoldOp(BATCH_GROUP, folds))
        return ops

    def finalize(self) -> FinalizeOp:
        if self._final is None:
            raise StreamingStateError(rule_message(
                f"SAO finalize refused: {self._arrived} of {self._expected} trajectories arrived and were planned",
                "the whitening statistics and the step need every trajectory", "let every trajectory land first"))
        final, self._final = self._final, None
        return final

    def memory(self) -> dict:
        return {"peak_open_groups": int(self.inner.whiten)}  # one whitening bucket for the whole batch


class CriticStream:
    """The critic's first epoch of the step, streamed (point 3): begin -> arrive ... send ... -> finalize."""

    def __init__(self, config, critic_wg, *, pad_token_id: int, temperature: float, chunk_size: int):
        self.meta = critic_stream_meta(config)
        self.client = CriticStreamClient(critic_wg, pad_token_id=pad_token_id, temperature=temperature)
        self.planner = CriticStreamPlanner(loss_agg_mode=config.critic.get("loss_agg_mode", "token-mean"),
                                           max_chunk_size=chunk_size)
        self.later_epochs = int(self.meta["critic_later_epochs"])

    def begin(self, ids: list) -> None:
        self.planner.begin_batch(ids)
        self.client.begin_batch(self.meta)  # zeroes the critic's gradient: a failed earlier batch leaves nothing
        self._sq_err, self.chunks = 0.0, 0

    def arrive(self, traj: SAOTrajectory, returns) -> None:
        row = CriticRow.of(traj, returns)
        self.planner.arrive(row)
        self._sq_err += sum((v - g) ** 2 for v, g, m in zip(row.values, row.returns, row.agent_mask) if m)

    def send(self) -> None:
        """The ready rows' critic backwards, sent without waiting (the actor's stream goes on meanwhile)."""
        chunks = self.planner.next_chunks()
        if chunks:
            self.client.run(chunks, wait=False)
            self.chunks += len(chunks)

    def finalize(self) -> dict:
        """Wait for the backwards, 1/N, the critic's optimizer step; verl's metric names."""
        n_tokens = self.planner.num_tokens
        out = self.client.finalize(self.planner.finalize())
        return {"critic/vf_loss": 0.5 * self._sq_err / n_tokens, "critic/grad_norm": out.get("grad_norm", 0.0),
                "critic/lr": out.get("lr", 0.0), "thundersync/critic_chunks": self.chunks}


class SAOArrivals(AlgorithmDefaults):
    """SAO: a landed trajectory, valued by the critic on arrival, is one ``SAOTrajectory`` (point 1)."""

    def __init__(self, planner: SAOStepPlanner, critic: CriticStream | None = None):
        self.planner, self.critic = planner, critic
        self._keys: dict[str, str] = {}  # the planner's trajectory id (the prompt) -> the TransferQueue key

    def begin(self, ctx):
        ids = [f"{i:08d}" for i in range(len(ctx.uids))] if ctx.deterministic else list(ctx.uids)
        self.planner.begin_batch(ids)
        if self.critic is not None:
            self.critic.begin(ids)
        return None  # no turn source

    def admit_turn(self, turn, tag, state, t_seen: float) -> None:
        raise TypeError("SAO streams whole trajectories; a scored turn arrived")

    def admit_trajectory(self, key: str, row: dict, state, t_seen: float) -> None:
        missing = [k for k in ("values", "rollout_lp", "scores") if k not in row]
        if missing:
            raise StreamingStateError(rule_message(
                f"trajectory {key}: SAO needs {missing} on arrival", "its GAE and band mask are computed then",
                "run SAO with critic.enable=true and thundersync.learner_forward=fused"))
        self._keys[key.split("_")[0]] = key
        traj = SAOTrajectory(traj_id=key.split("_")[0], prompt=row["prompt"], response=row["response"],
                             agent_mask=row["mask"], rewards=row["scores"], values=row["values"],
                             rollout_log_probs=row["rollout_lp"])
        self.planner.arrive(traj)
        if self.critic is not None:  # its Monte-Carlo returns: computed by the actor's planner with its GAE
            self.critic.arrive(traj, self.planner.inner.returns[traj.traj_id])

    def admitted(self) -> None:
        """After a poll's arrivals: their critic backwards go out together."""
        if self.critic is not None:
            self.critic.send()

    def describe_op(self, op, state, t0: float) -> tuple[str, tuple, int]:
        if isinstance(op, SAOBackwardOp):
            tokens = sum(len(t.prompt) + len(t.response) for t, _ in op.rows)
            return "backward", tuple((uid, self._keys[uid]) for uid in op.items), tokens  # the recorder's (group, key)
        return "fold", (), 0

    def check_complete(self, state) -> None:
        return None  # SAOStepPlanner.finalize refuses an incomplete batch

    def metrics(self, state, ctx) -> dict:
        """verl's ``actor/sao_masked_frac`` (the sao loss's name): band-masked share of the scored agent tokens."""
        scored = state.sums.get("sao_scored", 0.0)
        return {"actor/sao_masked_frac": state.sums.get("sao_masked", 0.0) / scored} if scored else {}

    def close(self) -> None:
        return None


def collect_batch(tq, uids: list[str], n: int, *, timeout_s: float, poll_s: float) -> tuple[list, list]:
    """Wait for every trajectory of the batch (a critic-only warm-up step, point 4); ``(keys, tags)``."""
    source = TrajectorySource(tq.kv_list, uids, n, timeout_s=timeout_s)
    t0, keys, tags = time.time(), [], []
    while not source.done:
        for key, tag in source.poll():
            keys.append(key)
            tags.append(tag)
        if source.done:
            break
        if time.time() - t0 > timeout_s:
            raise TrajectoryNeverArrived(
                f"{source.expected - len(source.seen)} trajectories of this critic warm-up batch did not arrive "
                f"within {timeout_s:.0f}s; the critic was NOT updated. Raise thundersync.trajectory_timeout_s if your "
                "tools are that slow, or check the rollout servers.")
        time.sleep(poll_s)
    return keys, tags


def critic_values(trainer, keys: list, tags: list) -> dict[str, list[float]]:
    """verl's critic forward (``_compute_values``) for trajectories as they land, at the step-start weights."""
    api, critic = va.trainer_api(), trainer.config.critic
    cap = critic.get("forward_micro_batch_size_per_gpu") or critic.get("ppo_micro_batch_size_per_gpu")
    meta = api.KVBatchMeta(partition_id="train", keys=keys, tags=tags,
                           extra_info={"micro_batch_size_per_gpu": exact_micro_batch_size(len(keys), cap)})
    trainer._compute_values(meta, {})
    data = api.tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["values"])
    return {key: data["values"][i].tolist() for i, key in enumerate(keys)}


class SAOAlgorithm(TrainerAlgorithmDefaults):
    """SAO in the trainer (point 6): critic-valued trajectories, the critic's update streamed after the actor's."""

    name = "sao"
    record_algo = "grpo"  # point 6: the records' name is kept

    def __init__(self):
        self.critic_stream: CriticStream | None = None  # the run's one, built at the first streamed step

    def validate_settings(self, config, ts) -> None:
        validate_sao_config(config, ts)

    def setup_workers(self, role_worker_mapping: dict) -> None:
        """The critic's update streams too: verl's critic worker becomes the streaming one (point 3)."""
        import ray

        critic = va.trainer_api().Role.Critic
        if critic in role_worker_mapping:
            from thundersync_verl.algos.sao.critic_worker import StreamingCriticWorker

            role_worker_mapping[critic] = ray.remote(StreamingCriticWorker)

    def planner(self, config, ts, bucket_bytes: Callable[[], int]) -> SAOStepPlanner:
        return planner_from_config(config, ts)

    def arrivals(self, trainer) -> SAOArrivals:
        if self.critic_stream is None:
            rollout = trainer.config.actor_rollout_ref.rollout
            self.critic_stream = CriticStream(trainer.config, trainer.critic_wg, pad_token_id=trainer.tokenizer.pad_token_id,
                                              temperature=rollout.temperature, chunk_size=trainer.ts.chunk_size)
        return SAOArrivals(trainer.planner, self.critic_stream)

    def values(self, trainer) -> Callable:
        return functools.partial(critic_values, trainer)

    def is_warmup_step(self, trainer) -> bool:
        return trainer.config.trainer.critic_warmup > trainer.global_steps

    def warmup_step(self, trainer, metrics: dict, timing_raw: dict):
        """``trainer.critic_warmup`` steps: the whole batch valued, the critic updated, the actor untouched (point 4)."""
        api, ts = va.trainer_api(), trainer.ts
        with api.marked_timer("gen", timing_raw, color="red"):
            keys, tags = collect_batch(api.tq, list(trainer._batch_uids), int(trainer.config.actor_rollout_ref.rollout.n),
                                       timeout_s=ts.trajectory_timeout_s, poll_s=ts.poll_s)
        rollout_as_old_log_probs(api.tq, keys)  # bypass mode, as on the streamed steps
        critic_values(trainer, keys, tags)
        batch = trainer._compute_advantage(api.KVBatchMeta(partition_id="train", keys=keys, tags=tags), {})
        with api.marked_timer("update_critic", timing_raw, color="pink"):
            batch = trainer._update_critic(batch, metrics=metrics)
        trainer.recorder.finish_step({}, {})
        return batch

    def after_step(self, trainer, batch, metrics: dict, timing_raw: dict):
        """The critic's streamed epoch steps after the actor's (nothing half-applied), then verl's later ones."""
        with va.trainer_api().marked_timer("update_critic", timing_raw, color="pink"):
            t0 = time.time()
            metrics.update(self.critic_stream.finalize())
            if self.critic_stream.later_epochs:
                batch = va.update_critic_epochs(trainer, batch, metrics, self.critic_stream.later_epochs)
            trainer.recorder.learner_op("critic_update", t0, time.time())
        return batch
