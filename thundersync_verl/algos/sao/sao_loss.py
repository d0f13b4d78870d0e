"""Streamed SAO inside the learner actor: the chunk loss and the worker's check of the actor config
(the driver side, and why it is exact: ``sao_streaming.py``, points 2 and 3)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from thundersync_verl.algos.sao.sao_streaming import (
    EPS_HIGH_KEY, EPS_LOW_KEY, MASKED_METRIC, NAME, SCORED_METRIC,
)
from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingConfigError
from thundersync_verl.core.errors import fail
from thundersync_verl.core.corrections import double_sided_token_mask
from thundersync_verl.core.normalizers import check_loss_agg_mode
from thundersync_verl.core.sao import sao_policy_loss
from thundersync_verl.step.chunk_layout import COEF_KEY, LP_DIFF_METRIC, ROLLOUT_LP_KEY, TOKEN_COEF_KEY


def is_sao_chunk(chunk) -> bool:
    """True for a chunk built by ``SAOStreamClient`` (it carries the band)."""
    return va.non_tensor(chunk, EPS_LOW_KEY) is not None


def sao_token_loss(model_output, data, dp_group=None):
    """dp_size * sum_{i,t} -c_{i,t} r_{i,t} m_{i,t} for one micro-batch (verl loss-function signature).

    c = ts_coef_i * ts_token_coef_{i,t}; r and m from the core's ``sao_policy_loss`` against the chunk's
    rollout log-probs. Returns (loss, metrics).
    """
    log_prob = va.response_log_probs(model_output, data)  # [B, T]
    fields = va.padded_fields(data, COEF_KEY, TOKEN_COEF_KEY, ROLLOUT_LP_KEY)
    token_coef = fields[TOKEN_COEF_KEY].to(device=log_prob.device, dtype=log_prob.dtype)  # [B, T]
    coef = token_coef * fields[COEF_KEY].to(device=log_prob.device, dtype=log_prob.dtype).unsqueeze(-1)  # [B, T]
    rollout = fields[ROLLOUT_LP_KEY].to(device=log_prob.device, dtype=log_prob.dtype)  # [B, T]
    scored = token_coef != 0  # [B, T]
    eps_low, eps_high = float(va.non_tensor(data, EPS_LOW_KEY)), float(va.non_tensor(data, EPS_HIGH_KEY))
    loss_mat, _ = sao_policy_loss(log_prob, rollout, coef, scored, eps_low, eps_high)  # [B, T], 0 where c = 0
    dp_size = int(data["dp_size"]) if "dp_size" in data.keys() else 1
    masked = int((scored & ~double_sided_token_mask(log_prob, rollout, eps_low, eps_high)).sum())
    gap = float(((log_prob.detach() - rollout).abs() * scored).max()) if bool(scored.any()) else 0.0
    return loss_mat.sum() * dp_size, {SCORED_METRIC: int(scored.sum()), MASKED_METRIC: masked, LP_DIFF_METRIC: gap}


def _read(node: Any, key: str, default: Any = None) -> Any:
    for part in key.split("."):
        node = None if node is None else (node.get(part, None) if hasattr(node, "get") else getattr(node, part, None))
    return default if node is None else node


def sao_settings(config: Any, meta: dict) -> SimpleNamespace:
    """The worker's check of ``actor_rollout_ref`` for SAO streaming (point 3); returns ``loss_agg_mode``."""
    actor = _read(config, "actor")
    mode = _read(actor, "loss_agg_mode", "token-mean")
    epochs, mini = int(_read(actor, "ppo_epochs", 1)), int(_read(actor, "ppo_mini_batch_size"))
    tbs = int(meta.get("train_batch_size", mini))
    checks = [
        (_read(actor, "policy_loss.loss_mode", "vanilla") == NAME, "actor_rollout_ref.actor.policy_loss.loss_mode=sao",
         "the streamed chunk loss is SAO's double-sided mask against the rollout log-probs"),
        (epochs == 1 and mini == tbs, f"actor_rollout_ref.actor.ppo_epochs=1 and ppo_mini_batch_size={tbs}",
         "the coefficients are fixed at the step-start weights: one optimizer step per batch"),
        (meta.get("loss_agg_mode", mode) == mode, f"the batch meta's loss_agg_mode={mode!r}",
         "the deferred normaliser must be the actor's"),
        (not bool(_read(actor, "use_kl_loss", False)) and not float(_read(actor, "entropy_coeff", 0.0) or 0.0),
         "actor_rollout_ref.actor.use_kl_loss=false and entropy_coeff=0", "SAO chunks carry the policy term only"),
    ]
    bad = [(fix, why) for ok, fix, why in checks if not ok]
    if bad:
        fail("SAO streaming needs " + ", ".join(f for f, _ in bad), "; ".join(w for _, w in bad),
              "set " + ", ".join(f for f, _ in bad), StreamingConfigError)
    check_loss_agg_mode(mode, _read(actor, "loss_scale_factor"))
    return SimpleNamespace(loss_agg_mode=mode)
