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
    return loss, {"stream/scored_tokens": scored}


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


def _check_rows(prompts, responses, coefs, dest, masks) -> None:
    if masks is not None and (len(masks) != len(responses) or any(len(m) != len(r) for m, r in zip(masks, responses))):
        raise StreamingInputError(
            rule_message(
                "response_masks must give one 0/1 entry per response token of every row",
                "the mask decides which tokens are scored; a shifted mask scores the wrong tokens",
                "pass the trajectory's own response_mask (e.g. from verl's agent loop), unpadded",
            )
        )
    if not (len(prompts) == len(responses) == len(coefs)) or not prompts:
        raise StreamingInputError(
            rule_message(
                f"a chunk needs as many prompts, responses and coefficients, at least one "
                f"(got {len(prompts)}, {len(responses)}, {len(coefs)})",
                "row i of the chunk is trajectory i, weighted by coefficient i",
                "pass one (prompt, response, coefficient) per trajectory of the BackwardOp",
            )
        )
    if any(len(p) == 0 for p in prompts) or any(len(r) == 0 for r in responses):
        raise StreamingInputError(
            rule_message(
                "every chunk row needs a non-empty prompt and a non-empty response",
                "verl's no-padding layout locates a response by its prompt; an empty one has no token to score",
                "drop empty trajectories before planning (they carry no gradient)",
            )
        )
    bad = [c for c in coefs if not math.isfinite(float(c))]
    if bad or not isinstance(dest, str) or not dest:
        raise StreamingInputError(
            rule_message(
                f"chunk coefficients must be finite and dest a non-empty string (got {bad or dest!r})",
                "a NaN coefficient poisons the batch gradient; dest names where the gradient goes",
                "use the coefficients and destination of the planner's BackwardOp",
            )
        )


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
):
    """The TensorDict ``stream_backward`` takes, padded to a multiple of ``dp_size`` rows.

    ``response_masks`` (optional, one 0/1 list per response) marks the scored tokens; the
    planner must have been given the same count (``num_tokens = sum(mask)``).
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
    td = TensorDict(tensors, batch_size=[len(prompts)])
    va.assign_non_tensor(td, temperature=float(temperature), **{DEST_KEY: dest})
    return va.to_no_padding(td)
