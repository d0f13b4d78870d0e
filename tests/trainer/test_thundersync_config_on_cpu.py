"""Config validation of trainer mode ``thundersync``: each refusal names the key to change."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from thundersync_verl.core import StreamingConfigError
from thundersync_verl.demo import recipe_dir
from thundersync_verl.trainer.thundersync_trainer import validate_thundersync_config

BASE = ["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z", "mode=thundersync"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(recipe_dir()), version_base=None):
        return compose(config_name="grpo", overrides=BASE + list(overrides))


def test_the_shipped_thundersync_recipe_is_valid():
    validate_thundersync_config(_cfg())


@pytest.mark.parametrize(
    "override, key",
    [
        ("actor_rollout_ref.actor.ppo_epochs=2", "ppo_epochs"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=4", "ppo_mini_batch_size"),
        ("actor_rollout_ref.hybrid_engine=true", "hybrid_engine"),
        ("actor_rollout_ref.actor.use_kl_loss=true", "use_kl_loss"),
        ("actor_rollout_ref.actor.entropy_coeff=0.01", "entropy_coeff"),
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
