"""SAO in verl: the ``sao`` advantage estimator and the ``sao`` policy loss, registered in verl's registries.

Why:
1. SAO is selected with verl's own keys: ``algorithm.adv_estimator=sao``,
   ``actor_rollout_ref.actor.policy_loss.loss_mode=sao``, ``critic.enable=true`` (the value model is
   verl's critic worker), ``trainer.critic_warmup`` (critic-only steps), ``critic.ppo_epochs`` (critic
   passes over each batch: more critic than policy updates per step), ``algorithm.gamma/lam``, and
   the double-sided band as ``actor.clip_ratio_low/high`` (eps_low, eps_high). The recipe is
   ``recipes/cpu_tiny/sao/sao.yaml``. The math lives in ``core/sao.py``; this module only adapts it.
2. The mask is against the ROLLOUT engine's log-probs: with
   ``algorithm.rollout_correction.bypass_mode=true`` verl sets old_log_probs = rollout_log_probs, so
   the ``old_log_prob`` a policy loss receives IS the rollout's. The recipe sets it; the loss cannot
   see the algorithm config, so a recipe without it would mask against the learner's recomputation.
3. verl 0.9.1's ``compute_advantage`` hands the critic's values only to its built-in GAE; a
   registered estimator gets rewards, mask and config. ``with_critic_values`` wraps
   ``compute_advantage`` so that for ``sao`` the values and gamma/lam reach the estimator (runtime
   patch ``sao_critic_values`` in ``verl_adapter/patches.py``); every other estimator goes through unchanged.
4. Registration happens when verl imports ``core_algos`` (``verl_adapter/registrations.py``), in every process:
   the driver computes advantages, the actor workers look up the loss.
"""

from __future__ import annotations

from typing import Any

from thundersync_verl import verl_adapter as va
from thundersync_verl.core.errors import StreamingConfigError, rule_message

NAME = "sao"


def _setting(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def compute_sao_advantage_return(token_level_rewards, response_mask, config=None, values=None, gamma=None,
                                 lam=None, **_unused):
    """verl estimator ``sao``: ``(advantages, returns)``, [B, T] each (whitened GAE over agent tokens, MC returns)."""
    from thundersync_verl.core.sao import sao_advantages_and_returns

    if values is None:
        raise StreamingConfigError(
            rule_message(
                "algorithm.adv_estimator=sao needs the critic's values",
                "SAO's baseline is the value model; verl 0.9.1 passes values only to its built-in GAE",
                "set critic.enable=true and keep the thundersync_verl plugin loaded (its sao_critic_values "
                "patch passes the values), or call this estimator with values=",
            )
        )
    gamma = float(_setting(config, "gamma", 1.0) if gamma is None else gamma)
    lam = float(_setting(config, "lam", 1.0) if lam is None else lam)
    return sao_advantages_and_returns(token_level_rewards, values, response_mask, gamma=gamma, lam=lam)


def compute_sao_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
                            config=None, rollout_is_weights=None):
    """verl policy loss ``sao``: -A r m aggregated by verl's ``agg_loss``; ``old_log_prob`` = rollout log-probs.

    eps_low / eps_high are ``actor.clip_ratio_low`` / ``clip_ratio_high``. Masked tokens stay in the
    normaliser. Optional rollout IS weights multiply the per-token loss, as in verl's vanilla loss.
    """
    from thundersync_verl.core.sao import sao_policy_loss

    if config is None:
        raise StreamingConfigError(rule_message("the sao policy loss needs the actor config",
                                                "the band offsets are actor.clip_ratio_low / clip_ratio_high",
                                                "call it as verl's ppo_loss does (config=actor config)"))
    clip = _setting(config, "clip_ratio", 0.2)
    eps_low = float(_setting(config, "clip_ratio_low", clip))
    eps_high = float(_setting(config, "clip_ratio_high", clip))
    loss_mat, stats = sao_policy_loss(log_prob, old_log_prob, advantages, response_mask, eps_low, eps_high)  # [B, T]
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights  # [B, T]
    batch_info = dict(getattr(config, "global_batch_info", None) or {})
    loss = va.agg_loss_fn()(loss_mat=loss_mat, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **batch_info)
    metrics = {"actor/sao_masked_frac": stats["masked_frac"], "actor/ppo_kl": stats["ppo_kl"],
               "actor/pg_clipfrac": stats["masked_frac"]}
    return loss, metrics


def with_critic_values(original):
    """``compute_advantage`` that hands ``values``, gamma and lam to the ``sao`` estimator; others unchanged."""
    if getattr(original, "_thundersync_patched", False):
        return original

    def compute_advantage(data, adv_estimator, gamma: float = 1.0, lam: float = 1.0, num_repeat: int = 1,
                          norm_adv_by_std_in_grpo: bool = True, config=None):
        if str(getattr(adv_estimator, "value", adv_estimator)) != NAME:
            return original(data, adv_estimator=adv_estimator, gamma=gamma, lam=lam, num_repeat=num_repeat,
                            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=config)
        batch = data.batch
        if "response_mask" not in batch.keys():
            batch["response_mask"] = va.response_mask_of(data)
        estimator = va.advantage_estimator_fn(NAME)
        advantages, returns = estimator(token_level_rewards=batch["token_level_rewards"],
                                        response_mask=batch["response_mask"], config=config,
                                        values=batch["values"] if "values" in batch.keys() else None,
                                        gamma=gamma, lam=lam)
        batch["advantages"], batch["returns"] = advantages, returns
        return data

    compute_advantage._thundersync_patched = True
    return compute_advantage


def register() -> None:
    """Register estimator and policy loss ``sao`` with verl (idempotent)."""
    va.register_advantage_estimator(NAME, compute_sao_advantage_return)
    va.register_policy_loss(NAME, compute_sao_policy_loss)
