"""verl's registries and base classes this package plugs into: config, rollout servers, checkpoint engines,
FSDP engines, agent loops (``thundersync_verl.verl_adapter`` point 3)."""

from __future__ import annotations

# -- config --------------------------------------------------------------------------
def base_config_cls():
    """verl's dataclass config base (read-only after construction, readable as a Mapping), as verl's
    own ``McoreActorConfig`` uses; ``thundersync_verl.config`` builds the ``thundersync`` keys on it."""
    from verl.base_config import BaseConfig

    return BaseConfig


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


# -- checkpoint engines (learner -> rollout weight pushes) ----------------------------
def checkpoint_engine_base():
    """verl's abstract ``CheckpointEngine`` (prepare / build_topology / init_process_group / send / receive)."""
    from verl.checkpoint_engine.base import CheckpointEngine

    return CheckpointEngine


def register_checkpoint_engine(name: str, make_class) -> None:
    """Register ``make_class()`` under ``name`` in verl's checkpoint-engine registry (once)."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    if name not in CheckpointEngineRegistry._registry:
        CheckpointEngineRegistry.register(name)(make_class())


def checkpoint_engine_manager(config, actor_wg, replicas):
    """verl's manager that runs a push (abort, topology, send/receive, finalize, resume) for ``replicas``."""
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.utils.config import omega_conf_to_dataclass

    return CheckpointEngineManager(config=omega_conf_to_dataclass(config), actor_wg=actor_wg, replicas=replicas)


def delta_sharded_parts():
    """The CPU-importable pieces of verl's ``delta_sharded`` backend (its engine module needs cupy):
    the sender's shard diff, the flush manifest and checksum, and the SGLang-side masked apply."""
    from types import SimpleNamespace

    from verl.checkpoint_engine.delta_sync.encode import DeltaParam, checksum
    from verl.checkpoint_engine.delta_sync.sparse_gather import shard_delta_indices
    from verl.workers.rollout.sglang_rollout.delta_loader import apply_delta

    return SimpleNamespace(shard_delta_indices=shard_delta_indices, DeltaParam=DeltaParam, checksum=checksum,
                           apply_delta=apply_delta)


def checkpoint_engine_import_errors() -> dict:
    """verl's optional engine modules that failed to import (e.g. ``delta_checkpoint_engine``: no cupy)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    return dict(CheckpointEngineRegistry._import_errors)


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


def agent_loop_session_loggers() -> list[str]:
    """The loggers verl's agent-loop workers report a failed session to (``envs/abort.py`` point 2)."""
    import verl.experimental.agent_loop.agent_loop as base
    import verl.trainer.ppo.v1.agent_loop_tq as tq_worker

    return [tq_worker.logger.name, base.logger.name]
