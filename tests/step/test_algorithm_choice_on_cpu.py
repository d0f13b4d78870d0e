"""The trainer's algorithm is chosen once from verl's config, and each implementation has every member it uses.

GPUs needed: 0 (CPU only). No Ray, no verl engine: the shipped recipes composed with Hydra.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from thundersync_verl.algos.opd.opd_trainer_step import OPDAlgorithm
from thundersync_verl.algos.sao.sao_trainer_step import SAOAlgorithm
from thundersync_verl.config import ThunderSyncConfig
from thundersync_verl.core import StreamingConfigError
from thundersync_verl.step.algorithm import choose_algorithm
from thundersync_verl.step.contracts import TrainerAlgorithm
from thundersync_verl.step.grpo_algorithm import GRPOAlgorithm

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "cpu_tiny"
TRAINER = Path(__file__).resolve().parents[2] / "thundersync_verl" / "step" / "thundersync_trainer.py"
BASE = ["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z", "mode=thundersync"]


def _cfg(recipe: str, *overrides: str):
    folder = RECIPES / "sao" if recipe == "sao" else RECIPES
    with initialize_config_dir(config_dir=str(folder), version_base=None):
        return compose(config_name=recipe, overrides=BASE + list(overrides))


def _members(protocol) -> set[str]:
    declared = {n for n, v in vars(protocol).items() if callable(v) or isinstance(v, property)}
    return (set(protocol.__annotations__) | declared) - {n for n in declared if n.startswith("_")}


@pytest.mark.parametrize("recipe, cls, name, record", [("grpo", GRPOAlgorithm, "grpo", "grpo"),
                                                       ("opd", OPDAlgorithm, "opd", "opd"),
                                                       ("sao", SAOAlgorithm, "sao", "grpo")])
def test_the_recipe_chooses_its_algorithm_and_its_planner(recipe, cls, name, record):
    config = _cfg(recipe)
    algo = choose_algorithm(config)
    assert type(algo) is cls and algo.name == name and algo.record_algo == record  # SAO's records keep "grpo"
    assert choose_algorithm(config) is not algo  # one per trainer: an algorithm may hold run state
    ts = ThunderSyncConfig.from_verl(config)
    algo.validate_settings(config, ts)
    algo.validate(config, ts)
    asked = []
    planner = algo.planner(config, ts, bucket_bytes=lambda: asked.append(1) or 4000)
    assert planner is not None and not asked  # no memory budget: the learner's bucket size is not asked for


def test_sao_and_opd_together_are_refused_naming_both_keys():
    config = _cfg("opd", "algorithm.adv_estimator=sao")
    with pytest.raises(StreamingConfigError, match=r"algorithm\.adv_estimator=sao and distillation\.enabled=true "
                                                   r"together(.|\n)*fix: set distillation\.enabled=false"):
        choose_algorithm(config)


def test_every_algorithm_has_every_member_the_trainer_uses():
    members = _members(TrainerAlgorithm)
    assert {"name", "record_algo", "validate_settings", "validate", "setup_workers", "llm_client", "planner",
            "arrivals", "values", "is_warmup_step", "warmup_step", "after_step"} <= members
    for algo in (GRPOAlgorithm(), OPDAlgorithm(), SAOAlgorithm()):
        missing = [m for m in members if not hasattr(algo, m)]
        assert not missing, (algo.name, missing)
        assert isinstance(algo, TrainerAlgorithm)


def test_the_neutral_hooks_leave_verl_alone():
    algo, mapping, client = GRPOAlgorithm(), {"actor": object()}, object()
    algo.setup_workers(mapping)
    assert list(mapping) == ["actor"] and algo.llm_client(client, trainer=None) is client
    assert algo.values(trainer=None) is None and algo.is_warmup_step(trainer=None) is False
    assert algo.after_step(None, "batch", {}, {}) == "batch"
    with pytest.raises(TypeError, match="no warm-up step"):
        algo.warmup_step(None, {}, {})


def test_the_grpo_planner_asks_the_learner_for_its_bucket_only_under_a_memory_budget():
    config = _cfg("grpo", "thundersync.memory_budget_bytes=16000")
    asked = []
    planner = choose_algorithm(config).planner(config, ThunderSyncConfig.from_verl(config),
                                               bucket_bytes=lambda: asked.append(1) or 4000)
    assert asked == [1] and planner is not None


def test_the_trainer_never_branches_on_the_algorithm():
    source = TRAINER.read_text()
    assert not re.findall(r"(?i)opd|sao", source), "thundersync_trainer.py names an algorithm: use self.algo"
    assert not re.findall(r"(?:hasattr|getattr)\((?:self\.)?algo\b", source)
