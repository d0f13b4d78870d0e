"""Config validation of trainer mode ``thundersync``: each refusal names the key to change."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from thundersync_verl.core import StreamingConfigError
from thundersync_verl.demo import recipe_dir
from thundersync_verl.step.thundersync_trainer import validate_thundersync_config

BASE = ["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z", "mode=thundersync"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(recipe_dir()), version_base=None):
        return compose(config_name="grpo", overrides=BASE + list(overrides))


def test_the_shipped_thundersync_recipe_is_valid():
    validate_thundersync_config(_cfg())


@pytest.mark.parametrize(
    "override, key",
    [
        ("actor_rollout_ref.actor.ppo_epochs=0", "ppo_epochs"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=3", "ppo_mini_batch_size"),
        ("actor_rollout_ref.hybrid_engine=true", "hybrid_engine"),
        ("actor_rollout_ref.rollout.checkpoint_engine.backend=naive", "checkpoint_engine.backend"),
        ("actor_rollout_ref.rollout.n_gpus_per_node=0", "n_gpus_per_node"),
        ("thundersync.learner_forward=twice", "thundersync.learner_forward"),
        ("thundersync.pipeline_depth=0", "thundersync.pipeline_depth"),
        ("thundersync.pipeline_depth=1.5", "thundersync.pipeline_depth"),
        ("thundersync.coalesce=sometimes", "thundersync.coalesce"),
        ("actor_rollout_ref.rollout.calculate_log_probs=false", "calculate_log_probs"),
    ],
)
def test_incompatible_settings_are_refused_naming_the_key(override, key):
    with pytest.raises(StreamingConfigError, match=key.replace(".", r"\.")):
        validate_thundersync_config(_cfg(override))


def test_a_memory_budget_sizes_the_planner_to_the_learners_buckets():
    from thundersync_verl.config import ThunderSyncConfig
    from thundersync_verl.step.grpo_algorithm import build_planner

    cfg = _cfg("thundersync.memory_budget_bytes=16000")  # rollout.n = 4 buckets of 4000 bytes
    planner = build_planner(cfg, ThunderSyncConfig.from_verl(cfg), bucket_bytes=4000)
    planner.begin_batch({"g": 4, "h": 4})
    planner.arrive("g", "g0", 1.0, 3)
    planner.arrive("h", "h0", 0.0, 3)
    planner.next_ops()  # g opens (its bucket reserved); h waits: a second open group would exceed the budget
    assert planner.ready_count == 1 and planner.memory()["reserved_bytes"] <= 16000 + 4000
    unbudgeted = _cfg()
    assert build_planner(unbudgeted, ThunderSyncConfig.from_verl(unbudgeted)) is not None


def test_the_trainers_planner_sends_rollout_correction_to_the_learner():
    from thundersync_verl.config import ThunderSyncConfig
    from thundersync_verl.step.grpo_algorithm import build_planner

    cfg = _cfg("algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold='0.5_2.0'")
    meta = build_planner(cfg, ThunderSyncConfig.from_verl(cfg)).verl_settings  # what the step sends stream_begin_batch
    assert (meta["rollout_is"], meta["rollout_is_threshold"], meta["rollout_is_batch_normalize"]) == ("sequence", "0.5_2.0", False)
    assert "rollout_is" not in build_planner(_cfg(), ThunderSyncConfig.from_verl(_cfg())).verl_settings


def test_rollout_correction_without_rollout_log_probs_is_refused_at_start():
    cfg = _cfg("algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=false",
               "thundersync.learner_forward=separate")
    with pytest.raises(StreamingConfigError, match=r"rollout_is='token' needs the rollout's log-probs(.|\n)*"
                                                   r"set actor_rollout_ref.rollout.calculate_log_probs=true"):
        validate_thundersync_config(cfg)


def test_a_memory_budget_too_small_for_one_group_is_refused_naming_the_key():
    from thundersync_verl.config import ThunderSyncConfig
    from thundersync_verl.step.grpo_algorithm import build_planner

    cfg = _cfg("thundersync.memory_budget_bytes=4000")
    with pytest.raises(StreamingConfigError, match=r"thundersync.memory_budget_bytes=4000 cannot hold one open group"
                                                   r"(.|\n)*one bucket = 4000 bytes(.|\n)*fix: raise thundersync.memory_budget_bytes to at least 4 x 4000"):
        build_planner(cfg, ThunderSyncConfig.from_verl(cfg), bucket_bytes=4000)


def test_deterministic_order_is_refused_for_opd_turn_streaming():
    with initialize_config_dir(config_dir=str(recipe_dir()), version_base=None):
        cfg = compose(config_name="opd", overrides=BASE + ["thundersync.deterministic=true"])
    with pytest.raises(StreamingConfigError, match=r"thundersync\.deterministic=true orders whole trajectories"
                                                   r"(.|\n)*set thundersync\.deterministic=false for OPD"):
        validate_thundersync_config(cfg)
    validate_thundersync_config(_cfg("thundersync.deterministic=true"))  # GRPO: accepted
