"""GRPO as the trainer's algorithm: verl's loss streamed trajectory by trajectory, under an optional memory budget.

Why:
1. GRPO is the streaming trainer's base case (``streamed_step.GRPOArrivals``, ``stream_plan.StreamPlanner``), so its
   ``TrainerAlgorithm`` lives here in ``step/`` beside them; OPD and SAO keep theirs in ``algos/<name>/``.
2. Its settings rule is verl's own config, read by ``settings_from_verl_config`` (PPO epochs, mini-batches, loss,
   estimator, IS/KL terms), before the trainer's rollout-pool rules; it adds no workers, clients or warm-up.
3. ``build_planner`` sizes the stream planner to ``thundersync.memory_budget_bytes``: the budget bounds the bucket
   bytes one learner rank holds at once, so the planner is built only once the learner can say its bucket size
   (``GRPOAlgorithm.planner`` asks it only when a budget is set).
4. verl's mini-batches and PPO epochs (``steps_per_batch``) give several optimizer steps per batch: the stream
   planner is then wrapped in ``MiniBatchPlanner`` (``minibatch_plan.py``).
"""

from __future__ import annotations

from typing import Callable

from thundersync_verl.config import ThunderSyncConfig
from thundersync_verl.core import StreamingConfigError
from thundersync_verl.core.errors import rule_message
from thundersync_verl.step.chunk_layout import IndependentTerms
from thundersync_verl.step.contracts import TrainerAlgorithmDefaults
from thundersync_verl.step.minibatch_plan import MiniBatchPlanner
from thundersync_verl.step.stream_plan import StreamPlanner, rollout_correction_meta, settings_from_verl_config
from thundersync_verl.step.streamed_step import GRPOArrivals


def steps_per_batch(config) -> tuple[int, int]:
    """(K mini-batches, E epochs) of verl's update: K = train_batch_size / ppo_mini_batch_size."""
    actor = config.actor_rollout_ref.actor
    return int(config.data.train_batch_size) // int(actor.ppo_mini_batch_size), int(actor.get("ppo_epochs", 1))


def build_planner(config, ts: ThunderSyncConfig, *, bucket_bytes: int | None = None):
    """GRPO's stream planner under ``thundersync.memory_budget_bytes`` (point 3).

    The budget bounds the bucket bytes one learner rank holds at once (``bucket_bytes``: one bucket,
    a full local gradient shard of this learner). The planner counts the batch gradient as one buffer
    too, so its budget is the buckets' plus one buffer; a group whose buckets do not fit waits, and a
    budget that cannot hold even one open group is refused here, before any work, naming the key.
    """
    sizing, n = {}, int(config.actor_rollout_ref.rollout.n)
    k, epochs = steps_per_batch(config)
    companions = k * epochs > 1 and IndependentTerms.from_actor_config(config.actor_rollout_ref.actor).active
    if ts.memory_budget_bytes is not None:
        if not bucket_bytes:
            raise ValueError("build_planner: a memory budget needs the learner's bucket size (bucket_bytes)")
        unit = int(bucket_bytes) * (2 if companions else 1)  # minibatch_plan point 7: a KL/entropy companion each
        sizing = {"grad_numel": max(unit // 4, 1), "budget_bytes": int(ts.memory_budget_bytes) + unit}
    try:
        planner = StreamPlanner.from_settings(settings_from_verl_config(config), max_chunk_size=ts.chunk_size, **sizing)
        planner.verl_settings.update(rollout_correction_meta(config))  # the learner's IS weights (stream_loss.py point 8)
        if sizing:  # one group of the run's size must fit: found now, not at the first batch (dropped by the next begin)
            planner.begin_batch({"budget probe": n})
        if k * epochs > 1:  # verl's mini-batches and epochs: one optimizer step per mini-batch (minibatch_plan.py)
            return MiniBatchPlanner(planner, minibatch_groups=int(config.actor_rollout_ref.actor.ppo_mini_batch_size),
                                    epochs=epochs, independent_buckets=companions)
        return planner
    except StreamingConfigError as exc:
        if not sizing:
            raise
        raise StreamingConfigError(rule_message(
            f"thundersync.memory_budget_bytes={ts.memory_budget_bytes} cannot hold one open group's buckets on this "
            f"learner (one bucket = {bucket_bytes} bytes: a local gradient shard)",
            f"a group keeps its members' gradients in buckets until its last reward lands ({exc.args[0].splitlines()[0]})",
            f"raise thundersync.memory_budget_bytes to at least {n} x {bucket_bytes} = {n * int(bucket_bytes)} bytes "
            "(the worst case: each of a group's rollout.n members with its own reward bucket), shard the parameters "
            "over more ranks, or set it to null (unbudgeted)")) from exc


class GRPOAlgorithm(TrainerAlgorithmDefaults):
    """Group-relative advantages, whole trajectories streamed as they land (points 1-4)."""

    name = "grpo"
    record_algo = "grpo"

    def validate_settings(self, config, ts) -> None:
        settings_from_verl_config(config)  # ppo_epochs, mini-batches, loss, estimator, IS/KL terms

    def planner(self, config, ts, bucket_bytes: Callable[[], int]):
        """The stream planner, sized to the learner's bucket only under a memory budget (point 3)."""
        return build_planner(config, ts, bucket_bytes=bucket_bytes() if ts.memory_budget_bytes is not None else None)

    def arrivals(self, trainer) -> GRPOArrivals:
        return GRPOArrivals(trainer.planner)
