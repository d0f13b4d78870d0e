"""The plugin's config rules on verl's driver, before ``ray.init``: every mode, one error.

Why:
1. ``thundersync.*`` and ``swe.*`` are read inside Ray workers (the agent loops, the trainer actor), so a
   bad value used to fail there, minutes in, wrapped in a Ray traceback, after Ray, the engines and the
   rollout had started; ``mode=thundersync`` with a loss, correction or setting the streaming trainer
   cannot stream was refused only once the trainer ran.
2. ``check_run_config`` runs the same rules those places run (nothing is restated here): the sections'
   own classes (``ThunderSyncConfig``, ``SWEConfig``: types, ranges, unknown keys), the
   ``reward_in_agent_loop`` refusal of patch 8, and in ``trainer.v1.trainer_mode=thundersync`` the
   trainer's ``validate_thundersync_config`` (the streaming, SAO and OPD rules). Each refusal is a
   ``StreamingConfigError`` in rule / why / fix form, naming the key (several: point 6).
3. It runs on the driver through ``verl_patches.patch_launch_config_check`` (verl's ``validate_config``,
   which ``main_ppo`` calls right before ``ray.init``); ``recipes.rules`` (``thundersync recipes check``)
   runs the same function on every shipped recipe.
4. A LoRA run whose weight pushes would not bring the trained adapter to a CPU rollout (``hf_cpu``, ``replay``) is
   refused (``cpu_rollout_lora``): verl 0.9.1's checkpoint-engine push of a LoRA actor sends the frozen base weights
   and drops the adapter, so only verl's naive sync (Sync mode) and the ThunderSync learner's own push
   (``learner/streaming_worker.py`` point 6) reach these backends, which merge the adapter
   (``backends/lora_weights.py``); the LoRA they merge is the peft adapter of verl's FSDP engine
   (``model.lora_rank``). In thundersync mode a rollout of another kind gets verl's push, so LoRA there needs
   verl's merged push (``model.lora.merge=true``).
5. In thundersync mode the learner's planned bucket peak is checked too (``bucket_check.py``): above
   ``thundersync.memory_budget_bytes`` or above the host memory, the run is refused before it starts.
6. A config refused by several rules is refused once, naming every refusal (``run_config_errors``), so a user fixes
   them in one pass instead of meeting them launch after launch. A rule that refuses several settings of its own
   still names its first: the project's sections are read by their classes, and the other rules read them.
"""

from __future__ import annotations

from typing import Any

from thundersync_verl.backends.lora_weights import CPU_ROLLOUTS
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


def lora_rank(config: Any) -> int:
    """The run's LoRA rank (``model.lora_rank`` or ``model.lora.rank``; an adapter path counts as LoRA)."""
    model = "actor_rollout_ref.model"
    rank = max(int(_get(config, f"{model}.lora_rank", 0) or 0), int(_get(config, f"{model}.lora.rank", 0) or 0))
    return rank or (1 if _get(config, f"{model}.lora_adapter_path") is not None else 0)


def cpu_rollout_lora(config: Any) -> None:
    """Refuse a LoRA run whose rollout would never serve the trained adapter (point 4)."""
    name, model = _get(config, "actor_rollout_ref.rollout.name"), "actor_rollout_ref.model"
    cpu = name in CPU_ROLLOUTS
    if lora_rank(config) <= 0 or not (cpu or streams(config)):
        return  # no LoRA, or verl's own push to a rollout of its own
    strategy = _get(config, "actor_rollout_ref.actor.strategy", "fsdp")
    if cpu and (strategy not in ("fsdp", "fsdp2") or int(_get(config, f"{model}.lora_rank", 0) or 0) <= 0):
        raise StreamingConfigError(rule_message(
            f"actor_rollout_ref.rollout.name={name} merges the LoRA adapter of verl's FSDP engine "
            f"(actor_rollout_ref.model.lora_rank > 0); this run sets actor.strategy={strategy}, "
            f"model.lora_rank={_get(config, f'{model}.lora_rank', 0)}, model.lora.rank={_get(config, f'{model}.lora.rank', 0)}",
            "the FSDP engine builds its peft adapter from model.lora_rank (model.lora.* configures Megatron's LoRA, "
            "whose pushes the CPU rollout has not been checked with)",
            "set actor_rollout_ref.actor.strategy=fsdp2 and actor_rollout_ref.model.lora_rank=R (model.lora.rank=0), "
            "or actor_rollout_ref.model.lora_rank=0 and model.lora.rank=0 for no LoRA"))
    backend = _get(config, "actor_rollout_ref.rollout.checkpoint_engine.backend", "naive")
    if backend == "naive" or (cpu and streams(config)) or (not cpu and _get(config, f"{model}.lora.merge", False)):
        return
    raise StreamingConfigError(rule_message(
        f"a LoRA actor (lora_rank={lora_rank(config)}) cannot push its adapter to actor_rollout_ref.rollout.name={name} "
        f"through checkpoint_engine.backend={backend} in this mode",
        "verl 0.9.1's checkpoint-engine push of a LoRA actor sends the frozen base weights and drops the adapter: the "
        "rollout would serve the untrained model for the whole run",
        "use mode=sync or mode=thundersync with a CPU rollout (both push the adapter, which the rollout merges)"
        if cpu else "set actor_rollout_ref.model.lora.merge=true (verl then pushes the merged weights)"))


def tail_batching(config: Any) -> None:
    """``thundersync.tail.eta > 1`` is ThunderSync's: the other modes' trainers are verl's and would ignore it."""
    if ThunderSyncConfig.from_verl(config).tail.enabled and not streams(config):
        raise StreamingConfigError(rule_message(
            f"thundersync.tail.eta={ThunderSyncConfig.from_verl(config).tail.eta} (tail batching) is set in "
            f"trainer.v1.trainer_mode={_get(config, 'trainer.v1.trainer_mode')!r}",
            "only ThunderSync's trainer launches extra prompt groups and closes its batch on the first to complete; "
            "verl's trainers would silently train on every launched group",
            "use mode=thundersync, or set thundersync.tail.eta=1"))


def run_config_errors(config: Any) -> list[StreamingConfigError]:
    """Every refusal of this plugin's rules on a run's config, in the order the run would meet them (point 6):
    the project's sections first (each rule below reads them, so a refused section stops here), then each rule on
    its own."""
    errors = own_section_errors(config)
    if errors:
        return errors
    rules = [reward_in_agent_loop, cpu_rollout_lora, tail_batching]
    if streams(config):
        rules += [_trainer_rules, check_bucket_memory]  # planned bucket peak vs the budget and host memory
    for rule in rules:
        try:
            rule(config)
        except StreamingConfigError as err:
            errors.append(err)
    return errors


def check_run_config(config: Any) -> None:
    """Every rule of this plugin on a run's config (hydra ``DictConfig`` or plain mapping); raises a
    ``StreamingConfigError`` naming the key and the fix: the one refusal as it is, several as one error listing
    each (point 6)."""
    errors = run_config_errors(config)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise StreamingConfigError(f"{len(errors)} settings are refused; each names its key and fix:\n" + "\n".join(
            f"[{i}] " + str(err).replace("\n", "\n    ") for i, err in enumerate(errors, 1)))


def _trainer_rules(config: Any) -> None:
    """The streaming trainer's own rules (streaming, SAO, OPD), on the config as the trainer reads it."""
    from omegaconf import OmegaConf

    from thundersync_verl.step.thundersync_trainer import validate_thundersync_config

    validate_thundersync_config(config if OmegaConf.is_config(config) else OmegaConf.create(config))
