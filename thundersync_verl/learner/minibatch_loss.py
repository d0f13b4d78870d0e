"""The loss of a PPO chunk: mini-batches after the first (and later epochs), worker side and layout.

Why:
1. Mini-batch j >= 2 of a batch runs at the weights after step j-1, so its ratios to the batch's
   old log-probs are no longer 1 and PPO's clip can bind. Its loss must be verl's own: this module
   calls verl's registered policy loss (``actor.policy_loss.loss_mode``, through the adapter) on the
   chunk's log-probs, the old log-probs it carries and its rows' advantages, with verl's clip settings
   read from the actor config. Every advantage is known (mini-batches >= 2 hold complete groups), so
   the chunk goes straight into the gradient.
2. The normaliser stays deferred, as for every streamed chunk: verl's ``agg_loss`` is called with
   ``batch_num_tokens = global_batch_size = loss_scale_factor = 1`` and the data-parallel size, so a
   chunk adds dp_size x (the un-normalised sum over its rows); the mini-batch's own c_j (its tokens or
   sequences, ``minibatch_plan.StepOp.scale``) is applied once, at its step, like verl's per-mini-batch
   ``batch_num_tokens`` / ``global_batch_size``.
3. Old log-probs ride in the chunk as ``ts_rollout_log_prob`` (the rollout's, at the batch's weights:
   staleness 0), marked by the non-tensor ``ts_ppo``.
4. KL loss and entropy bonus (``actor.use_kl_loss``, ``actor.entropy_coeff``): verl's ``ppo_loss`` adds
   them to every mini-batch's policy loss under the same ``loss_agg_mode`` and normaliser. A PPO chunk
   adds ``stream_loss.independent_loss`` (the same term streamed chunks carry, at the current weights)
   with the same token weights and the same dp_size factor; its reference log-probs were taken on
   arrival (the reference is fixed), and the engine computes the entropy only when the bonus is on.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingInputError, token_weights
from thundersync_verl.core.errors import rule_message
from thundersync_verl.step.chunk_layout import COEF_KEY, REF_LP_KEY, ROLLOUT_LP_KEY, IndependentTerms, build_stream_chunk
from thundersync_verl.learner.stream_loss import independent_loss, loss_log_probs

PPO_KEY = "ts_ppo"  # non-tensor: True on a PPO chunk (minibatch_plan.PPOBackwardOp)
PPO_KL_METRIC = "stream/ppo_kl"
CLIPFRAC_METRIC = "stream/pg_clipfrac"


class PPOLossSettings:
    """The actor settings verl's policy losses read (``config.clip_ratio*``, ``global_batch_info``)."""

    def __init__(self, actor: Any):
        read = actor.get if hasattr(actor, "get") else (lambda key, default=None: getattr(actor, key, default))
        self.clip_ratio = float(read("clip_ratio", 0.2))
        low, high = read("clip_ratio_low", None), read("clip_ratio_high", None)
        self.clip_ratio_low = self.clip_ratio if low is None else float(low)
        self.clip_ratio_high = self.clip_ratio if high is None else float(high)
        self.clip_ratio_c = float(read("clip_ratio_c", 3.0))
        policy = read("policy_loss", None)
        self.loss_mode = str((policy.get("loss_mode", "vanilla") if policy is not None else None) or "vanilla")
        self.loss_agg_mode = str(read("loss_agg_mode", "token-mean"))
        self.global_batch_info: dict = {}
        self.terms = IndependentTerms.from_actor_config(actor)  # point 4: KL / entropy, as verl's ppo_loss reads them

    def get(self, key: str, default=None):
        return getattr(self, key, default)


def stream_ppo_loss(model_output, data, dp_group=None, *, settings: PPOLossSettings):
    """verl's policy loss of one micro-batch against the old log-probs it carries, normaliser deferred (point 2)."""
    log_prob = loss_log_probs(model_output, data)  # [B, T], fp32 as in verl's loss (stream_loss point 7)
    fields = va.padded_fields(data, "response_mask", COEF_KEY, ROLLOUT_LP_KEY)
    mask = fields["response_mask"].to(log_prob.device).bool()  # [B, T]
    advantages = fields[COEF_KEY].to(device=log_prob.device, dtype=log_prob.dtype).unsqueeze(-1)  # [B, 1]
    advantages = advantages.expand_as(log_prob)  # [B, T], one advantage per trajectory, as verl's GRPO
    old = fields[ROLLOUT_LP_KEY].to(device=log_prob.device, dtype=log_prob.dtype)  # [B, T]
    dp_size = int(data["dp_size"]) if "dp_size" in data.keys() else 1
    settings.global_batch_info = {"dp_size": dp_size, "batch_num_tokens": 1, "global_batch_size": 1,
                                  "loss_scale_factor": 1.0}
    loss, pg = va.policy_loss_fn(settings.loss_mode)(
        old_log_prob=old, log_prob=log_prob, advantages=advantages, response_mask=mask,
        loss_agg_mode=settings.loss_agg_mode, config=settings, rollout_is_weights=None)
    metrics = {"stream/scored_tokens": int(mask.sum())}
    if "actor/ppo_kl" in pg:
        metrics[PPO_KL_METRIC] = float(pg["actor/ppo_kl"])
    if "actor/pg_clipfrac" in pg:
        metrics[CLIPFRAC_METRIC] = float(pg["actor/pg_clipfrac"])
    if settings.terms.active:  # point 4: the same deferred normaliser, so the same dp_size factor
        weights = token_weights(settings.loss_agg_mode, mask, dtype=log_prob.dtype)  # [B, T], 0 off the mask
        loss = loss + dp_size * independent_loss(model_output, data, log_prob, weights, settings.terms, metrics)
    return loss, metrics


def ppo_chunk_loss(actor_config: Any, chunk):
    """The loss function of ``chunk`` if it is a PPO chunk (``ts_ppo``), else None (the streamed loss applies)."""
    if not va.non_tensor(chunk, PPO_KEY, False):
        return None
    if ROLLOUT_LP_KEY not in chunk.keys():
        raise StreamingInputError(rule_message(
            f"a PPO chunk needs the old log-probs ({ROLLOUT_LP_KEY} [B, R])",
            "mini-batches after the first clip the ratio of the current policy to the batch's log-probs",
            "build PPO chunks with minibatch_loss.build_ppo_chunk"))
    settings = PPOLossSettings(actor_config)
    if settings.terms.use_kl_loss and REF_LP_KEY not in chunk.keys():
        raise StreamingInputError(rule_message(
            f"actor_rollout_ref.actor.use_kl_loss is on but the PPO chunk has no {REF_LP_KEY}",
            "every mini-batch's loss has verl's KL term against the reference model's log-probs",
            "pass ref_log_probs (taken on arrival) to minibatch_loss.build_ppo_chunk"))
    va.assign_non_tensor(chunk, calculate_entropy=settings.terms.entropy_coeff != 0.0)  # the engine's forward
    return partial(stream_ppo_loss, settings=settings)


def build_ppo_chunk(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], advantages: Sequence[float],
                    old_log_probs: Sequence[Sequence[float]], *, dp_size: int, pad_token_id: int,
                    temperature: float = 1.0, response_masks: Sequence[Sequence[int]] | None = None,
                    ref_log_probs: Sequence[Sequence[float]] | None = None):
    """The TensorDict ``stream_backward`` takes for a ``PPOBackwardOp`` (padded to a multiple of ``dp_size``);
    ``ref_log_probs`` with ``actor.use_kl_loss`` (point 4)."""
    if len(old_log_probs) != len(responses) or any(len(o) < len(r) for o, r in zip(old_log_probs, responses)):
        raise StreamingInputError(rule_message(
            "old_log_probs must give one value per response token of every row",
            "each token's ratio is exp(log pi - old log-prob) at the same position",
            "pass the batch's log-probs of each trajectory's response (the rollout's), unshifted"))
    chunk = build_stream_chunk(prompts, responses, advantages, "direct", dp_size=dp_size, pad_token_id=pad_token_id,
                               temperature=temperature, response_masks=response_masks,
                               rollout_log_probs=[list(o)[: len(r)] for o, r in zip(old_log_probs, responses)],
                               ref_log_probs=ref_log_probs)
    va.assign_non_tensor(chunk, **{PPO_KEY: True})
    return chunk
