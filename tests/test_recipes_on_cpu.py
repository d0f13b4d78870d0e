"""Every shipped recipe composes against verl's own config tree, in every mode.

A recipe is a yaml with a ``defaults:`` list; files in a recipe's ``mode/`` folder are the options
of the ``mode=`` flag and are composed with each recipe. Any other yaml is reported, not skipped.
Every recipe composes the ``thundersync:`` section from the package's ``conf/thundersync/defaults.yaml``,
which lists each ``ThunderSyncConfig`` field at its default; recipes set only what they change, and a
key of the section is set in at most one recipe file.
The CPU recipes are composed here with their CPU settings asserted; every recipe (the GPU ones
included, all their variants) goes through ``thundersync recipes check`` in test_recipes_check_on_cpu.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
ALL_YAMLS = sorted(RECIPES.rglob("*.yaml"))
TOP = [p for p in ALL_YAMLS if "defaults:" in p.read_text()]
CPU_TOP = [p for p in TOP if "cpu_base: tiny" in p.read_text()]  # composes cpu_base/tiny.yaml (trainer.device: cpu)
DEFAULTS = Path(__file__).resolve().parents[1] / "thundersync_verl" / "conf" / "thundersync" / "defaults.yaml"
CASES = [(recipe, mode.stem) for recipe in CPU_TOP for mode in sorted((recipe.parent / "mode").glob("*.yaml"))]


def test_every_yaml_is_a_recipe_or_an_option_of_its_config_groups():
    from thundersync_verl.recipes.check import find_variants

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


def _leaves(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    else:
        yield ".".join(path), node


def test_the_thundersync_defaults_file_is_the_typed_config_at_its_defaults():
    import dataclasses

    import yaml

    from thundersync_verl.config import ThunderSyncConfig

    listed = dict(_leaves(yaml.safe_load(DEFAULTS.read_text())))
    typed = ThunderSyncConfig.from_verl({"thundersync": yaml.safe_load(DEFAULTS.read_text())})
    assert typed == ThunderSyncConfig()  # every value listed is the field's default
    for field in dataclasses.fields(ThunderSyncConfig):  # every field is listed, so every key can be overridden
        if not field.name.startswith("_"):
            assert any(k == field.name or k.startswith(field.name + ".") for k in listed), field.name


def test_every_thundersync_key_is_set_in_one_recipe_file_at_most():
    import yaml

    where: dict[str, list[str]] = {}
    for path in ALL_YAMLS:
        if path.is_symlink():
            continue  # a link is the file it points to
        doc = yaml.safe_load(path.read_text()) or {}
        section = doc.get("thundersync") if isinstance(doc, dict) else None
        for key, _ in _leaves(section or {}):
            where.setdefault(key, []).append(str(path.relative_to(RECIPES)))
    twice = {k: v for k, v in where.items() if len(v) > 1 and k != "mode"}  # mode: what each mode/ file selects
    assert not twice, f"thundersync keys set in several recipe files (set them once, or in conf/thundersync): {twice}"
    defaults = dict(_leaves(yaml.safe_load(DEFAULTS.read_text())))
    for key, files in where.items():
        value = next(v for k, v in _leaves((yaml.safe_load((RECIPES / files[0]).read_text()) or {})["thundersync"])
                     if k == key)
        assert key == "mode" or value != defaults.get(key, object()), (key, files, "sets the default again")
