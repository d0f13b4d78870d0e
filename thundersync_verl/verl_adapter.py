"""The one place that reaches into verl internals.

1. Everything thundersync_verl needs from verl beyond its documented config is
   imported here, so a verl upgrade touches this file (and ``tests/test_verl_api_on_cpu.py``
   imports every symbol below against the pinned version).
2. Imports are lazy: ``thundersync_verl.core`` and the simulator never import verl,
   and importing this module is cheap.
"""

from __future__ import annotations

VERL_VERSION = "0.9.1"


def check_verl_version() -> str:
    import verl

    if verl.__version__ != VERL_VERSION:
        raise RuntimeError(
            f"thundersync_verl is built against verl=={VERL_VERSION} but verl {verl.__version__} is installed; "
            f"install the pinned version: pip install verl=={VERL_VERSION}"
        )
    return verl.__version__


# -- platform ------------------------------------------------------------------------
def platform_registry():
    from verl.plugin.platform import PlatformRegistry

    return PlatformRegistry


# -- rollout -------------------------------------------------------------------------
def token_output_cls():
    from verl.workers.rollout.replica import TokenOutput

    return TokenOutput


def rollout_replica_base():
    from verl.workers.rollout.replica import RolloutReplica

    return RolloutReplica


def base_rollout_cls():
    from verl.workers.rollout.base import BaseRollout

    return BaseRollout


def register_rollout(name: str, replica_loader, adapter_fqn: str) -> None:
    """Register a rollout backend under ``name`` for both verl lookups (replica + server adapter)."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(name, replica_loader)
    rollout_base._ROLLOUT_REGISTRY[(name, "async")] = adapter_fqn


def known_rollouts() -> list[str]:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    return sorted(RolloutReplicaRegistry._registry)


# -- engines -------------------------------------------------------------------------
ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"


def register_fsdp_engines_for(device: str) -> None:
    """Make verl's FSDP/FSDP2 engines resolvable on ``device`` (verl registers them for cuda/npu only)."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl as fsdp_impl

    for model_type, cls in (("language_model", fsdp_impl.FSDPEngineWithLMHead), ("value_model", fsdp_impl.FSDPEngineWithValueHead)):
        registry = EngineRegistry._engines.setdefault(model_type, {})
        for backend in ("fsdp", "fsdp2"):
            registry.setdefault(backend, {}).setdefault(device, cls)


# -- agent loop ----------------------------------------------------------------------
def agent_loop_base():
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase

    return AgentLoopBase


def agent_loop_output_cls():
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    return AgentLoopOutput


def register_agent_loop(name: str):
    from verl.experimental.agent_loop.agent_loop import register

    return register(name)
