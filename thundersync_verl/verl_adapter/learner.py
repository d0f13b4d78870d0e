"""What the streaming learner (``learner/streaming_worker.py``) and its chunks reach in verl: the Tinker-style
actor worker, engines, TensorDict / DataProto fields, the actor's loss, Megatron's model chunks."""

from __future__ import annotations

import contextlib

# -- streaming learner ---------------------------------------------------------------
# The streaming worker (``thundersync_verl.learner.streaming_worker``) builds on verl's
# Tinker-style split API; every verl internal it touches is reached through these functions.
def tinker_actor_worker_base():
    """verl's actor worker with split forward_backward / optimizer_step primitives."""
    from verl.workers.engine_workers_tinker import TinkerActorRolloutRefWorker

    return TinkerActorRolloutRefWorker


def verl_worker_base():
    """verl's bare ``Worker`` (rank, world size, dispatch registration): the base of a worker group's class."""
    from verl.single_controller.base import Worker

    return Worker


def worker_register_api():
    """``(register, Dispatch, actor_mesh_dispatch)``: verl's seams for registered worker methods; the third is
    ``actor_mesh_dispatch()``, verl's actor-mesh dispatch for the per-chunk streaming calls."""
    from verl.single_controller.base.decorator import Dispatch, register

    return register, Dispatch, actor_mesh_dispatch()


def actor_mesh_dispatch() -> dict:
    """verl's ``make_nd_compute_dataproto_dispatch_fn("actor")`` for calls that carry one small chunk, many a step.

    Each part goes to the ranks of its data-parallel rank, and results are collected by verl's own collect, as
    there. Two costs of verl's dispatch are left out, both paid on the driver per call: the split when there is one
    part (verl re-chunks the nested tensors into one copy), and the ``ray.put`` of every part through a fresh
    thread pool (``parallel_put``): a part for one rank travels inside the call, a part that several ranks share
    (tensor/pipeline peers) is put once. A ``DataParallelParts`` argument (one part per dp rank, built so by the
    driver) is not split at all; any other batch with several parts is split by verl's own split.
    """
    from functools import partial

    import ray
    from verl.single_controller.base import decorator as verl_dispatch

    def dispatch(worker_group, *args, **kwargs):
        dp_size = _mesh_dp_size(worker_group, "actor")
        mapping = worker_group._dispatch_info["actor"]
        if any(isinstance(v, DataParallelParts) for v in (*args, *kwargs.values())):  # built per rank by the driver
            parts = [_given_parts(arg, dp_size) for arg in args]
            kw_parts = {k: _given_parts(v, dp_size) for k, v in kwargs.items()}
        elif dp_size == 1:
            parts, kw_parts = [[arg] for arg in args], {k: [v] for k, v in kwargs.items()}
        else:
            parts, kw_parts = verl_dispatch._split_args_kwargs_data_proto(dp_size, *args, **kwargs)
        shared = len(mapping) > dp_size

        def per_rank(part: list) -> list:
            part = [ray.put(x) for x in part] if shared else part
            return [part[mapping[rank]] for rank in range(worker_group.world_size)]

        return tuple(per_rank(p) for p in parts), {k: per_rank(p) for k, p in kw_parts.items()}

    return {"dispatch_fn": dispatch, "collect_fn": partial(verl_dispatch.collect_lazy_compute_data_proto, "actor")}


class DataParallelParts(list):
    """A call's argument already cut into one part per data-parallel rank (in dp-rank order), e.g. a streamed chunk
    built part by part (``chunk_layout.build_stream_parts``): ``actor_mesh_dispatch`` hands part i to the ranks of
    dp rank i as it is, without verl's split of the whole batch (which re-chunks every nested tensor per call)."""


def _given_parts(value, dp_size: int) -> list:
    """``value``'s parts: its own for ``DataParallelParts`` (one per dp rank), else the same value for every rank."""
    if not isinstance(value, DataParallelParts):
        return [value] * dp_size
    if len(value) != dp_size:
        raise ValueError(f"{len(value)} pre-split parts for {dp_size} data-parallel ranks: build one part per rank "
                         "(stream_exec reads the count from actor_dp_size)")
    return list(value)


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
    """Rebuild the actor from its checkpoint path: fresh weights, optimizer and LR scheduler.

    Torch's RNG is seeded first: a LoRA adapter (``model.lora_rank > 0``) is initialised at random by peft when
    verl builds the engine, and every reset must give the same adapter for two runs to start from one policy.
    """
    import torch

    torch.manual_seed(RESET_SEED)
    worker.actor.reset()


RESET_SEED = 0  # the torch seed every ``reset_actor`` starts from (LoRA's random lora_A init)


def lora_adapter_push(worker):
    """A LoRA actor's adapter as verl's naive sync pushes it once the rollout holds the base weights:
    ``(iterable of (peft name, full CPU tensor), peft config dict)``. None when the actor has no peft adapter (no
    LoRA, or verl's Megatron engine) or ``model.lora.merge`` asks for verl's merged weights."""
    engine = worker.actor.engine
    module = getattr(engine.module, "_fsdp_wrapped_module", engine.module)
    if not hasattr(module, "peft_config") or (engine.model_config.lora or {}).get("merge", False):
        return None
    return engine.get_per_tensor_param(base_sync_done=True)


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


def rollout_correction(data, rollout_corr: dict):
    """verl's trainer-side rollout correction on a DataProto holding ``old_log_probs`` and ``rollout_log_probs``:
    ``(data, metrics)`` with ``rollout_is_weights`` added (and ``response_mask`` changed by rejection sampling)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    return compute_rollout_correction_and_add_to_batch(data, rollout_corr)


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
    """The Megatron engine's facts for ``learner/engine_rules.py`` (its keys ``FACTS``, less what the learner reads
    from its own chunks): ``{name: value}``."""
    cfg = engine.engine_config
    return {"param_offload": bool(engine.is_param_offload_enabled),
            "virtual_pipeline_model_parallel_size": cfg.virtual_pipeline_model_parallel_size,
            "use_megatron_fsdp": bool(getattr(cfg, "use_megatron_fsdp", False)),
            "dynamic_context_parallel": bool(getattr(cfg, "dynamic_context_parallel", False)),
            "auxiliary_losses": megatron_auxiliary_losses(engine),
            "per_token_loss": megatron_per_token_loss(engine),
            "use_remove_padding": bool(getattr(cfg, "use_remove_padding", True))}  # set from actor_rollout_ref.model


# -- Megatron's per-token-loss regime (tf_config.calculate_per_token_loss) ------------------------
# verl's ``postprocess_micro_batch_func`` then returns ``(loss * routed_num_tokens / dp_size, local tokens,
# output)``: Megatron neither divides by the micro-batch count nor averages over data-parallel ranks, and
# ``finalize_model_grads`` divides the summed gradient by the call's total token count.
def megatron_per_token_loss(engine) -> bool:
    """Whether verl's Megatron engine runs Megatron's per-token-loss regime."""
    return bool(getattr(getattr(engine, "tf_config", None), "calculate_per_token_loss", False))


def megatron_dp_size(engine) -> int:
    """The data-parallel size verl's Megatron engine writes into every batch (``dp_size``)."""
    return int(engine.get_data_parallel_size())


def megatron_auxiliary_losses(engine) -> str | None:
    """The losses Megatron scales inside the schedule (MoE router aux / z loss, MTP), as ``name=value``; else None.
    A load-balancing coefficient counts only where the router applies it: for the loss its
    ``moe_router_load_balancing_type`` names (verl 0.9.1 builds MoE models with ``none``)."""
    from thundersync_verl.core.config_validation import balancing_loss_coeffs

    tf = getattr(engine, "tf_config", None)
    found = []
    if getattr(tf, "num_moe_experts", None):
        aux = getattr(tf, "moe_aux_loss_coeff", 0.0) or 0.0
        if balancing_loss_coeffs(getattr(tf, "moe_router_load_balancing_type", "aux_loss"), aux):  # Megatron's default
            found.append(f"moe_aux_loss_coeff={aux}")
        if getattr(tf, "moe_z_loss_coeff", None):
            found.append(f"moe_z_loss_coeff={tf.moe_z_loss_coeff}")
    mtp = getattr(getattr(engine, "model_config", None), "mtp", None)
    if mtp is not None and getattr(mtp, "enable", False) and getattr(mtp, "enable_train", False):
        found.append("mtp.enable_train=True")
    return ", ".join(found) or None


def _divide_grad_fn():
    """``f(x, d) = x`` whose backward divides the incoming gradient by the tensor ``d`` (true division)."""
    import torch

    class DivideGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, loss, divisor):
            ctx.save_for_backward(divisor)
            return loss.clone()

        @staticmethod
        def backward(ctx, grad):
            (divisor,) = ctx.saved_tensors
            return grad / divisor, None

    return DivideGrad


def megatron_per_token_seed(data, like):
    """What the backward seeds a loss with in verl's per-token regime: d(loss * routed_num_tokens / dp_size)/d(loss).

    verl's expression replayed on a probe with ``like``'s dtype and device (the same kernels round the same way),
    so dividing the incoming gradient by it gives exactly 1 (times Megatron's loss scale, a power of two).
    """
    import torch

    routed = non_tensor(data, "routed_num_tokens")
    if routed is None:
        raise RuntimeError("verl's per-token-loss regime left no routed_num_tokens in the micro-batch")
    dp_size = non_tensor(data, "dp_size", 1)
    probe = torch.ones((), dtype=like.dtype, device=like.device, requires_grad=True)
    with torch.enable_grad():
        (probe * routed / dp_size).backward()
    return probe.grad.detach()


def _unit_seed_loss(loss_function):
    def loss_fn(model_output, data, dp_group=None):
        loss, metrics = loss_function(model_output=model_output, data=data, dp_group=dp_group)
        return _divide_grad_fn().apply(loss, megatron_per_token_seed(data, loss)), metrics

    return loss_fn


@contextlib.contextmanager
def megatron_unit_seed_losses(engine):
    """Within: the loss of every training micro-batch reaches the backward with seed exactly 1 (per-token regime).

    verl multiplies each loss by the CALL's ``routed_num_tokens / dp_size`` (a different factor every streamed
    call) for ``finalize_model_grads`` to divide by the call's token total. Here the loss keeps its value, and its
    gradient is divided by exactly the factor verl applies: the grad buffer receives what the loss itself says.
    """
    had = "postprocess_micro_batch_func" in vars(engine)
    original = engine.postprocess_micro_batch_func

    def postprocess(output, data, forward_only, loss_function, **kwargs):
        if loss_function is not None and not forward_only:
            loss_function = _unit_seed_loss(loss_function)
        return original(output, data, forward_only=forward_only, loss_function=loss_function, **kwargs)

    engine.postprocess_micro_batch_func = postprocess
    try:
        yield
    finally:
        if had:
            engine.postprocess_micro_batch_func = original
        else:
            del engine.postprocess_micro_batch_func
