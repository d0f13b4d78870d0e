"""Streaming learners: one per verl engine, chosen by verl's own engine key (see ``base.py``)."""

from __future__ import annotations

from thundersync_verl import verl_adapter as va
from thundersync_verl.learner import engine_rules
from thundersync_verl.learner.engine_rules import LEARNERS
from thundersync_verl.learner.engines.base import StreamLearner


def make_learner(worker) -> StreamLearner:
    """The learner for the actor engine of ``worker`` (``actor.strategy``, set by ``model_engine``); an engine with
    no learner is refused by the ``learner`` rule of ``engine_rules.py``."""
    strategy = va.actor_strategy(worker)
    engine_rules.raise_first({"strategy": strategy}, engine="any", owners=(engine_rules.STREAM,))
    if LEARNERS[strategy] == "fsdp":
        from thundersync_verl.learner.engines.fsdp import FSDPLearner

        return FSDPLearner(worker)
    from thundersync_verl.learner.engines.megatron import MegatronLearner

    return MegatronLearner(worker)


__all__ = ["LEARNERS", "StreamLearner", "make_learner"]
