"""The streamed policy loss: one chunk's un-normalised share of the batch gradient.

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
4. Rows with an all-zero response mask (the driver's padding to a multiple of the DP size)
   contribute exactly zero.
"""

from __future__ import annotations

from functools import partial

import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import token_weights

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
