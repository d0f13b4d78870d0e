"""``recipes/swe_smith/cpu_synthetic``: cpu_tiny's GRPO plus exactly the SWE keys, composable in every mode.

The recipe cannot inherit cpu_tiny/grpo.yaml through hydra (a non-primary config may not set
hydra.searchpath), so this test is what keeps the repeated block in step with it.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from thundersync_verl.config import ThunderSyncConfig
from thundersync_verl.envs.swe import swe_protocol as protocol
from thundersync_verl.envs.swe.swe_config import SWEConfig

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
MODES = sorted(p.stem for p in (RECIPES / "swe_smith" / "mode").glob("*.yaml"))
SWE_KEYS = ("swe.", "data.max_prompt_length", "data.max_response_length", "actor_rollout_ref.rollout.prompt_length",
            "actor_rollout_ref.rollout.response_length", "actor_rollout_ref.rollout.max_model_len",
            "actor_rollout_ref.rollout.agent.default_agent_loop", "actor_rollout_ref.rollout.n",
            "actor_rollout_ref.actor.rollout_n", "actor_rollout_ref.ref.rollout_n", "critic.rollout_n",
            "distillation.teacher_models.teacher_model.inference.prompt_length",
            "distillation.teacher_models.teacher_model.inference.response_length", "trainer.total_training_steps",
            "trainer.project_name", "trainer.default_local_dir", "actor_rollout_ref.rollout.trace.project_name")


def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def _compose(folder: str, name: str, mode: str):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    overrides = ["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z", f"mode={mode}",
                 "trainer.experiment_name=run"]
    with initialize_config_dir(config_dir=str(RECIPES / folder), version_base=None):
        cfg = compose(config_name=name, overrides=overrides)
    OmegaConf.resolve(cfg)
    return cfg


def test_thundersync_mode_is_cpu_tiny_grpo_plus_the_swe_keys():
    from omegaconf import OmegaConf

    grpo = _flat(OmegaConf.to_container(_compose("cpu_tiny", "grpo", "thundersync")))
    swe = _flat(OmegaConf.to_container(_compose("swe_smith", "cpu_synthetic", "thundersync")))
    changed = sorted(k for k in set(grpo) | set(swe) if grpo.get(k, "<absent>") != swe.get(k, "<absent>"))
    unexpected = [k for k in changed if not k.startswith(SWE_KEYS)]
    assert unexpected == [], f"cpu_synthetic.yaml drifted from cpu_tiny/grpo.yaml: {unexpected}"
    assert swe["actor_rollout_ref.rollout.agent.default_agent_loop"] == protocol.AGENT_NAME
    assert swe["swe.sandbox"] == "local" and swe["swe.max_context"] == swe["data.max_prompt_length"] + swe["data.max_response_length"]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_composes_for_a_cpu(mode):
    cfg = _compose("swe_smith", "cpu_synthetic", mode)
    assert cfg.thundersync.mode == mode and cfg.trainer.device == "cpu"
    assert cfg.actor_rollout_ref.actor.strategy == "fsdp2" and cfg.actor_rollout_ref.rollout.name == "hf_cpu"
    assert cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "cpu_channel"
    assert cfg.ray_kwargs.ray_init.num_gpus >= 2  # a learner slot and a rollout slot
    assert cfg.data.train_batch_size >= cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert cfg.actor_rollout_ref.rollout.max_model_len >= cfg.data.max_prompt_length + cfg.data.max_response_length
    settings = SWEConfig.from_verl(cfg)  # the swe section is typed and valid
    assert settings.sandbox == "local" and settings.max_turns >= 1
    ThunderSyncConfig.from_verl(cfg)
