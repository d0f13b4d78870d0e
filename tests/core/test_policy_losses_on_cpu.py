"""The policy-loss table (core/policy_losses.py): verl's registry covered, refusals name the key and the reason."""

from __future__ import annotations

import pytest

from thundersync_verl.core import StreamingConfigError
from thundersync_verl.core.config_validation import validate_streaming_config
from thundersync_verl.core.policy_losses import LOSS_KEY, POLICY_LOSSES, check_policy_loss, format_table, streamed_policy_losses

GOOD = dict(ppo_epochs=1, ppo_mini_batch_size=16, train_batch_size=16, rollout_n=4)
OWN_LOSSES = {"sao"}  # registered by this package, streamed by its own trainer step (algos/sao)


def test_table_covers_verls_registry():
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    assert set(POLICY_LOSS_REGISTRY) - OWN_LOSSES == set(POLICY_LOSSES)


def test_streamed_list_and_listing():
    streamed = streamed_policy_losses()
    assert streamed[:3] == ["vanilla", "gpg", "bypass_mode"] and {"gspo", "cispo", "dro", "sapo"} <= set(streamed)
    assert not {"clip_cov", "kl_cov", "geo_mean"} & set(streamed)
    table = format_table()
    assert all(name in table for name in POLICY_LOSSES) and table.count("refused") == 3


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov", "geo_mean", "my_own_loss"])
def test_refused_losses_name_the_key_and_why(name):
    with pytest.raises(StreamingConfigError) as err:
        validate_streaming_config(**GOOD, policy_loss_mode=name)
    text = str(err.value)
    assert f"{LOSS_KEY}={name!r}" in text and "why:" in text and "fix:" in text and "gspo" in text
    if name in POLICY_LOSSES:
        assert POLICY_LOSSES[name].why in text


@pytest.mark.parametrize("name", ["gspo", "cispo", "dppo_tv", "dppo_kl"])
def test_row_local_losses_stream(name):
    s = validate_streaming_config(**GOOD, policy_loss_mode=name)
    assert s.ratio_is_one and s.loss_agg_mode == "token-mean"


def test_sapo_needs_its_own_agg_mode():
    with pytest.raises(StreamingConfigError, match="actor_rollout_ref.actor.loss_agg_mode='seq-mean-token-mean'"):
        validate_streaming_config(**GOOD, policy_loss_mode="sapo")
    validate_streaming_config(**GOOD, policy_loss_mode="sapo", loss_agg_mode="seq-mean-token-mean")


def test_dro_needs_a_positive_beta():
    with pytest.raises(StreamingConfigError, match="policy_loss.dro_beta"):
        validate_streaming_config(**GOOD, policy_loss_mode="dro")
    validate_streaming_config(**GOOD, policy_loss_mode="dro", dro_beta=0.1)


def test_new_losses_refuse_several_minibatches_vanilla_keeps_them():
    with pytest.raises(StreamingConfigError, match="one optimizer step per batch"):
        validate_streaming_config(**{**GOOD, "ppo_mini_batch_size": 8}, policy_loss_mode="gspo")
    validate_streaming_config(**{**GOOD, "ppo_mini_batch_size": 8}, policy_loss_mode="vanilla")
    assert check_policy_loss("gpg", loss_agg_mode="token-mean", optimizer_steps=4).minibatches


def test_cli_lists_the_table(capsys):
    from thundersync_verl.cli import main

    assert main(["recipes", "check", "--list-losses"]) == 0
    out = capsys.readouterr().out
    assert "gspo" in out and "clip_cov     refused" in out
