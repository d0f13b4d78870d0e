"""The run's algorithm, chosen once from verl's config: GRPO, OPD or SAO.

Why:
1. The trainer (``thundersync_trainer.py``) differs by algorithm in its config rules, planner, per-step arrivals,
   worker and client setup, warm-up and after-step work. ``choose_algorithm`` reads the config once and returns
   the one ``TrainerAlgorithm`` (``contracts.py`` point 3) that carries all of them, so no other module asks
   "is this OPD / SAO?" and a new algorithm is one implementation plus one line here.
2. The keys that choose: ``algorithm.adv_estimator=sao`` is SAO (``algos/sao/sao_trainer_step.py``),
   ``distillation.enabled=true`` is OPD (``algos/opd/opd_trainer_step.py``), anything else is GRPO
   (``grpo_algorithm.py``; verl's own estimator and loss rules then apply). Both SAO and OPD is refused here,
   naming the keys: one step streams either critic-valued trajectories or teacher-scored turns.
3. Each call returns a new instance: an algorithm may hold run state (SAO's critic stream), one per trainer.
4. ``begin_batch_meta``: the settings the trainer sends the streaming worker's ``stream_begin_batch``, read from
   the config, so ``thundersync recipes check`` runs the worker's validation on what a run would send.
"""

from __future__ import annotations

from thundersync_verl.algos.opd.opd_trainer_step import OPDAlgorithm, opd_enabled
from thundersync_verl.algos.sao.sao_trainer_step import SAOAlgorithm, sao_enabled
from thundersync_verl.core import StreamingConfigError
from thundersync_verl.core.errors import rule_message
from thundersync_verl.step.contracts import TrainerAlgorithm
from thundersync_verl.step.grpo_algorithm import GRPOAlgorithm
from thundersync_verl.step.stream_plan import rollout_correction_meta


def choose_algorithm(config) -> TrainerAlgorithm:
    """The run's algorithm for verl's ``config`` (point 2); refuses SAO and OPD together."""
    if sao_enabled(config):
        if opd_enabled(config):
            raise StreamingConfigError(rule_message(
                "algorithm.adv_estimator=sao and distillation.enabled=true together",
                "OPD streams teacher-scored turns, SAO critic-valued trajectories: one step streams one of them",
                "set distillation.enabled=false, or algorithm.adv_estimator to an OPD setting"))
        return SAOAlgorithm()
    if opd_enabled(config):
        return OPDAlgorithm()
    return GRPOAlgorithm()


def begin_batch_meta(config) -> dict:
    """The actor settings in the meta ``StreamedStep.run`` sends ``stream_begin_batch`` (point 4): the actor's
    ``loss_agg_mode`` and the planner's ``verl_settings`` (GRPO's ``StreamPlanner``: the estimator and its
    normalisation; SAO's ``sao_trainer_step``: ``adv_estimator=sao``; OPD: none)."""
    actor, algorithm = config.actor_rollout_ref.actor, config.algorithm
    meta = {"loss_agg_mode": actor.get("loss_agg_mode", "token-mean")}
    name = choose_algorithm(config).name
    if name == "sao":
        meta["adv_estimator"] = "sao"
    elif name == "grpo":
        meta.update(adv_estimator=algorithm.get("adv_estimator", "grpo"),
                    norm_adv_by_std_in_grpo=bool(algorithm.get("norm_adv_by_std_in_grpo", True)))
        meta.update(rollout_correction_meta(config))  # the learner's IS weights (StreamPlanner.from_settings)
    return meta
