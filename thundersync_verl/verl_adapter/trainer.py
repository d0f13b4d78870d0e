"""verl's V1 trainer machinery as the ThunderSync trainer, OPD, SAO, the recipe check and the streamed critic
see it."""

from __future__ import annotations

from thundersync_verl.verl_adapter.learner import _mesh_dp_size


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


# -- SAO (``thundersync_verl/algos/sao/sao_verl.py``) ------------------------------------------------------------
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
        omega_conf_to_dataclass=omega_conf_to_dataclass,
        validate_config=getattr(validate_config, "__wrapped__", validate_config),  # verl's own (verl_patches 9 adds ours)
        need_reference_policy=ppo_utils.need_reference_policy, need_critic=ppo_utils.need_critic,
        agent_loops=lambda: set(agent_loop._agent_loop_registry), trainer_modes=lambda: set(trainer_base.TRAINER_REGISTRY),
        rollouts=lambda: set(RolloutReplicaRegistry._registry),
        checkpoint_engines=lambda: set(CheckpointEngineRegistry._registry),
        checkpoint_engines_unimportable=lambda: set(CheckpointEngineRegistry._import_errors))


# -- streamed critic (``algos/sao/critic_stream.py``) --------------------------------------------
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
    epochs after the streamed first one: ``algos/sao/sao_trainer_step.py`` point 3)."""
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


# ----- tail batching: a batch's prompts one by one (step/tail_rounds.py) ------------------------------------------
def batch_rows(batch) -> list:
    """A dataloader batch (verl's TensorDict) as one-row batches."""
    from verl.utils import tensordict_utils as tu

    return [tu.index_select_tensor_dict(batch, [i]) for i in range(len(batch))]


def row_dataset_index(row):
    """A one-row batch's dataset index (verl's RLHFDataset copies ``extra_info.index`` into ``index``)."""
    value = row["index"]
    value = value.tolist() if hasattr(value, "tolist") else list(value)
    return _index_key(value[0] if isinstance(value, list) else value)


def _index_key(value):
    """A dataset index as the tail queue names it: an integer where it reads as one, else its text."""
    return int(value) if isinstance(value, (int, float)) or str(value).lstrip("-").isdigit() else str(value)


def join_rows(rows: list, uids: list[str], global_steps: int):
    """One batch of ``rows`` under new prompt ``uids``, stamped with the step, as ``_next_train_batch`` stamps it."""
    from verl.utils import tensordict_utils as tu

    batch = tu.concat_tensordict(rows)
    tu.assign_non_tensor_stack(batch, "uid", list(uids))
    tu.assign_non_tensor_data(batch, "global_steps", global_steps)
    return batch


def dataset_rows(dataset, collate_fn, indices: list) -> list:
    """One-row batches of the dataset rows whose ``extra_info.index`` are ``indices`` (a resumed tail queue)."""
    from verl.utils import tensordict_utils as tu

    frame = dataset.dataframe
    infos = frame["extra_info"] if "extra_info" in frame.column_names else [None] * len(frame)
    position = {}
    for pos, info in enumerate(infos):
        index = (info or {}).get("index", pos) if isinstance(info, dict) else pos
        position.setdefault(_index_key(index), pos)
    missing = [i for i in indices if i not in position]
    if missing:
        raise KeyError(f"the training data holds no row with extra_info.index {missing[:5]}: a queued prompt of the "
                       "checkpoint cannot be read again (was data.train_files changed since it was written?)")
    return [tu.get_tensordict(collate_fn([dataset[position[i]]])) for i in indices]
