"""The one place that reaches into verl internals.

1. Everything thundersync_verl needs from verl beyond its documented config is
   imported here, so a verl upgrade touches this file (and ``tests/test_verl_api_on_cpu.py``
   imports every symbol below against the pinned version).
2. Imports are lazy: ``thundersync_verl.core`` and the simulator never import verl,
   and importing this module is cheap.
"""

from __future__ import annotations

VERL_VERSION = "0.9.1"


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


# -- streaming learner ---------------------------------------------------------------
# The streaming worker (``thundersync_verl.trainer.streaming_worker``) builds on verl's
# Tinker-style split API; every verl internal it touches is reached through these functions.
def tinker_actor_worker_base():
    """verl's actor worker with split forward_backward / optimizer_step primitives."""
    from verl.workers.engine_workers_tinker import TinkerActorRolloutRefWorker

    return TinkerActorRolloutRefWorker


def worker_register_api():
    """``(register, Dispatch, actor_mesh_dispatch)``: verl's seams for registered worker methods."""
    from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register

    return register, Dispatch, make_nd_compute_dataproto_dispatch_fn(mesh_name="actor")


def actor_dp_size(worker_group) -> int:
    """How many parts verl cuts a batch into when it dispatches it to the actor mesh of ``worker_group``.

    verl's ``make_nd_compute_dataproto_dispatch_fn("actor")`` chunks a batch into max(dp rank) + 1 parts;
    ranks that differ only in TP/PP/CP (Megatron) or sequence-parallel rank (FSDP Ulysses) get the same
    part. Cached in the group as verl caches it. A stand-in group without verl's query has one rank per part.
    """
    return _mesh_dp_size(worker_group, "actor")


def _mesh_dp_size(worker_group, mesh: str) -> int:
    """max(dp rank) + 1 of ``mesh`` in ``worker_group``, cached in the group as verl caches it."""
    query = getattr(worker_group, "_query_dispatch_info", None)
    if query is None:
        return int(worker_group.world_size)
    if mesh not in worker_group._dispatch_info:
        worker_group._dispatch_info[mesh] = query(mesh)
    return max(worker_group._dispatch_info[mesh]) + 1


def to_no_padding(td):
    """Left/right-padded batch -> verl's no-padding layout (nested input_ids, loss_mask)."""
    from verl.workers.utils.padding import left_right_2_no_padding

    return left_right_2_no_padding(td)


def response_log_probs(model_output, data):
    """The engine's per-token log-probs of a micro-batch as a padded [B, T_response] tensor."""
    return unpad_response(model_output["log_probs"], data)


def padded_fields(data, *keys):
    """``keys`` of a (micro-)batch TensorDict as plain padded tensors."""
    return data.select(*keys).to_padded_tensor()


def worker_result_refs(result) -> list:
    """The object refs behind a non-blocking (``blocking=False``) worker-group call, one per rank.

    verl hands back the list itself, or wraps mesh-dispatched results in a ``DataProtoFuture``.
    """
    futures = getattr(result, "futures", None)
    refs = list(futures) if futures is not None else result
    if not isinstance(refs, list) or not refs:
        raise TypeError(f"expected the object refs of a non-blocking worker call, got {type(result).__name__}")
    return refs


def non_tensor(data, key: str, default=None):
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


def assign_non_tensor(data, **values) -> None:
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(data, **values)


def actor_engine(worker):
    """The FSDP engine inside an ActorRolloutRefWorker's actor TrainingWorker."""
    return worker.actor.engine


def actor_loss_fn(worker):
    return worker.actor.loss_fn


def set_actor_loss_fn(worker, loss_fn) -> None:
    worker.actor.set_loss_fn(loss_fn)


def actor_parameters(engine) -> list:
    """The engine's (possibly FSDP2-sharded DTensor) parameters, in a fixed order."""
    return list(engine.module.parameters())


def local_view(tensor):
    """The local shard of a DTensor (the tensor itself when not distributed)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full_tensor(tensor):
    """The full (all-gathered) value of a DTensor; a collective on every rank."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def reset_actor(worker) -> None:
    """Rebuild the actor from its checkpoint path: fresh weights, optimizer and LR scheduler."""
    worker.actor.reset()


def dp_group_of(engine):
    return engine.get_data_parallel_group()


def precision_dtype(name: str):
    """The torch dtype verl's engine maps ``model_dtype`` / mixed-precision names to (raises if none)."""
    from verl.utils.torch_dtypes import PrecisionType

    return PrecisionType.to_dtype(name)


def compose_ppo_config(overrides: list[str]):
    """verl's own ``ppo_trainer.yaml``, composed with hydra overrides (the trainer's config tree)."""
    import os

    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def data_proto_cls():
    from verl import DataProto

    return DataProto


def grpo_compute_advantage(data, *, adv_estimator: str, norm_adv_by_std_in_grpo: bool = True):
    """verl's trainer-side ``compute_advantage`` (needs token_level_rewards, response_mask, uid)."""
    from verl.trainer.ppo.ray_trainer import compute_advantage

    return compute_advantage(data, adv_estimator=adv_estimator, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)


def policy_loss_fn(loss_mode: str):
    """verl's registered policy loss (``actor.policy_loss.loss_mode``): the PPO ratio, clip and ``agg_loss``."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    return get_policy_loss_fn(loss_mode)


def td_get(data, key: str, default=None):
    """A value of a TensorDict returned by a worker group, unwrapped to plain Python/tensors."""
    from verl.utils import tensordict_utils as tu

    return tu.get(data, key, default)


def unpad_response(tensor, data):
    """A no-padding per-token output (e.g. log_probs) as a padded [B, T_response] tensor."""
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(tensor, data)


def actor_micro_batch_size(worker):
    """``(use_dynamic_bsz, micro_batch_size_per_gpu)`` of the actor's training engine config."""
    cfg = worker.actor.engine_config
    return bool(cfg.use_dynamic_bsz), cfg.micro_batch_size_per_gpu


def actor_strategy(worker) -> str:
    """The actor engine's key (``fsdp``, ``fsdp2``, ``megatron``...): what ``model_engine`` selects."""
    return str(worker.actor.engine_config.strategy)


def megatron_chunks(engine) -> list:
    """The model chunks of verl's Megatron engine (DDP-wrapped; one per virtual pipeline stage)."""
    return list(engine.module)


def megatron_streaming_blockers(engine) -> dict:
    """The Megatron engine settings a streamed step must check: ``{name: value}``."""
    cfg = engine.engine_config
    return {"param_offload": bool(engine.is_param_offload_enabled),
            "virtual_pipeline_model_parallel_size": cfg.virtual_pipeline_model_parallel_size,
            "use_megatron_fsdp": bool(getattr(cfg, "use_megatron_fsdp", False)),
            "calculate_per_token_loss": bool(getattr(engine.tf_config, "calculate_per_token_loss", False))}


# -- trainer (the ThunderSync trainer's view of verl's V1 trainer machinery) -----------------
def trainer_api():
    """verl's V1 trainer pieces the ThunderSync trainer builds on, in one namespace."""
    from types import SimpleNamespace

    import transfer_queue as tq
    from transfer_queue import KVBatchMeta
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.trainer.ppo.utils import Role
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.debug import marked_timer
    from verl.workers.rollout.llm_server import LLMServerManager

    return SimpleNamespace(tq=tq, KVBatchMeta=KVBatchMeta, CheckpointEngineManager=CheckpointEngineManager, Role=Role,
                           PPOTrainer=PPOTrainer, register_trainer=register_trainer, marked_timer=marked_timer,
                           omega_conf_to_dataclass=omega_conf_to_dataclass, LLMServerManager=LLMServerManager)


def log_images(tracking, tag: str, images: list) -> list[str]:
    """Send PNGs (``[(step, path)]``) to the image-capable backends of verl's ``Tracking``; the backends reached.

    verl 0.9.1's ``Tracking`` (``trainer.logger``) logs scalars only, so the images go through each
    backend's own writer, found in ``Tracking.logger``: tensorboard's ``SummaryWriter.add_image`` at
    each image's step, and ``wandb.Image``. wandb drops steps below its current one and keeps one value
    per key and step, so one call's images land together, as one list under ``tag``, at wandb's current
    step or the latest image's step if later; each caption names the step it shows.
    """
    backends = getattr(tracking, "logger", None) or {}
    reached = []
    if images and "tensorboard" in backends:
        import numpy as np
        from PIL import Image

        for step, png in images:
            with Image.open(png) as image:
                pixels = np.asarray(image.convert("RGB"))  # [H, W, 3] uint8
            backends["tensorboard"].writer.add_image(tag, pixels, int(step), dataformats="HWC")
        reached.append("tensorboard")
    if images and "wandb" in backends:
        wandb = backends["wandb"]
        at = max([int(step) for step, _ in images] + ([int(wandb.run.step)] if wandb.run is not None else []))
        wandb.log({tag: [wandb.Image(str(png), caption=f"step {step}") for step, png in images]}, step=at)
        reached.append("wandb")
    return reached


def registration_of(method) -> dict | None:
    """The dispatch/execute/blocking attributes verl's ``@register`` attached to a method, if any."""
    from verl.single_controller.base.decorator import MAGIC_ATTR

    return getattr(method, MAGIC_ATTR, None)


# -- on-policy distillation (OPD) ------------------------------------------------------------
def ray_worker_group_with(worker_cls, *, config, role: str, n_workers: int, name_prefix: str | None = None,
                          **init_kwargs):
    """A RayWorkerGroup of ``n_workers`` (one logical device slot each) running ``worker_cls``; every
    worker also receives ``init_kwargs`` (e.g. ``distillation_config``).

    verl's trainer builds its actor with ``distillation_config=config.distillation``; that is what
    switches the actor's loss to verl's distillation loss.
    """
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.device import get_device_name

    pool = RayResourcePool([n_workers], use_gpu=True, max_colocate_count=1, name_prefix=name_prefix)
    cls = RayClassWithInitArgs(cls=ray.remote(worker_cls), config=config, role=role, **init_kwargs)
    return RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name=get_device_name(), name_prefix=name_prefix)


def distillation_loss_fns():
    """verl's OPD loss pieces: ``(kl_penalty, compute_policy_loss_vanilla, agg_loss)``."""
    from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss_vanilla, kl_penalty

    return kl_penalty, compute_policy_loss_vanilla, agg_loss


def replay_buffer_classes():
    """verl's V1 ``(ReplayBuffer, ReplayBufferAsync)``."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    return ReplayBuffer, ReplayBufferAsync


def replay_buffer_read(keys: list[str], partition_id: str, plain: list[str], tensors: list[str]) -> list[dict]:
    """``plain`` fields (one value per key, e.g. ``extra_fields``) and ``tensors`` fields (one 1-D tensor per key:
    verl keeps them as jagged nested tensors, unbound here) of stored trajectories, in ONE ``kv_batch_get`` of
    the TransferQueue client verl's replay buffer uses (``replay_buffer.tq``)."""
    import torch
    from verl.trainer.ppo.v1 import replay_buffer

    data = replay_buffer.tq.kv_batch_get(keys=list(keys), partition_id=partition_id, select_fields=plain + tensors)
    columns = {}
    for field in plain:
        values = data[field]
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        columns[field] = [getattr(v, "data", v) for v in values]
    for field in tensors:
        values = data[field]
        rows = values.unbind(0) if isinstance(values, torch.Tensor) else list(values)
        columns[field] = [torch.as_tensor(getattr(v, "data", v)).reshape(-1) for v in rows]
    return [{f: columns[f][i] for f in plain + tensors} for i in range(len(keys))]


# -- SAO (``thundersync_verl/sao.py``) ------------------------------------------------------------
def register_advantage_estimator(name: str, fn) -> None:
    """Register ``fn`` as ``algorithm.adv_estimator=name`` (verl's ``register_adv_est``; once)."""
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, register_adv_est

    if ADV_ESTIMATOR_REGISTRY.get(name) is not fn:
        ADV_ESTIMATOR_REGISTRY.pop(name, None)  # a reload of the defining module brings a new function object
        register_adv_est(name)(fn)


def register_policy_loss(name: str, fn) -> None:
    """Register ``fn`` as ``actor.policy_loss.loss_mode=name`` (verl's ``register_policy_loss``)."""
    from verl.trainer.ppo.core_algos import register_policy_loss as register

    register(name)(fn)


def advantage_estimator_fn(name: str):
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    return get_adv_estimator_fn(name)


def agg_loss_fn():
    """verl's ``agg_loss`` (token-mean / seq-mean ... over the global batch info)."""
    from verl.trainer.ppo.core_algos import agg_loss

    return agg_loss


def response_mask_of(data):
    from verl.trainer.ppo.ray_trainer import compute_response_mask

    return compute_response_mask(data)


def gae_advantage_return():
    """verl's built-in GAE estimator ``compute_gae_advantage_return`` (the reference for SAO's tests)."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    return compute_gae_advantage_return


def compute_advantage_fn():
    """The trainer-side ``compute_advantage`` as verl's V1 trainer calls it (patched or not)."""
    from verl.trainer.ppo.v1 import utils as v1_utils

    return v1_utils.compute_advantage


# -- recipe check (``thundersync recipes check``) ---------------------------------------------
def config_check_api():
    """verl's own config rules and name registries, as a launch would apply them (no Ray, no GPU)."""
    from types import SimpleNamespace

    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.experimental.agent_loop import agent_loop
    from verl.trainer.ppo import utils as ppo_utils
    from verl.trainer.ppo.v1 import trainer_base
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    return SimpleNamespace(
        omega_conf_to_dataclass=omega_conf_to_dataclass, validate_config=validate_config,
        need_reference_policy=ppo_utils.need_reference_policy, need_critic=ppo_utils.need_critic,
        agent_loops=lambda: set(agent_loop._agent_loop_registry), trainer_modes=lambda: set(trainer_base.TRAINER_REGISTRY),
        rollouts=lambda: set(RolloutReplicaRegistry._registry),
        checkpoint_engines=lambda: set(CheckpointEngineRegistry._registry),
        checkpoint_engines_unimportable=lambda: set(CheckpointEngineRegistry._import_errors))


# -- streamed critic (``trainer/critic_stream.py``) --------------------------------------------
def critic_worker_base():
    """verl's critic worker (``TrainingWorker``, what the V1 trainer maps ``Role.Critic`` to) with the split API."""
    from verl.workers.engine_workers_tinker import TinkerTrainingWorker

    return TinkerTrainingWorker


def train_mesh_dispatch():
    """verl's dispatch over a ``TrainingWorker`` group's "train" mesh (a batch split by data-parallel rank)."""
    from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn

    return make_nd_compute_dataproto_dispatch_fn(mesh_name="train")


def train_dp_size(worker_group) -> int:
    """How many parts verl cuts a batch into for the "train" mesh of a ``TrainingWorker`` group (the critic's)."""
    return _mesh_dp_size(worker_group, "train")


def engine_owner_view(worker):
    """A ``TrainingWorker`` (e.g. the critic) seen through the ``.actor`` accessor the streaming learners read."""
    from types import SimpleNamespace

    return SimpleNamespace(actor=worker)


def bound_critic_config(loss_fn):
    """The ``CriticConfig`` bound into verl's value loss (``partial(value_loss, config=critic_cfg)``), else None."""
    return (getattr(loss_fn, "keywords", None) or {}).get("config")


def critic_config_of(config):
    """verl's ``CriticConfig`` dataclass of a trainer config's ``critic`` section (``omega_conf_to_dataclass``)."""
    from verl.utils.config import omega_conf_to_dataclass

    return omega_conf_to_dataclass(config.critic)


def value_loss_fn(critic_cfg):
    """verl's value loss bound to ``critic_cfg``, as the V1 trainer hands it to ``critic_wg.set_loss_fn``."""
    from functools import partial

    from verl.workers.utils.losses import value_loss

    return partial(value_loss, config=critic_cfg)


def critic_worker_group(worker_cls, config, *, n_workers: int, name_prefix: str | None = None):
    """``(worker group, CriticConfig)``: ``worker_cls`` as the critic, built as verl's V1 ``init_workers`` builds it."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.device import get_device_name
    from verl.workers.config import TrainingWorkerConfig

    critic_cfg = critic_config_of(config)
    critic_cfg.engine.infer_max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
    critic_cfg.engine.max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
    worker_cfg = TrainingWorkerConfig(model_type="value_model", model_config=critic_cfg.model,
                                      engine_config=critic_cfg.engine, optimizer_config=critic_cfg.optim,
                                      checkpoint_config=critic_cfg.checkpoint, profiler_config=None)
    pool = RayResourcePool([n_workers], use_gpu=True, max_colocate_count=1, name_prefix=name_prefix)
    cls = RayClassWithInitArgs(cls=ray.remote(worker_cls), config=worker_cfg)
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name=get_device_name(), name_prefix=name_prefix)
    wg.reset()
    wg.set_loss_fn(value_loss_fn(critic_cfg))
    return wg, critic_cfg


def update_critic_epochs(trainer, batch, metrics: dict, epochs: int):
    """verl's own ``_update_critic`` on ``batch`` with ``critic.ppo_epochs=epochs`` for this call only (SAO's critic
    epochs after the streamed first one: ``trainer/sao_trainer_step.py`` point 3)."""
    from omegaconf import open_dict

    critic = trainer.config.critic
    saved = critic.ppo_epochs
    with open_dict(critic):
        critic.ppo_epochs = int(epochs)
    try:
        return trainer._update_critic(batch, metrics=metrics)
    finally:
        with open_dict(critic):
            critic.ppo_epochs = saved


def rollout_temperature_of(refill_fn):
    """``actor_rollout_ref.rollout.temperature`` of the trainer whose ``_add_prompts_to_generate`` verl hands a
    custom sampler as ``refill_fn``; None when the sampler was built without a trainer."""
    config = getattr(getattr(refill_fn, "__self__", None), "config", None)
    try:
        return config.actor_rollout_ref.rollout.temperature
    except AttributeError:
        return None
