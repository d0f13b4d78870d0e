"""Every shipped recipe composes against verl's own config tree (no subfolder skipped)."""

from __future__ import annotations

from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
YAMLS = sorted(p for p in RECIPES.rglob("*.yaml"))


def test_recipes_exist():
    assert YAMLS, "no recipe yaml found under recipes/"


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_composes_with_verl_config(path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(path.parent), version_base=None):
        cfg = compose(config_name=path.stem, overrides=["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z"])
    OmegaConf.resolve(cfg)
    assert cfg.trainer.use_v1 is True
    assert cfg.actor_rollout_ref.rollout.name == "hf_cpu"
    assert cfg.actor_rollout_ref.actor.strategy == "fsdp2"
    assert cfg.thundersync.mode in ("sync", "async", "fully_async", "thundersync")
    assert cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"
