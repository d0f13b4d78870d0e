"""verl settings that break streaming are refused with the key to change. No GPU, no Ray."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingConfigError
from thundersync_verl.step.stream_plan import StreamPlanner, settings_from_verl_config

ACTOR = "actor_rollout_ref.actor"


@pytest.fixture(scope="module")
def grpo_config():
    """verl's own ppo_trainer.yaml set up for streamed GRPO: one epoch, one mini-batch."""
    return va.compose_ppo_config([
        "algorithm.adv_estimator=grpo", "data.train_batch_size=8", f"{ACTOR}.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=4", f"{ACTOR}.ppo_micro_batch_size_per_gpu=4",
    ])


def _with(config, **changes):
    cfg = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    for key, value in changes.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    return cfg


def test_a_streamable_grpo_config_gives_settings_and_a_planner(grpo_config):
    settings = settings_from_verl_config(grpo_config)
    assert settings.loss_agg_mode == "token-mean" and settings.estimator.name == "grpo"
    planner = StreamPlanner.from_settings(settings)
    assert planner.loss_agg_mode == "token-mean" and planner.estimator.norm_by_std


@pytest.mark.parametrize(
    "changes, match",
    [
        ({f"{ACTOR}.ppo_epochs": 0}, "ppo_epochs=0 must be a positive int"),
        ({f"{ACTOR}.ppo_mini_batch_size": 3}, "ppo_mini_batch_size=3 must divide data.train_batch_size=8"),
        ({"algorithm.adv_estimator": "gae"}, "adv_estimator='gae' cannot be streamed"),
        ({f"{ACTOR}.policy_loss.loss_mode": "clip_cov"}, "loss_mode='clip_cov' cannot be streamed"),
        ({"algorithm.rollout_correction.rollout_is": "token", f"{ACTOR}.ppo_mini_batch_size": 4},
         "later mini-batches' PPO chunks carry no IS weights"),
        ({"algorithm.rollout_correction.rollout_is": "token", "algorithm.rollout_correction.rollout_is_batch_normalize":
          True}, "rollout_is_batch_normalize=true cannot be streamed"),
        ({"algorithm.rollout_correction.rollout_rs": "token_k1"}, "rejection sampling"),
        ({f"{ACTOR}.use_kl_loss": True, f"{ACTOR}.kl_loss_type": "full"}, "kl_loss_type='full' is unknown"),
        ({f"{ACTOR}.loss_agg_mode": "seq-mean-token-sum-norm"}, "loss_scale_factor"),
    ],
)
def test_settings_that_break_exactness_are_refused_naming_the_key(grpo_config, changes, match):
    with pytest.raises(StreamingConfigError, match=match) as info:
        settings_from_verl_config(_with(grpo_config, **changes))
    assert "fix:" in str(info.value)


@pytest.mark.parametrize("kl_type", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "low_var_kl+"])
def test_kl_loss_and_entropy_bonus_stream(grpo_config, kl_type):
    changes = {f"{ACTOR}.use_kl_loss": True, f"{ACTOR}.kl_loss_type": kl_type, f"{ACTOR}.entropy_coeff": 0.01}
    assert settings_from_verl_config(_with(grpo_config, **changes)).loss_agg_mode == "token-mean"


@pytest.mark.parametrize("level, threshold, bounds", [("token", 2.0, (2.0, None)), ("sequence", "0.5_2.0", (2.0, 0.5))])
def test_rollout_is_streams_in_one_mini_batch_and_reaches_the_worker_through_the_meta(grpo_config, level, threshold,
                                                                                      bounds):
    from thundersync_verl.step.stream_plan import rollout_correction_meta

    cfg = _with(grpo_config, **{"algorithm.rollout_correction.rollout_is": level,
                                "algorithm.rollout_correction.rollout_is_threshold": threshold})
    trainer = settings_from_verl_config(cfg)
    meta = rollout_correction_meta(cfg)
    assert meta == {"rollout_is": level, "rollout_is_threshold": threshold, "rollout_is_batch_normalize": False}
    worker = settings_from_verl_config(cfg.actor_rollout_ref, train_batch_size=8, **meta)  # what a worker holds
    for s in (trainer, worker):
        assert (s.rollout_is, s.rollout_is_upper, s.rollout_is_lower) == (level, *bounds)
    assert rollout_correction_meta(grpo_config) == {}
    assert settings_from_verl_config(grpo_config.actor_rollout_ref, train_batch_size=8).rollout_is is None


def test_worker_side_validation_uses_the_batch_meta(grpo_config):
    arr = grpo_config.actor_rollout_ref  # what a worker holds: no data/algorithm sections
    assert settings_from_verl_config(arr, train_batch_size=8).loss_agg_mode == "token-mean"
    assert settings_from_verl_config(arr, train_batch_size=16).loss_agg_mode == "token-mean"  # two mini-batches
    with pytest.raises(StreamingConfigError, match="must divide data.train_batch_size=12"):
        settings_from_verl_config(arr, train_batch_size=12)  # 1.5 mini-batches
    with pytest.raises(StreamingConfigError, match="asks for loss_agg_mode"):
        settings_from_verl_config(arr, loss_agg_mode="seq-mean-token-mean")
