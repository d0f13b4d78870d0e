"""The streamed chunk: its layout (driver side) and its loss (worker side).

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingConfigError, StreamingInputError, kl_per_token, token_weights
from thundersync_verl.core.errors import rule_message

COEF_KEY = "ts_coef"  # [B] per-trajectory coefficient (A_i, or 1 for a bucket)
DEST_KEY = "ts_dest"  # non-tensor: "direct" or a bucket key
SEQ_KEY = "ts_seq"  # non-tensor: the ticket of a queued call (streaming_worker, stream_exec.OpPipeline)
TOKEN_COEF_KEY = "ts_token_coef"  # [B, R] per-token coefficient, zero off the scored tokens
TEACHER_KEY = "ts_teacher_log_prob"  # [B, R] teacher log-probs of the scored tokens (OPD)
ROLLOUT_LP_KEY = "ts_rollout_log_prob"  # [B, R] optional: the rollout's log-probs, for the agreement metric
LP_DIFF_METRIC = "stream/rollout_logprob_diff_max"  # max |log p_rollout - log p_learner| over scored tokens
KL_SUM_METRIC = "stream/opd_reverse_kl_sum"  # OPD: sum of log pi - log p_teacher over scored tokens (at θ_k)
KL_TOKENS_METRIC = "stream/opd_reverse_kl_tokens"
ADV_CLAMP_KEY = "ts_opd_clamp"  # non-tensor: |log pi - log p_teacher| bound (verl's loss_max_clamp), or None
REF_LP_KEY = "ts_ref_log_prob"  # [B, R] reference log-probs of the response tokens (actor.use_kl_loss)
PART_KEY = "ts_part"  # non-tensor: the terms this backward carries, one of PARTS (point 6)
PARTS = ("all", "policy", "independent")
KL_LOSS_METRIC = "stream/kl_loss_sum"  # sum_{i,t} w_{i,t} kl_{i,t} of the chunk (unnormalised)
ENTROPY_METRIC = "stream/entropy_sum"  # sum_{i,t} w_{i,t} H_{i,t} of the chunk (unnormalised)


def _refused(rule: str, why: str, fix: str) -> StreamingInputError:
    """A chunk input refused before any work: the error to raise, in rule / why / fix form."""
    return StreamingInputError(rule_message(rule, why, fix))


@dataclass(frozen=True)
class IndependentTerms:
    """The advantage-free terms of verl's actor loss (point 6): KL to the reference, entropy bonus."""

    use_kl_loss: bool = False
    kl_loss_type: str = "low_var_kl"
    kl_loss_coef: float = 0.0
    entropy_coeff: float = 0.0

    @property
    def active(self) -> bool:
        """True when a chunk's loss has more than the policy term."""
        return self.use_kl_loss or self.entropy_coeff != 0.0

    @classmethod
    def from_actor_config(cls, actor: Any) -> "IndependentTerms":
        """From verl's ``actor_rollout_ref.actor`` section (the keys verl's ``ppo_loss`` reads)."""
        read = actor.get if hasattr(actor, "get") else (lambda key, default=None: getattr(actor, key, default))
        terms = cls(use_kl_loss=bool(read("use_kl_loss", False)), kl_loss_type=str(read("kl_loss_type", "low_var_kl")),
                    kl_loss_coef=float(read("kl_loss_coef", 0.0) or 0.0),
                    entropy_coeff=float(read("entropy_coeff", 0.0) or 0.0))
        if terms.use_kl_loss:
            kl_per_token(torch.zeros(1, 1), torch.zeros(1, 1), terms.kl_loss_type)  # refuses an unknown type now
        if not (math.isfinite(terms.kl_loss_coef) and math.isfinite(terms.entropy_coeff)):
            raise StreamingConfigError(rule_message(
                f"actor_rollout_ref.actor.kl_loss_coef={terms.kl_loss_coef} and entropy_coeff={terms.entropy_coeff} "
                "must be finite",
                "they multiply every token's KL and entropy gradient", "set both to finite numbers"))
        return terms


NO_TERMS = IndependentTerms()


def stream_policy_loss(model_output, data, dp_group=None, *, loss_agg_mode: str, terms: IndependentTerms = NO_TERMS):
    """dp_size * sum_{i,t} w_{i,t} (-ts_coef_i log pi + kl_coef kl_{i,t} - ent_coef H_{i,t}) for one micro-batch.

    ``ts_part`` picks the terms (point 6): "all", "policy" (the ts_coef term) or "independent"
    (KL and entropy). Signature of a verl loss function (``TrainingWorker.set_loss_fn``); returns
    (loss, metrics).
    """
    log_prob = va.response_log_probs(model_output, data)  # [B, T]
    fields = va.padded_fields(data, "response_mask", COEF_KEY)
    mask = fields["response_mask"].to(log_prob.device)  # [B, T]
    coef = fields[COEF_KEY].to(device=log_prob.device, dtype=log_prob.dtype)  # [B]
    weights = token_weights(loss_agg_mode, mask, dtype=log_prob.dtype)  # [B, T], 0 off the mask
    part = va.non_tensor(data, PART_KEY, "all")
    metrics = {"stream/scored_tokens": int((mask != 0).sum()), **_rollout_gap(data, log_prob, mask != 0)}
    loss = log_prob.new_zeros(())  # scalar
    if part != "independent":
        loss = loss - (coef * (weights * log_prob).sum(dim=-1)).sum()  # scalar
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
            raise _refused(
                f"actor_rollout_ref.actor.use_kl_loss is on but the chunk has no {REF_LP_KEY}",
                "the KL term compares every scored token's log-prob with the reference model's",
                "compute the reference log-probs per arrival (stream_loss.attach_ref_log_probs) before the backward")
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


def exact_micro_batch_size(rows: int, cap: int | None) -> int:
    """The largest micro-batch size <= ``cap`` that divides ``rows`` (verl's fixed micro-batching needs an exact split)."""
    rows = int(rows)
    return max(d for d in range(1, min(rows, int(cap or rows)) + 1) if rows % d == 0)


def make_stream_loss(loss_agg_mode: str, terms: IndependentTerms = NO_TERMS):
    """The loss function bound to one batch's ``loss_agg_mode`` and KL/entropy settings."""
    token_weights(loss_agg_mode, torch.ones(1, 1))  # raises for an unknown mode, before any backward
    return partial(stream_policy_loss, loss_agg_mode=loss_agg_mode, terms=terms)


def set_chunk_part(chunk, part: str, terms: IndependentTerms) -> None:
    """Mark which terms the next backward of ``chunk`` carries; the engine computes entropy only when used."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    va.assign_non_tensor(chunk, **{PART_KEY: part}, calculate_entropy=part != "policy" and terms.entropy_coeff != 0.0)


# ----- driver side: the chunk layout ----------------------------------------------------------
def pad_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_token_id: int,
              response_masks: Sequence[Sequence[int]] | None = None) -> dict:
    """verl's left/right padded layout: prompts left-padded, responses right-padded.

    Returns ``input_ids``, ``attention_mask``, ``position_ids`` [B, P + R], ``prompts`` [B, P],
    ``responses`` and ``response_mask`` [B, R]. Every response token is attended to; only the
    tokens whose ``response_masks`` entry is 1 are scored (default: all of them; multi-turn
    trajectories pass 0 for tool-observation tokens, as verl's agent loop does).
    """
    n_rows, p_len, r_len = len(prompts), max(len(p) for p in prompts), max(len(r) for r in responses)
    prompt_ids = torch.full((n_rows, p_len), pad_token_id, dtype=torch.long)  # [B, P]
    prompt_mask = torch.zeros(n_rows, p_len, dtype=torch.long)  # [B, P]
    response_ids = torch.full((n_rows, r_len), pad_token_id, dtype=torch.long)  # [B, R]
    response_mask = torch.zeros(n_rows, r_len, dtype=torch.long)  # [B, R]
    for b, (p, r) in enumerate(zip(prompts, responses)):
        prompt_ids[b, p_len - len(p):] = torch.tensor(list(p), dtype=torch.long)
        prompt_mask[b, p_len - len(p):] = 1
        response_ids[b, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        response_mask[b, : len(r)] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)  # [B, P + R]
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, P + R]
    if response_masks is not None:
        response_mask = torch.zeros(n_rows, r_len, dtype=torch.long)  # [B, R]
        for b, m in enumerate(response_masks):
            response_mask[b, : len(m)] = torch.tensor([1 if x else 0 for x in m], dtype=torch.long)
    return {
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "prompts": prompt_ids,
        "responses": response_ids,
        "response_mask": response_mask,
    }


def build_stream_chunk(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    coefs: Sequence[float],
    dest: str,
    *,
    dp_size: int,
    pad_token_id: int,
    temperature: float = 1.0,
    response_masks: Sequence[Sequence[int]] | None = None,
    rollout_log_probs: Sequence[Sequence[float]] | None = None,
    ref_log_probs: Sequence[Sequence[float]] | None = None,
):
    """The TensorDict ``stream_backward`` takes, padded to a multiple of ``dp_size`` rows.

    ``response_masks`` (optional, one 0/1 list per response) marks the scored tokens; the
    planner must have been given the same count (``num_tokens = sum(mask)``).
    ``rollout_log_probs`` (optional, one list per response): the loss then also reports
    ``stream/rollout_logprob_diff_max``, the rollout-vs-learner check verl's old-log-prob
    forward exists for, from the backward's own forward (same weights θ_k).
    ``ref_log_probs`` (optional, one list per response): the reference model's log-probs of the
    response tokens, for the KL term (point 6; ``attach_ref_log_probs`` computes them on the engine).
    """
    from tensordict import TensorDict

    _check_rows(prompts, responses, coefs, dest, response_masks)
    if ref_log_probs is not None and (len(ref_log_probs) != len(responses) or any(
            len(r) < len(o) for r, o in zip(ref_log_probs, responses))):
        raise _refused("ref_log_probs must give one value per response token of every row",
                       "the KL term pairs each token's log-prob with the reference's at the same position",
                       "pass the reference log-probs of each trajectory's response, unshifted")
    n_pad = (-len(prompts)) % int(dp_size)
    prompts = list(prompts) + [prompts[-1]] * n_pad
    responses = list(responses) + [responses[-1]] * n_pad
    masks = None if response_masks is None else list(response_masks) + [[0] * len(responses[-1])] * n_pad
    tensors = pad_batch(prompts, responses, pad_token_id, masks)
    if n_pad:
        tensors["response_mask"][-n_pad:] = 0  # padding rows score no token
    tensors[COEF_KEY] = torch.tensor([float(c) for c in coefs] + [0.0] * n_pad, dtype=torch.float64)  # [B]
    if rollout_log_probs is not None:
        tensors[ROLLOUT_LP_KEY] = _rows_to_tensor(rollout_log_probs, tensors["responses"].shape[1], torch.float32, n_pad)
    if ref_log_probs is not None:
        width = tensors["responses"].shape[1]
        tensors[REF_LP_KEY] = _rows_to_tensor([list(r)[:width] for r in ref_log_probs], width, torch.float32, n_pad)
    td = TensorDict(tensors, batch_size=[len(prompts)])
    va.assign_non_tensor(td, temperature=float(temperature), **{DEST_KEY: dest})
    return va.to_no_padding(td)


def attach_ref_log_probs(chunk, worker_group, *, ref_in_actor: bool = False, dp_size: int = 1,
                         micro_batch_cap: int | None = None) -> torch.Tensor:
    """``chunk[ts_ref_log_prob]`` := the reference log-probs of its rows, computed as verl's trainer does.

    verl's ``_compute_ref_log_prob``: ``compute_ref_log_prob`` on the worker group holding the
    reference model, or (``ref_in_actor``: LoRA) the actor's ``compute_log_prob`` with the adapter
    disabled; no entropy, no loss. Per chunk, before its backward: the reference model never
    changes, so a row's reference log-probs are the same whenever they are computed. Returns them [B, R].
    """
    query = chunk.copy()
    rows = int(chunk.batch_size[0])
    extra = {"no_lora_adapter": True} if ref_in_actor else {}
    va.assign_non_tensor(query, calculate_entropy=False, compute_loss=False,
                         micro_batch_size_per_gpu=exact_micro_batch_size(rows // max(int(dp_size), 1), micro_batch_cap),
                         **extra)
    output = worker_group.compute_log_prob(query) if ref_in_actor else worker_group.compute_ref_log_prob(query)
    ref = va.unpad_response(va.td_get(output, "log_probs"), query).float()  # [B, R]
    chunk[REF_LP_KEY] = ref
    return ref


# ----- per-token chunks (OPD turns) ----------------------------------------------------------
def stream_token_loss(model_output, data, dp_group=None):
    """-dp_size * sum_{i,t} ts_coef_i * ts_token_coef_{i,t} * a_{i,t} * log pi(a_{i,t}) for one micro-batch.

    a_{i,t} = -(log pi(a_{i,t}) - ts_teacher_log_prob_{i,t}), detached, when the chunk carries
    teacher log-probs (OPD), else 1. verl loss-function signature; returns (loss, metrics).
    """
    log_prob = va.response_log_probs(model_output, data)  # [B, T]
    has_teacher = TEACHER_KEY in data.keys()
    fields = va.padded_fields(data, COEF_KEY, TOKEN_COEF_KEY, *([TEACHER_KEY] if has_teacher else []))
    token_coef = fields[TOKEN_COEF_KEY].to(device=log_prob.device, dtype=log_prob.dtype)  # [B, T]
    if token_coef.shape != log_prob.shape:
        raise _refused(
            f"{TOKEN_COEF_KEY} has shape {tuple(token_coef.shape)} but the response log-probs have "
            f"{tuple(log_prob.shape)}",
            "each per-token coefficient multiplies the log-prob of the response token at the same position",
            "build the chunk with stream_loss.build_token_chunk (one coefficient per response token)")
    coef = token_coef * fields[COEF_KEY].to(device=log_prob.device, dtype=log_prob.dtype).unsqueeze(-1)  # [B, T]
    if has_teacher:
        teacher = fields[TEACHER_KEY].to(device=log_prob.device, dtype=log_prob.dtype)  # [B, T]
        gap = log_prob.detach() - teacher  # [B, T], verl's k1 distillation loss
        scored = token_coef != 0  # [B, T]
        kl = {KL_SUM_METRIC: float((gap * scored).sum()), KL_TOKENS_METRIC: int(scored.sum())}
        clamp = va.non_tensor(data, ADV_CLAMP_KEY)
        if clamp is not None:
            gap = gap.clamp(min=-float(clamp), max=float(clamp))  # [B, T]
        coef = coef * (-gap)  # [B, T], OPD advantage A_t times the token coefficient
    dp_size = int(data["dp_size"]) if "dp_size" in data.keys() else 1
    loss = -(coef * log_prob).sum() * dp_size  # scalar
    metrics = {"stream/scored_tokens": int((token_coef != 0).sum()), **(kl if has_teacher else {})}
    metrics.update(_rollout_gap(data, log_prob, token_coef != 0))
    return loss, metrics


def make_token_stream_loss():
    """The loss function of per-token chunks (``build_token_chunk``)."""
    return stream_token_loss


def build_token_chunk(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    token_coefs: Sequence[Sequence[float]],
    *,
    dp_size: int,
    pad_token_id: int,
    teacher_log_probs: Sequence[Sequence[float]] | None = None,
    opd_clamp: float | None = None,
    dest: str = "direct",
    temperature: float = 1.0,
    rollout_log_probs: Sequence[Sequence[float]] | None = None,
):
    """A per-token chunk for ``stream_token_backward``, padded to a multiple of ``dp_size`` rows.

    Row i scores the response tokens whose ``token_coefs[i]`` entry is non-zero (its
    ``response_mask``, from which verl counts tokens, is 1 exactly there). ``teacher_log_probs``
    (OPD) gives log p_teacher for those tokens (any value elsewhere; 0 by convention);
    ``rollout_log_probs`` the rollout's, for the loss's rollout-vs-learner check (as in ``build_stream_chunk``).
    """
    from tensordict import TensorDict

    _check_rows(prompts, responses, [1.0] * len(responses), dest, None)
    _check_token_rows(responses, token_coefs, teacher_log_probs, opd_clamp)
    n_pad = (-len(prompts)) % int(dp_size)
    prompts = list(prompts) + [prompts[-1]] * n_pad
    responses = list(responses) + [responses[-1]] * n_pad
    coefs = [list(map(float, c)) for c in token_coefs] + [[0.0] * len(responses[-1])] * n_pad
    masks = [[1 if c != 0 else 0 for c in row] for row in coefs]
    tensors = pad_batch(prompts, responses, pad_token_id, masks)
    width = tensors["responses"].shape[1]
    tensors[TOKEN_COEF_KEY] = _rows_to_tensor(coefs, width)  # [B, R]
    for key, rows in ((TEACHER_KEY, teacher_log_probs), (ROLLOUT_LP_KEY, rollout_log_probs)):
        if rows is not None:
            tensors[key] = _rows_to_tensor(rows, width, torch.float32, n_pad)  # [B, R]
    tensors[COEF_KEY] = torch.tensor([1.0] * (len(prompts) - n_pad) + [0.0] * n_pad, dtype=torch.float64)  # [B]
    td = TensorDict(tensors, batch_size=[len(prompts)])
    extra = {} if opd_clamp is None else {ADV_CLAMP_KEY: float(opd_clamp)}
    va.assign_non_tensor(td, temperature=float(temperature), **{DEST_KEY: dest}, **extra)
    return va.to_no_padding(td)


def _rows_to_tensor(rows: Sequence[Sequence[float]], width: int, dtype=torch.float64, n_pad: int = 0) -> torch.Tensor:
    """Right-padded [B + n_pad, width]; the ``n_pad`` data-parallel padding rows are zeros (they score nothing)."""
    out = torch.zeros(len(rows) + n_pad, width, dtype=dtype)  # [B, R], right-padded like the responses
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.tensor(list(row), dtype=dtype)
    return out


def _check_rows(prompts, responses, coefs, dest, masks) -> None:
    if masks is not None and (len(masks) != len(responses) or any(len(m) != len(r) for m, r in zip(masks, responses))):
        raise _refused(
            "response_masks must give one 0/1 entry per response token of every row",
            "the mask decides which tokens are scored; a shifted mask scores the wrong tokens",
            "pass the trajectory's own response_mask (e.g. from verl's agent loop), unpadded")
    if not (len(prompts) == len(responses) == len(coefs)) or not prompts:
        raise _refused(
            f"a chunk needs as many prompts, responses and coefficients, at least one "
            f"(got {len(prompts)}, {len(responses)}, {len(coefs)})",
            "row i of the chunk is trajectory i, weighted by coefficient i",
            "pass one (prompt, response, coefficient) per trajectory of the BackwardOp")
    if any(len(p) == 0 for p in prompts) or any(len(r) == 0 for r in responses):
        raise _refused(
            "every chunk row needs a non-empty prompt and a non-empty response",
            "verl's no-padding layout locates a response by its prompt; an empty one has no token to score",
            "drop empty trajectories before planning (they carry no gradient)")
    bad = [c for c in coefs if not math.isfinite(float(c))]
    if bad or not isinstance(dest, str) or not dest:
        raise _refused(
            f"chunk coefficients must be finite and dest a non-empty string (got {bad or dest!r})",
            "a NaN coefficient poisons the batch gradient; dest names where the gradient goes",
            "use the coefficients and destination of the planner's BackwardOp")


def _check_token_rows(responses, token_coefs, teacher_log_probs, opd_clamp) -> None:
    lengths_ok = len(token_coefs) == len(responses) and all(len(c) == len(r) for c, r in zip(token_coefs, responses))
    if teacher_log_probs is not None:
        lengths_ok = lengths_ok and len(teacher_log_probs) == len(responses) and all(
            len(t) == len(r) for t, r in zip(teacher_log_probs, responses))
    if not lengths_ok:
        raise _refused(
            "token_coefs (and teacher_log_probs) must give one value per response token of every row",
            "a per-token coefficient is aligned with the response token it weights; a shifted "
            "list weights the wrong tokens",
            "pass, for every row, lists as long as its response (0 off the scored tokens)")
    values = [float(x) for row in token_coefs for x in row]
    values += [float(x) for row in (teacher_log_probs or []) for x in row]
    if not all(math.isfinite(v) for v in values) or (opd_clamp is not None and not float(opd_clamp) > 0):
        raise _refused(
            f"token coefficients and teacher log-probs must be finite, opd_clamp positive or None (got {opd_clamp!r})",
            "one NaN poisons the batch gradient",
            "check the teacher's scores (the turn teacher validates them) before building the chunk")
