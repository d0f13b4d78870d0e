"""The plugin's config rules on verl's driver, before ``ray.init``: every mode, one error.

Why:
1. ``thundersync.*`` and ``swe.*`` are read inside Ray workers (the agent loops, the trainer actor), so a
   bad value used to fail there, minutes in, wrapped in a Ray traceback, after Ray, the engines and the
   rollout had started; ``mode=thundersync`` with a loss, correction or setting the streaming trainer
   cannot stream was refused only once the trainer ran.
2. ``check_run_config`` runs the same rules those places run (nothing is restated here): the sections'
   own classes (``ThunderSyncConfig``, ``SWEConfig``: types, ranges, unknown keys), the
   ``reward_in_agent_loop`` refusal of patch 8, and in ``trainer.v1.trainer_mode=thundersync`` the
   trainer's ``validate_thundersync_config`` (the streaming, SAO and OPD rules). The first refusal is
   raised as one ``StreamingConfigError`` in rule / why / fix form, naming the key.
3. It runs on the driver through ``verl_patches.patch_launch_config_check`` (verl's ``validate_config``,
   which ``main_ppo`` calls right before ``ray.init``); ``recipes.rules`` (``thundersync recipes check``)
   runs the same function on every shipped recipe.
4. A LoRA run on a CPU rollout backend is refused (``cpu_rollout_lora``): those backends serve full weights only.
5. In thundersync mode the learner's planned bucket peak is checked too (``bucket_check.py``): above
   ``thundersync.memory_budget_bytes`` or above the host memory, the run is refused before it starts.
"""

from __future__ import annotations

from typing import Any

from thundersync_verl.config import ThunderSyncConfig
from thundersync_verl.core.errors import StreamingConfigError, rule_message
from thundersync_verl.envs.swe.swe_config import SWEConfig
from thundersync_verl.verl_adapter.bucket_check import check_bucket_memory
from thundersync_verl.core.config_validation import config_value as _get

OWN_SECTIONS = {"thundersync": ThunderSyncConfig, "swe": SWEConfig}  # top-level sections this project adds to verl's



def own_section_errors(config: Any) -> list[StreamingConfigError]:
    """Each of this project's sections built by its own class; the refusals, one per section."""
    errors = []
    for cls in OWN_SECTIONS.values():
        try:
            cls.from_verl(config)
        except StreamingConfigError as err:
            errors.append(err)
    return errors


def reward_in_agent_loop(config: Any) -> bool:
    """``thundersync.reward_in_agent_loop`` of a run's config; refused with a reward model (patch 8)."""
    if not ThunderSyncConfig.from_verl(config).reward_in_agent_loop:
        return False
    if _get(config, "reward.reward_model.enable", False):
        raise StreamingConfigError(rule_message(
            "thundersync.reward_in_agent_loop=true cannot be used with reward.reward_model.enable=true",
            "a reward model's scores come from its own servers, so there is no reward function to run in the agent loop",
            "set thundersync.reward_in_agent_loop=false (verl's reward workers then call the reward model)"))
    return True


def streams(config: Any) -> bool:
    """Whether the run's trainer is ThunderSync's (``mode=thundersync`` sets ``trainer.v1.trainer_mode``)."""
    return _get(config, "trainer.v1.trainer_mode") == "thundersync"


CPU_ROLLOUTS = ("hf_cpu", "replay")  # this project's rollout backends (backends/cpu, backends/replay)


def lora_rank(config: Any) -> int:
    """The run's LoRA rank (``model.lora_rank`` or ``model.lora.rank``; an adapter path counts as LoRA)."""
    model = "actor_rollout_ref.model"
    rank = max(int(_get(config, f"{model}.lora_rank", 0) or 0), int(_get(config, f"{model}.lora.rank", 0) or 0))
    return rank or (1 if _get(config, f"{model}.lora_adapter_path") is not None else 0)


def cpu_rollout_lora(config: Any) -> None:
    """The CPU rollout backends hold the base model's weights only: a LoRA run is refused before it starts (it
    used to fail at the first weight push, in every mode, with a KeyError on ``...base_layer.weight``)."""
    name = _get(config, "actor_rollout_ref.rollout.name")
    if name in CPU_ROLLOUTS and lora_rank(config) > 0:
        raise StreamingConfigError(rule_message(
            f"actor_rollout_ref.rollout.name={name} does not serve LoRA adapters (lora_rank={lora_rank(config)})",
            "the CPU rollout loads the base model and receives full weights; verl pushes LoRA runs' weights as "
            "adapter tensors (base_layer / lora_A / lora_B), which it cannot place",
            "set actor_rollout_ref.model.lora_rank=0 for a CPU run, or use rollout.name=vllm on a GPU"))


def check_run_config(config: Any) -> None:
    """Every rule of this plugin on a run's config (hydra ``DictConfig`` or plain mapping), in the order the
    run would meet them; raises the first refusal, a ``StreamingConfigError`` naming the key and the fix."""
    errors = own_section_errors(config)
    if errors:
        raise errors[0]
    reward_in_agent_loop(config)
    cpu_rollout_lora(config)
    if streams(config):
        from omegaconf import OmegaConf

        from thundersync_verl.step.thundersync_trainer import validate_thundersync_config

        validate_thundersync_config(config if OmegaConf.is_config(config) else OmegaConf.create(config))
        check_bucket_memory(config)  # planned bucket peak vs thundersync.memory_budget_bytes and host memory
