"""Every runtime patch thundersync_verl applies to verl or torch, in one place.

Each patch is listed, with the reason it exists and the upstream fix that would remove it, in
``patches/README.md``; ``APPLIED`` records which ones ran in a process. Where they apply:
- CPU platform only (1, 2, 5, 7, 10): ``apply_cpu_patches``, which the plugin calls only when the CPU
  platform is active; a GPU machine never runs them. It also applies the Megatron-on-CPU patches
  (``backends/megatron/cpu_patches.py``, listed there and in ``patches/README.md``).
- Every platform (3, 4, 6, 8, 9): the plugin applies them unconditionally. None changes what verl
  computes: 3 adds a metric, 4 skips a teacher request whose reply the agent loop already holds,
  6 hands the critic's values to the ``sao`` estimator (other estimators unchanged), 8 (only with
  ``thundersync.reward_in_agent_loop=true``) runs verl's own reward code in another process, 9 refuses
  a config this plugin's workers would refuse, earlier (on the driver).

1. ``gloo_backend_string`` (CPU only): verl builds ``cpu:gloo,{device}:{backend}``; with the
   CPU platform that is ``cpu:gloo,cpu:gloo``, which torch rejects. Collapse a
   backend string whose entries all name the same backend to that backend.
2. ``fsdp_engines_on_cpu`` (CPU only): verl registers its FSDP engines for cuda/npu only;
   register the same classes for ``cpu`` right after verl's engine module is
   imported (a post-import hook: the module must be imported by verl itself, after
   the platform is known, because it caches the device name at import).
3. ``logprob_diff_metric`` (every platform): verl reports the rollout-vs-learner gap in probability
   space only; add ``training/rollout_logprob_diff_max`` (max |log p_rollout - log p_learner|
   over response tokens), the figure that shows rollout and learner hold the same weights.
   Metric only: it reads the batch and changes nothing.
4. ``reuse_turn_teacher_scores`` (every platform): in ThunderSync OPD the agent loop already holds
   verl's teacher reply for the whole trajectory (its last turn's prefix), so verl's
   ``AgentLoopWorker._compute_teacher_logprobs`` is skipped for the outputs our agent loop flags;
   every other output (other agent loops, validation) goes through verl unchanged.
5. ``fsdp2_offload_unpinned`` (CPU only): verl builds every forward-only FSDP2 engine (the reference
   model of ``use_kl_loss``) with ``CPUOffloadPolicy(pin_memory=True)``; pinning host memory needs an
   accelerator, so the reference worker failed to start on the CPU platform. The same policy is used
   with ``pin_memory=False`` (the parameters already live in host memory: nothing to pin for).
6. ``sao_critic_values`` (every platform): verl's ``compute_advantage`` passes the critic's values
   only to its built-in GAE; for ``algorithm.adv_estimator=sao`` it now passes values, gamma and lam
   to the registered estimator (``thundersync_verl/algos/sao/sao_verl.py``). Every other estimator goes through unchanged.
7. ``valuehead_sdpa_on_cpu`` (CPU only): verl's ``load_valuehead_model`` (the critic's value model)
   hard-codes ``attn_implementation="flash_attention_2"``, which needs a GPU, and then falls back to
   ``trl`` (not a verl dependency), so the critic worker failed to build on the CPU. The same
   ``AutoModelForTokenClassification`` is loaded with the config's own attention (``sdpa`` by default).
8. ``reward_in_agent_loop`` (every platform; inactive unless ``thundersync.reward_in_agent_loop=true``):
   verl scores each finished trajectory by a Ray call from the agent-loop worker to a ``RewardLoopWorker``
   actor (``AgentLoopWorker._compute_score``). With the key set, the worker's reward handles are replaced
   by one in-process stand-in that runs verl's ``RewardLoopWorker`` class itself in the agent-loop process:
   the same reward manager, the same DataProto, the same result; one actor round trip and one
   serialisation less per trajectory, which is time on the path from a trajectory's end to its backward
   pass. A reward model (``reward.reward_model.enable``) is refused: its scores come from servers.
9. ``launch_config_check`` (every platform): the ``thundersync.*`` / ``swe.*`` sections are read inside Ray
   workers (agent loops, the trainer), so a bad value failed there, wrapped in a Ray traceback, after Ray,
   the engines and the rollout had started. verl's ``validate_config`` (``verl.utils.config``), which its
   drivers (``main_ppo.main``) call right before ``run_ppo`` -> ``ray.init``, first runs this plugin's rules
   (``launch_check.check_run_config``: the sections' classes, patch 8's refusal, and in thundersync mode the
   trainer's ``validate_thundersync_config``); the first refusal is raised there, as one error.
10. ``replay_buffer_batch_order`` (CPU only): verl's V1 ``ReplayBuffer`` hands the trainer a batch whose rows
   follow the order their tags reached TransferQueue, i.e. the order trajectories finished, and a replayed
   recording hands a prompt's recorded answers to its sessions in the order they ask. Two Sync runs on one
   recording then sum their gradients in other orders and differ by rounding, so every e2e floor (verl's own
   Sync against Sync) moved about 10x between runs. The batch's rows are put in the order the trainer submitted
   their prompts (the prompt keys' order in TransferQueue), then by response tokens, then output index: the same
   rows, the same update up to summation order, and one order for every run. The selected prompts are unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from thundersync_verl.verl_adapter.patch_hooks import APPLIED, when_imported  # noqa: F401 (re-exported: the patch record)

logger = logging.getLogger(__name__)


def normalise_backend(backend):
    """'cpu:gloo,cpu:gloo' -> 'gloo'; anything else unchanged."""
    if not isinstance(backend, str) or "," not in backend:
        return backend
    names = {part.split(":")[-1] for part in backend.split(",")}
    return names.pop() if len(names) == 1 else backend


def patch_gloo_backend_string() -> None:
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, "_thundersync_patched", False):
        return

    def init_process_group(*args, **kwargs):
        if args:
            args = (normalise_backend(args[0]),) + tuple(args[1:])
        if "backend" in kwargs:
            kwargs["backend"] = normalise_backend(kwargs["backend"])
        return original(*args, **kwargs)

    init_process_group._thundersync_patched = True
    init_process_group.__wrapped__ = original
    dist.init_process_group = init_process_group
    APPLIED.append("gloo_backend_string")


def patch_fsdp_engines_on_cpu() -> None:
    from thundersync_verl import verl_adapter as va

    def _register(_module):
        va.register_fsdp_engines_for("cpu")
        APPLIED.append("fsdp_engines_on_cpu")

    when_imported(va.ENGINE_MODULE, _register)


def patch_fsdp2_offload_unpinned() -> None:
    from thundersync_verl import verl_adapter as va

    def _wrap(module):
        original = getattr(module, "CPUOffloadPolicy", None)
        if original is None or getattr(original, "_thundersync_patched", False):
            return

        def unpinned_policy(pin_memory: bool = True):  # torch's own policy object, host memory not pinned (point 5)
            return original(pin_memory=False)

        unpinned_policy._thundersync_patched = True  # verl only constructs it here: torch's isinstance checks still hold
        module.CPUOffloadPolicy = unpinned_policy
        APPLIED.append("fsdp2_offload_unpinned")

    when_imported(va.ENGINE_MODULE, _wrap)


def _logprob_diff_max(data) -> float:
    import torch

    batch = data.batch
    rollout, learner = batch["rollout_log_probs"], batch["old_log_probs"]  # [B, T]
    mask = batch["response_mask"][:, -rollout.shape[1]:].bool() if "response_mask" in batch else torch.ones_like(rollout, dtype=torch.bool)
    if not mask.any():
        return float("nan")
    return float((rollout - learner).abs()[mask].max())


def patch_logprob_diff_metric() -> None:
    def _wrap(module):
        original = module.calculate_debug_metrics
        if getattr(original, "_thundersync_patched", False):
            return

        def calculate_debug_metrics(data):
            metrics = original(data)
            metrics["training/rollout_logprob_diff_max"] = _logprob_diff_max(data)
            return metrics

        calculate_debug_metrics._thundersync_patched = True
        module.calculate_debug_metrics = calculate_debug_metrics
        APPLIED.append("logprob_diff_metric")

    when_imported("verl.utils.debug.metrics", _wrap)


TEACHER_REUSED_KEY = "thundersync_teacher_reused"  # AgentLoopOutput.extra_fields flag set by our agent loop


def patch_reuse_turn_teacher_scores() -> None:
    """Skip verl's whole-trajectory teacher call when the agent loop already holds its exact reply.

    In ThunderSync OPD the agent loop scores every turn's causal prefix with verl's own teacher client;
    the last turn's prefix IS the trajectory, so its reply is what ``_compute_teacher_logprobs`` would
    fetch again. The agent loop stores it (``teacher_ids`` / ``teacher_logprobs``, verl's shapes) and
    sets ``TEACHER_REUSED_KEY``; only then is verl's call skipped (any other agent loop is unaffected).
    """
    def _wrap(module):
        cls = module.AgentLoopWorker
        original = cls._compute_teacher_logprobs
        if getattr(original, "_thundersync_patched", False):
            return

        async def _compute_teacher_logprobs(self, output, *args, **kwargs):
            fields = getattr(output, "extra_fields", None) or {}
            flag = fields.pop(TEACHER_REUSED_KEY, None)
            if flag is not None:  # only outputs of our agent loop carry the flag
                if flag and not kwargs.get("validate", False) and "teacher_ids" in fields and "teacher_logprobs" in fields:
                    return None
                fields.pop("teacher_ids", None), fields.pop("teacher_logprobs", None)  # verl decides, as unpatched
            return await original(self, output, *args, **kwargs)

        _compute_teacher_logprobs._thundersync_patched = True
        cls._compute_teacher_logprobs = _compute_teacher_logprobs
        APPLIED.append("reuse_turn_teacher_scores")

    when_imported("verl.experimental.agent_loop.agent_loop", _wrap)


class InProcessRewardWorker:
    """Stands where verl keeps a ``RewardLoopWorker`` actor handle: ``compute_score.remote(data)`` is awaitable.

    verl's ``RewardLoopWorker`` is built on the first call, on the running event loop: its reward manager
    captures the loop it finds at construction and runs blocking reward functions in that loop's executor,
    so a call from another loop (an agent-loop worker keeps one for its life) gets a worker of its own.
    """

    def __init__(self, config) -> None:
        self.config = config
        self.worker = None
        self.loop = None
        self.calls = 0
        self.compute_score = _RemoteLike(self._compute_score)

    async def _compute_score(self, data):
        loop = asyncio.get_running_loop()
        if self.worker is None or self.loop is not loop:  # built synchronously: no call interleaves before it is set
            from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

            self.worker, self.loop = RewardLoopWorker(self.config, None), loop
        self.calls += 1
        return await self.worker.compute_score(data)


class _RemoteLike:
    """``method.remote(*args)`` returns the coroutine, which verl awaits like an ObjectRef."""

    def __init__(self, fn) -> None:
        self.remote = fn


def reward_in_agent_loop(config) -> bool:
    """``thundersync.reward_in_agent_loop`` of a run's config; refused with a reward model (patch 8).

    The rule lives with the other launch rules (``launch_check.py``), which the driver runs before ``ray.init``.
    """
    from thundersync_verl.verl_adapter.launch_check import reward_in_agent_loop as rule

    return rule(config)


def patch_reward_in_agent_loop() -> None:
    """Score trajectories in the agent-loop process when ``thundersync.reward_in_agent_loop`` is set (patch 8)."""
    def _wrap(module):
        cls = module.AgentLoopWorker
        original = cls.__init__
        if getattr(original, "_thundersync_patched", False):
            return

        def __init__(self, config, *args, **kwargs):
            original(self, config, *args, **kwargs)
            if reward_in_agent_loop(config) and self.reward_loop_worker_handles is not None:
                self.reward_loop_worker_handles = [InProcessRewardWorker(config)]

        __init__._thundersync_patched = True
        cls.__init__ = __init__
        APPLIED.append("reward_in_agent_loop")

    when_imported("verl.experimental.agent_loop.agent_loop", _wrap)


def patch_launch_config_check() -> None:
    """Run the plugin's config rules in verl's driver-side ``validate_config``, before ``ray.init`` (patch 9).

    verl's ``main_ppo`` binds ``validate_config`` from ``verl.utils.config`` when it is imported, after the
    plugin (``python -m verl.trainer.main_ppo`` runs it as ``__main__``, so its ``run_ppo`` cannot be
    wrapped beforehand); the package's re-export ``verl.utils.validate_config`` is replaced too.
    """
    def _wrap(module):
        import sys

        original = module.validate_config
        if getattr(original, "_thundersync_patched", False):
            return

        def validate_config(config, *args, **kwargs):
            from thundersync_verl.core.errors import StreamingConfigError
            from thundersync_verl.verl_adapter.launch_check import check_run_config

            try:
                check_run_config(config)
            except StreamingConfigError as err:  # one error, raised here: no chain, no frames of the rule table
                raise err.with_traceback(None) from None
            return original(config, *args, **kwargs)

        validate_config._thundersync_patched = True
        validate_config.__wrapped__ = original  # the recipe check calls verl's own (it runs the rules itself)
        validate_config.__doc__ = original.__doc__
        module.validate_config = validate_config
        package = sys.modules.get(module.__name__.rpartition(".")[0])
        if getattr(package, "validate_config", None) is original:
            package.validate_config = validate_config
        APPLIED.append("launch_config_check")

    when_imported("verl.utils.config", _wrap)


def patch_sao_critic_values() -> None:
    """Hand the critic's values to the ``sao`` estimator (verl gives them to its built-in GAE only)."""
    def _wrap(module):
        from thundersync_verl.algos.sao.sao_verl import with_critic_values

        if not getattr(module.compute_advantage, "_thundersync_patched", False):
            module.compute_advantage = with_critic_values(module.compute_advantage)
            APPLIED.append(f"sao_critic_values:{module.__name__}")

    when_imported("verl.trainer.ppo.ray_trainer", _wrap)  # defines it
    when_imported("verl.trainer.ppo.v1.utils", _wrap)  # the V1 trainers call the copy it imported


def patch_valuehead_sdpa_on_cpu() -> None:
    """Load the critic's value model with a CPU attention (verl asks for flash_attention_2)."""
    def _wrap(module):
        if getattr(module.load_valuehead_model, "_thundersync_patched", False):
            return

        def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
            from transformers import AutoModelForTokenClassification

            attn = getattr(model_config, "_attn_implementation", None)
            attn = attn if attn in ("sdpa", "eager") else "sdpa"
            return AutoModelForTokenClassification.from_pretrained(
                pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
                attn_implementation=attn, trust_remote_code=trust_remote_code)

        load_valuehead_model._thundersync_patched = True
        module.load_valuehead_model = load_valuehead_model
        APPLIED.append("valuehead_sdpa_on_cpu")

    when_imported("verl.utils.model", _wrap)


def batch_key_order(keys: list[str], prompt_rank: dict[str, int], responses: list[tuple]) -> list[int]:
    """Positions of ``{uid}_{session}_{index}`` keys sorted by (the prompt's rank, response tokens, index) (point 10)."""
    def rank(i: int):
        uid, _session, index = keys[i].rsplit("_", 2)
        return prompt_rank.get(uid, len(prompt_rank)), responses[i], int(index)

    return sorted(range(len(keys)), key=rank)


def patch_replay_buffer_batch_order() -> None:
    def _wrap(module):
        buffer_class = getattr(module, "ReplayBuffer", None)
        original = getattr(buffer_class, "_materialize_batch", None)
        if original is None or getattr(original, "_thundersync_patched", False):
            return

        def _materialize_batch(self, partition_id, selected_prompt_uids, partition_snapshot):
            meta = original(self, partition_id, selected_prompt_uids, partition_snapshot)
            if not meta.keys:
                return meta
            prompts = {uid: r for r, uid in enumerate(self.prompt_global_steps.get(partition_id, {}))}
            data = module.tq.kv_batch_get(keys=list(meta.keys), partition_id=partition_id, select_fields=["responses"])
            rows = data["responses"]
            rows = rows.unbind(0) if hasattr(rows, "unbind") else rows  # a nested tensor, or one tensor per row
            responses = [tuple(int(t) for t in row.reshape(-1).tolist()) for row in rows]
            order = batch_key_order(list(meta.keys), prompts, responses)
            return dataclasses.replace(meta, keys=[meta.keys[i] for i in order], tags=[meta.tags[i] for i in order])

        _materialize_batch._thundersync_patched = True
        buffer_class._materialize_batch = _materialize_batch
        APPLIED.append("replay_buffer_batch_order")

    when_imported("verl.trainer.ppo.v1.replay_buffer", _wrap)


def apply_cpu_patches() -> None:
    patch_gloo_backend_string()
    patch_replay_buffer_batch_order()
    patch_valuehead_sdpa_on_cpu()
    patch_fsdp_engines_on_cpu()
    patch_fsdp2_offload_unpinned()
    from thundersync_verl.backends.megatron import cpu_patches as megatron_cpu_patches

    megatron_cpu_patches.apply()  # verl's Megatron engine on the CPU (backends/megatron/cpu_patches.py)
