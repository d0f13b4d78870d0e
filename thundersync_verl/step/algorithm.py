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
"""

from __future__ import annotations

from thundersync_verl.algos.opd.opd_trainer_step import OPDAlgorithm, opd_enabled
from thundersync_verl.algos.sao.sao_trainer_step import SAOAlgorithm, sao_enabled
from thundersync_verl.core import StreamingConfigError
from thundersync_verl.core.errors import rule_message
from thundersync_verl.step.contracts import TrainerAlgorithm
from thundersync_verl.step.grpo_algorithm import GRPOAlgorithm


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
