"""The streamed chunk's loss, on the learner (the chunk's layout, built by the driver: ``step/chunk_layout.py``).

Why:
1. With one optimizer step per batch every PPO ratio is 1, so verl's clipped surrogate reduces
   to -A_i * w_{i,t} * log pi(a_{i,t}) and the batch gradient is c_batch * sum_i A_i * G_i with
   G_i = grad(-sum_t w_{i,t} log pi(a_{i,t})). A chunk therefore only needs the scalars
   ``ts_coef`` (A_i for a closed group, 1 for a reward bucket) and the per-token weights w of
   the ``loss_agg_mode`` (1, or 1/|o_i| for seq-mean-token-mean), both fixed when the chunk runs.
2. NO per-call normalisation: verl's engine overwrites ``batch_num_tokens`` with the token count
   of THIS call, which is not the batch's; the batch scalar c_batch is applied once, at the
   barrier (``StreamingActorWorker.finalize_step``). In token-mean, verl instead rounds each
   row's coefficient A_i * (1/N) inside its loss. When a group's rows nearly cancel, those
   roundings show: on the emulated recorded workload verl's step-1 update points 1.25e-6 away
   from the exact direction (verl's own token-sum run, whose coefficients are the advantages
   themselves), and this one 5.4e-8 (``benchmarks/emulated_rollout.py`` point 5).
3. FSDP averages gradients over data-parallel ranks at every backward. The loss is multiplied by
   ``dp_size`` so the reduced gradient is the SUM over all ranks' rows, exactly as verl's
   ``agg_loss`` does with its ``* dp_size`` factor; only the division by the batch count is
   deferred.
4. A chunk is a verl no-padding batch (the layout ``update_actor`` receives) plus ``ts_coef``
   [B] and the non-tensor ``ts_dest``. verl splits it evenly over data-parallel ranks, so the
   driver pads it to a multiple of the DP size with copies of a real row whose response mask
   is all zero and whose coefficient is 0: they contribute exactly zero, and every rank runs
   the backward (FSDP's reduce-scatter is a collective).
5. Per-token chunks (OPD turns, ``build_token_chunk``): ``ts_token_coef`` [B, R] aligned with
   the response replaces the row weight w, zero off the tokens this row scores, so a row can be
   a trajectory PREFIX (prompt + earlier turns + turn j) that scores only turn j's tokens. With
   ``ts_teacher_log_prob`` [B, R] the loss multiplies each coefficient by the OPD advantage
   A_t = -(log pi(a_t) - log p_teacher(a_t)), computed from the row's own forward and detached,
   as verl's distillation loss computes it from its forward; the normaliser stays deferred.
6. KL loss and entropy bonus (``actor.use_kl_loss``, ``actor.entropy_coeff``): verl adds
   ``kl_loss_coef * agg_loss(kl_penalty(log pi, log p_ref))`` and ``-entropy_coeff * agg_loss(H)``
   to the policy loss, with the same ``loss_agg_mode`` and global normaliser. Neither depends on
   the advantage, so row i contributes c_batch * grad(sum_t w_{i,t} (kl_coef kl_{i,t} - ent_coef
   H_{i,t})) whatever its group's rewards: the same token weights w, the same deferred c_batch.
   A row of a closed group carries both parts in one backward (``ts_part`` "all"). A row of an
   OPEN group must not: its bucket is later multiplied by A(r) at the fold, which would scale the
   KL/entropy gradient too. Such a chunk runs twice: the policy part into the bucket (``ts_part``
   "policy", inside ``learner.isolated()``), then the KL/entropy part straight into the batch
   gradient (``ts_part`` "independent"). The bucket holds the policy part only, so the fold
   multiplies exactly that by A(r). The reference log-probs ride in the chunk
   (``ts_ref_log_prob`` [B, R], computed per arrival by verl's ``compute_ref_log_prob``: the
   reference model is fixed for the whole run); the entropy comes from the backward's own forward
   (verl's ``calculate_entropy``), as in verl's ``ppo_loss``.
7. bf16 parameters: verl's log-probs can come out of the forward in bf16 (``torch.autocast`` on the CPU keeps
   ``log_softmax`` in bf16). verl's loss promotes them to fp32 against its fp32 advantages and old log-probs, so
   the one rounding is where the backward casts the log-probs' gradient back to bf16. The streamed losses do the
   same (``loss_log_probs``): coefficients, token weights, reference and teacher log-probs stay fp32. Cast to the
   log-probs' dtype instead, every A_i and 1/|o_i| would be rounded to 8 bits before that cast.
8. Rollout correction (``algorithm.rollout_correction.rollout_is``): verl multiplies each token's policy loss by a
   truncated importance weight of the old log-probs against the rollout engine's (token or sequence level, a TIS
   clamp or an IcePop band, ``core.rollout_is_weights``). Here the old log-probs are the backward's own forward at
   the batch's weights (ratio 1), and the rollout's ride in the chunk (``ts_rollout_log_prob``), so the weight of
   every token is fixed by its own trajectory: a detached factor of the policy term only (not of the KL and
   entropy terms, as in verl), normaliser unchanged. ``rollout_is_batch_normalize`` needs the whole batch and
   stays refused (``core/config_validation.py``).
9. The chunk's ``ts_distill_loss`` names verl's estimator (k1 when absent). As a policy gradient the advantage is
   A_t = -est(log pi, log p_teacher), detached and clamped by ``loss_max_clamp`` (verl's ``distillation_loss``).
   Supervised distillation (verl's ``use_policy_gradient: false``; ``ts_distill_supervised``): row i's loss is
   ``ts_coef_i * sum_t ts_token_coef_{i,t} * est(log pi, log p_teacher)`` with grad through the estimator (``core.distillation_token_loss``: verl's ``kl_penalty``, then its
   ``loss_max_clamp``), as verl's ``agg_loss`` of the estimator matrix before its normaliser; ``ts_coef`` is verl's
   ``distillation_loss_coef`` when task rewards are on, 1 otherwise. Reward-independent, like the KL loss of
   point 6: it goes straight into the batch gradient, the same deferred normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import distillation_token_loss, kl_per_token, rollout_is_weights, token_weights
from thundersync_verl.step.chunk_layout import (ADV_CLAMP_KEY, COEF_KEY, DISTILL_LOSS_KEY, SUPERVISED_KEY, ENTROPY_METRIC, IndependentTerms, KL_LOSS_METRIC, KL_SUM_METRIC, KL_TOKENS_METRIC, LP_DIFF_METRIC, NO_TERMS, PARTS, PART_KEY, REF_LP_KEY, ROLLOUT_LP_KEY, TEACHER_KEY, TOKEN_COEF_KEY, chunk_refused)


@dataclass(frozen=True)
class RolloutIS:
    """verl's ``rollout_is`` level and parsed threshold (point 8); ``level`` None: no weights."""

    level: str | None = None
    upper: float | None = None
    lower: float | None = None

    @classmethod
    def from_settings(cls, settings) -> "RolloutIS":
        return cls(getattr(settings, "rollout_is", None), getattr(settings, "rollout_is_upper", None),
                   getattr(settings, "rollout_is_lower", None))

    def weights(self, data, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The detached [B, T] IS weights of the chunk's tokens (1 where no correction is set)."""
        if self.level is None:
            return torch.ones_like(log_prob)
        if ROLLOUT_LP_KEY not in data.keys():
            raise chunk_refused(
                f"algorithm.rollout_correction.rollout_is={self.level!r} is on but the chunk has no {ROLLOUT_LP_KEY}",
                "each token's IS weight compares the learner's log-prob with the rollout engine's",
                "send the rollout's log-probs with every chunk (rollout.calculate_log_probs=true; the trainer fetches "
                "them when rollout_is is set)")
        rollout = va.padded_fields(data, ROLLOUT_LP_KEY)[ROLLOUT_LP_KEY].to(device=log_prob.device, dtype=log_prob.dtype)
        return rollout_is_weights(log_prob.detach(), rollout, mask, self.level, self.upper, self.lower)  # [B, T]


NO_IS = RolloutIS()


def loss_log_probs(model_output, data) -> torch.Tensor:
    """verl's response log-probs [B, T] in at least fp32, where the streamed losses compute (point 7)."""
    log_prob = va.response_log_probs(model_output, data)  # [B, T]
    return log_prob.to(torch.promote_types(log_prob.dtype, torch.float32))


def stream_policy_loss(model_output, data, dp_group=None, *, loss_agg_mode: str, terms: IndependentTerms = NO_TERMS,
                       rollout_is: RolloutIS = NO_IS):
    """dp_size * sum_{i,t} w_{i,t} (-ts_coef_i log pi + kl_coef kl_{i,t} - ent_coef H_{i,t}) for one micro-batch.

    ``ts_part`` picks the terms (point 6): "all", "policy" (the ts_coef term) or "independent"
    (KL and entropy). Signature of a verl loss function (``TrainingWorker.set_loss_fn``); returns
    (loss, metrics).
    """
    log_prob = loss_log_probs(model_output, data)  # [B, T], at least fp32 (point 7)
    fields = va.padded_fields(data, "response_mask", COEF_KEY)
    mask = fields["response_mask"].to(log_prob.device)  # [B, T]
    coef = fields[COEF_KEY].to(device=log_prob.device, dtype=log_prob.dtype)  # [B]
    weights = token_weights(loss_agg_mode, mask, dtype=log_prob.dtype)  # [B, T], 0 off the mask
    part = va.non_tensor(data, PART_KEY, "all")
    metrics = {"stream/scored_tokens": int((mask != 0).sum()), **_rollout_gap(data, log_prob, mask != 0)}
    loss = log_prob.new_zeros(())  # scalar
    if part != "independent":
        is_weights = rollout_is.weights(data, log_prob, mask)  # [B, T], 1 without rollout correction (point 8)
        loss = loss - (coef * (weights * is_weights * log_prob).sum(dim=-1)).sum()  # scalar
    if part != "policy" and terms.active:
        loss = loss + independent_loss(model_output, data, log_prob, weights, terms, metrics)
    dp_size = int(data["dp_size"]) if "dp_size" in data.keys() else 1
    return loss * dp_size, metrics


def independent_loss(model_output, data, log_prob, weights, terms: IndependentTerms, metrics: dict):
    """sum_{i,t} w_{i,t} (kl_coef kl_{i,t} - ent_coef H_{i,t}): verl's KL and entropy terms before c_batch.

    ``weights`` [B, T] are the ``loss_agg_mode`` token weights; any loss whose normaliser is deferred
    (e.g. a later mini-batch's PPO chunk) can add this term as is. Writes its sums into ``metrics``.
    """
    loss = log_prob.new_zeros(())  # scalar
    if terms.use_kl_loss:
        if REF_LP_KEY not in data.keys():
            raise chunk_refused(
                f"actor_rollout_ref.actor.use_kl_loss is on but the chunk has no {REF_LP_KEY}",
                "the KL term compares every scored token's log-prob with the reference model's",
                "compute the reference log-probs per arrival (chunk_layout.attach_ref_log_probs) before the backward")
        ref = va.padded_fields(data, REF_LP_KEY)[REF_LP_KEY].to(device=log_prob.device, dtype=log_prob.dtype)  # [B, T]
        kl_sum = (weights * kl_per_token(log_prob, ref, terms.kl_loss_type)).sum()  # scalar
        loss = loss + terms.kl_loss_coef * kl_sum
        metrics[KL_LOSS_METRIC] = float(kl_sum.detach())
    if terms.entropy_coeff != 0.0:
        entropy = va.unpad_response(model_output["entropy"], data)  # [B, T], verl's calculate_entropy
        entropy_sum = (weights * entropy).sum()  # scalar
        loss = loss - terms.entropy_coeff * entropy_sum
        metrics[ENTROPY_METRIC] = float(entropy_sum.detach())
    return loss


def _rollout_gap(data, log_prob, scored) -> dict:
    """max |log p_rollout - log p_learner| over the scored tokens, when the chunk carries the rollout's.

    The forward at θ_k doubles as verl's old-log-prob check (``learner_forward=fused``).
    """
    if ROLLOUT_LP_KEY not in data.keys():
        return {}
    rollout = va.padded_fields(data, ROLLOUT_LP_KEY)[ROLLOUT_LP_KEY].to(device=log_prob.device, dtype=log_prob.dtype)
    gap = ((log_prob.detach() - rollout).abs() * scored).max() if bool(scored.any()) else 0.0  # [B, T] -> scalar
    return {LP_DIFF_METRIC: float(gap)}


def make_stream_loss(loss_agg_mode: str, terms: IndependentTerms = NO_TERMS, rollout_is: RolloutIS = NO_IS):
    """The loss function bound to one batch's ``loss_agg_mode``, KL/entropy and rollout-correction settings."""
    token_weights(loss_agg_mode, torch.ones(1, 1))  # raises for an unknown mode, before any backward
    return partial(stream_policy_loss, loss_agg_mode=loss_agg_mode, terms=terms, rollout_is=rollout_is)


def set_chunk_part(chunk, part: str, terms: IndependentTerms) -> None:
    """Mark which terms the next backward of ``chunk`` carries; the engine computes entropy only when used."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    va.assign_non_tensor(chunk, **{PART_KEY: part}, calculate_entropy=part != "policy" and terms.entropy_coeff != 0.0)


def stream_token_loss(model_output, data, dp_group=None):
    """-dp_size * sum_{i,t} ts_coef_i * ts_token_coef_{i,t} * a_{i,t} * log pi(a_{i,t}) for one micro-batch.

    a_{i,t} = -(log pi(a_{i,t}) - ts_teacher_log_prob_{i,t}), detached, when the chunk carries
    teacher log-probs (OPD), else 1. verl loss-function signature; returns (loss, metrics).
    """
    log_prob = loss_log_probs(model_output, data)  # [B, T], at least fp32 (point 7)
    has_teacher = TEACHER_KEY in data.keys()
    fields = va.padded_fields(data, COEF_KEY, TOKEN_COEF_KEY, *([TEACHER_KEY] if has_teacher else []))
    token_coef = fields[TOKEN_COEF_KEY].to(device=log_prob.device, dtype=log_prob.dtype)  # [B, T]
    if token_coef.shape != log_prob.shape:
        raise chunk_refused(
            f"{TOKEN_COEF_KEY} has shape {tuple(token_coef.shape)} but the response log-probs have "
            f"{tuple(log_prob.shape)}",
            "each per-token coefficient multiplies the log-prob of the response token at the same position",
            "build the chunk with chunk_layout.build_token_chunk (one coefficient per response token)")
    coef = token_coef * fields[COEF_KEY].to(device=log_prob.device, dtype=log_prob.dtype).unsqueeze(-1)  # [B, T]
    per_token = -log_prob  # [B, T]: the policy-gradient term, weighted by coef (times A_t with a teacher)
    kl = {}
    if has_teacher:
        teacher = fields[TEACHER_KEY].to(device=log_prob.device, dtype=log_prob.dtype)  # [B, T]
        gap = log_prob.detach() - teacher  # [B, T], verl's k1 distillation loss
        scored = token_coef != 0  # [B, T]
        kl = {KL_SUM_METRIC: float((gap * scored).sum()), KL_TOKENS_METRIC: int(scored.sum())}
        clamp = va.non_tensor(data, ADV_CLAMP_KEY)
        estimator = va.non_tensor(data, DISTILL_LOSS_KEY) or "k1"
        if va.non_tensor(data, SUPERVISED_KEY, False):  # point 9: the estimator itself, with grad, is the per-token loss
            per_token = distillation_token_loss(log_prob, teacher, estimator, clamp)  # [B, T]
        else:
            est = distillation_token_loss(log_prob.detach(), teacher, estimator, clamp)  # [B, T]; k1: the gap
            coef = coef * (-est)  # [B, T], OPD advantage A_t times the token coefficient
    dp_size = int(data["dp_size"]) if "dp_size" in data.keys() else 1
    loss = (coef * per_token).sum() * dp_size  # scalar
    metrics = {"stream/scored_tokens": int((token_coef != 0).sum()), **kl}
    metrics.update(_rollout_gap(data, log_prob, token_coef != 0))
    return loss, metrics


def make_token_stream_loss():
    """The loss function of per-token chunks (``build_token_chunk``)."""
    return stream_token_loss

