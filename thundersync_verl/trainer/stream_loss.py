"""The streamed chunk: its layout (driver side) and its loss (worker side).

Why:
1. With one optimizer step per batch every PPO ratio is 1, so verl's clipped surrogate reduces
   to -A_i * w_{i,t} * log pi(a_{i,t}) and the batch gradient is c_batch * sum_i A_i * G_i with
   G_i = grad(-sum_t w_{i,t} log pi(a_{i,t})). A chunk therefore only needs the scalars
   ``ts_coef`` (A_i for a closed group, 1 for a reward bucket) and the per-token weights w of
   the ``loss_agg_mode`` (1, or 1/|o_i| for seq-mean-token-mean), both fixed when the chunk runs.
2. NO per-call normalisation: verl's engine overwrites ``batch_num_tokens`` with the token count
   of THIS call, which is not the batch's; the batch scalar c_batch is applied once, at the
   barrier (``StreamingActorWorker.finalize_step``).
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
"""

from __future__ import annotations

import math
from functools import partial
from typing import Sequence

import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingInputError, token_weights
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


def _refused(rule: str, why: str, fix: str) -> StreamingInputError:
    """A chunk input refused before any work: the error to raise, in rule / why / fix form."""
    return StreamingInputError(rule_message(rule, why, fix))


def stream_policy_loss(model_output, data, dp_group=None, *, loss_agg_mode: str):
    """-dp_size * sum_i ts_coef_i * sum_t w_{i,t} log pi(a_{i,t}) for one micro-batch.

    Signature of a verl loss function (``TrainingWorker.set_loss_fn``); returns (loss, metrics).
    """
    log_prob = va.response_log_probs(model_output, data)  # [B, T]
    fields = va.padded_fields(data, "response_mask", COEF_KEY)
    mask = fields["response_mask"].to(log_prob.device)  # [B, T]
    coef = fields[COEF_KEY].to(device=log_prob.device, dtype=log_prob.dtype)  # [B]
    weights = token_weights(loss_agg_mode, mask, dtype=log_prob.dtype)  # [B, T], 0 off the mask
    per_seq = (weights * log_prob).sum(dim=-1)  # [B]
    dp_size = int(data["dp_size"]) if "dp_size" in data.keys() else 1
    loss = -(coef * per_seq).sum() * dp_size  # scalar
    scored = int((mask != 0).sum())
    return loss, {"stream/scored_tokens": scored, **_rollout_gap(data, log_prob, mask != 0)}


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


def make_stream_loss(loss_agg_mode: str):
    """The loss function bound to one batch's ``loss_agg_mode``."""
    token_weights(loss_agg_mode, torch.ones(1, 1))  # raises for an unknown mode, before any backward
    return partial(stream_policy_loss, loss_agg_mode=loss_agg_mode)


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
):
    """The TensorDict ``stream_backward`` takes, padded to a multiple of ``dp_size`` rows.

    ``response_masks`` (optional, one 0/1 list per response) marks the scored tokens; the
    planner must have been given the same count (``num_tokens = sum(mask)``).
    ``rollout_log_probs`` (optional, one list per response): the loss then also reports
    ``stream/rollout_logprob_diff_max``, the rollout-vs-learner check verl's old-log-prob
    forward exists for, from the backward's own forward (same weights θ_k).
    """
    from tensordict import TensorDict

    _check_rows(prompts, responses, coefs, dest, response_masks)
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
    td = TensorDict(tensors, batch_size=[len(prompts)])
    va.assign_non_tensor(td, temperature=float(temperature), **{DEST_KEY: dest})
    return va.to_no_padding(td)


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
