"""Streaming learners: one per verl engine, chosen by verl's own engine key (see ``base.py``)."""

from __future__ import annotations

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingConfigError
from thundersync_verl.core.errors import rule_message
from thundersync_verl.learner.engines.base import StreamLearner

LEARNERS = {"fsdp": "fsdp", "fsdp2": "fsdp", "megatron": "megatron"}


def make_learner(worker) -> StreamLearner:
    """The learner for the actor engine of ``worker`` (``actor.strategy``, set by ``model_engine``)."""
    strategy = va.actor_strategy(worker)
    kind = LEARNERS.get(strategy)
    if kind == "fsdp":
        from thundersync_verl.learner.engines.fsdp import FSDPLearner

        return FSDPLearner(worker)
    if kind == "megatron":
        from thundersync_verl.learner.engines.megatron import MegatronLearner

        return MegatronLearner(worker)
    raise StreamingConfigError(rule_message(
        f"no streaming learner for actor engine {strategy!r}",
        "the learner must know where the engine keeps the gradient and how it finalises a step",
        f"use model_engine=dp (actor strategy fsdp/fsdp2) or model_engine=megatron; engines: {sorted(LEARNERS)}"))


__all__ = ["LEARNERS", "StreamLearner", "make_learner"]
