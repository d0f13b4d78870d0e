"""The policy-loss table's claim, checked against verl's own functions: at ratio 1 every streamed loss's gradient
is vanilla PPO's (the plain policy gradient the streamed loss computes), with its loss_agg_mode."""

from __future__ import annotations

import pytest
import torch

from thundersync_verl.core.policy_losses import POLICY_LOSSES, check_policy_loss, streamed_policy_losses

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@pytest.fixture(scope="module")
def actor_config():
    from verl.utils.config import omega_conf_to_dataclass

    from thundersync_verl import verl_adapter as va

    config = va.compose_ppo_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                    "+actor_rollout_ref.actor.policy_loss.dro_beta=0.1"])
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def _grad(name: str, agg: str, config, ratio_one: bool = True) -> torch.Tensor:
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    torch.manual_seed(0)
    old = torch.randn(4, 6, dtype=torch.float64)
    mask = torch.ones(4, 6)
    mask[1, 4:], mask[3, 2:] = 0, 0  # rows of 6, 4, 6 and 2 tokens
    adv = torch.randn(4, 1, dtype=torch.float64).expand(4, 6).clone()
    log_prob = (old if ratio_one else old + 0.3 * torch.randn_like(old)).clone().requires_grad_(True)
    loss, _ = get_policy_loss_fn(name)(old, log_prob, adv, mask, agg, config)
    loss.backward()
    return log_prob.grad


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", [n for n in streamed_policy_losses() if n not in ("vanilla", "bypass_mode")])
def test_each_streamed_loss_has_vanillas_gradient_at_ratio_one(name, agg, actor_config):
    entry = POLICY_LOSSES[name]
    if entry.agg_mode is not None and agg != entry.agg_mode:  # the table refuses it: check that it differs in verl
        with pytest.raises(Exception, match="loss_agg_mode"):
            check_policy_loss(name, loss_agg_mode=agg)
        assert not torch.allclose(_grad(name, agg, actor_config), _grad("vanilla", agg, actor_config))
        return
    check_policy_loss(name, loss_agg_mode=agg, dro_beta=0.1)
    assert torch.allclose(_grad(name, agg, actor_config), _grad("vanilla", agg, actor_config), rtol=0, atol=1e-12)


def test_the_first_mini_batch_claim_needs_ratio_one(actor_config):
    # away from ratio 1 the new losses are not vanilla's gradient: why they are refused with bypass mode
    assert not torch.allclose(_grad("gspo", "token-mean", actor_config, ratio_one=False),
                              _grad("vanilla", "token-mean", actor_config, ratio_one=False))
    with pytest.raises(Exception, match="bypass_mode"):
        check_policy_loss("gspo", loss_agg_mode="token-mean", ratio_is_one=False)
    check_policy_loss("vanilla", loss_agg_mode="token-mean", ratio_is_one=False)  # its ratio path is verl's own
