"""Every shipped recipe composes against verl's own config tree, in every mode.

A recipe is a yaml with a ``defaults:`` list; files in a recipe's ``mode/`` folder are the options
of the ``mode=`` flag and are composed with each recipe. Any other yaml is reported, not skipped.
The CPU recipes are composed here with their CPU settings asserted; every recipe (the GPU ones
included, all their variants) goes through ``thundersync recipes check`` in test_recipes_check_on_cpu.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
ALL_YAMLS = sorted(RECIPES.rglob("*.yaml"))
TOP = [p for p in ALL_YAMLS if "defaults:" in p.read_text()]
CPU_TOP = [p for p in TOP if "device: cpu" in p.read_text()]  # trainer.device: cpu
CASES = [(recipe, mode.stem) for recipe in CPU_TOP for mode in sorted((recipe.parent / "mode").glob("*.yaml"))]


def test_every_yaml_is_a_recipe_or_an_option_of_its_config_groups():
    from thundersync_verl.recipes_check import find_variants

    assert TOP and CPU_TOP, "no recipe yaml found under recipes/"
    _, unclassified = find_variants(RECIPES)
    assert not unclassified, f"unclassified yaml files: {unclassified}"


@pytest.mark.parametrize("recipe, mode", CASES, ids=lambda x: str(x.relative_to(RECIPES)) if isinstance(x, Path) else x)
def test_recipe_composes_with_verl_config(recipe, mode):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(recipe.parent), version_base=None):
        cfg = compose(config_name=recipe.stem, overrides=["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z", f"mode={mode}"])
    OmegaConf.resolve(cfg)
    assert cfg.trainer.use_v1 is True
    assert cfg.thundersync.mode == mode
    expected = {"sync": "sync", "async": "separate_async", "fully_async": "separate_async", "thundersync": "thundersync"}[mode]
    assert cfg.trainer.v1.trainer_mode == expected
    assert cfg.actor_rollout_ref.actor.strategy == "fsdp2"
    assert cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"
    if mode != "sync":
        assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "cpu_channel"
        assert cfg.ray_kwargs.ray_init.num_gpus >= 2  # a learner slot and a rollout slot
