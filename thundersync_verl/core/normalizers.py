"""Deferred batch normalisers for every verl ``loss_agg_mode``.

Why:
1. verl's ``agg_loss`` turns a per-token loss matrix into a scalar. Every mode is a weighted
   token sum, loss = c_batch * sum_i sum_t w_{i,t} * loss_{i,t}, where
   - w_{i,t} depends only on trajectory i (1, or 1/|o_i| for seq-mean-token-mean), so it is
     known when the trajectory finishes and goes into its backward;
   - c_batch depends on the whole batch (token count, sequence count), so streaming DEFERS it
     and applies it once, at the barrier, to the accumulated gradient.
2. The modes (verl 0.9.1, ``verl.trainer.ppo.core_algos.agg_loss``):
       token-mean               w = 1        c = dp_size / batch_num_tokens
       token-sum                w = 1        c = dp_size
       seq-mean-token-sum       w = 1        c = dp_size / global_batch_size
       seq-mean-token-mean      w = 1/|o_i|  c = dp_size / global_batch_size
       seq-mean-token-sum-norm  w = 1        c = dp_size / (global_batch_size * loss_scale_factor)
   Without global info verl counts the local tokens and the sequences with at least one
   scored token; those are the defaults here. verl's actor passes ``global_batch_size =
   ppo_mini_batch_size * rollout.n``; pass that value at the barrier to mirror it.
3. dp_size is in c_batch because FSDP/DDP AVERAGE gradients across data-parallel ranks; the
   data-parallel reduce hook called at the barrier must therefore average too.
4. seq-mean-token-sum-norm without ``loss_scale_factor`` divides by the padded width of the
   micro-batch (``loss_mask.shape[-1]``), which streamed chunks do not share: a fixed divisor
   is required, and its absence is a config error.
5. seq-mean-token-mean: verl divides by ``count + 1e-8`` with the count taken from a bool
   mask, an int64 tensor that the addition turns into float32; for any count below 2**24 the
   float32 sum rounds back to the count, so the weight is exactly 1/|o_i|.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError, int_at_least, rule_message

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def check_loss_agg_mode(loss_agg_mode: str, loss_scale_factor: float | None = None) -> None:
    """Raise ``StreamingConfigError`` unless the mode can be normalised after the fact."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise StreamingConfigError(
            rule_message(
                f"actor_rollout_ref.actor.loss_agg_mode={loss_agg_mode!r} is unknown",
                "the deferred normaliser must reproduce verl's agg_loss for this mode",
                f"use one of {list(LOSS_AGG_MODES)}",
            )
        )
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None or not float(loss_scale_factor) > 0:
            raise StreamingConfigError(
                rule_message(
                    "seq-mean-token-sum-norm needs a fixed positive loss_scale_factor "
                    f"(got {loss_scale_factor!r})",
                    "without it verl divides by loss_mask.shape[-1], the padded width of each "
                    "micro-batch, so a streamed chunk would be normalised differently from the "
                    "synchronous batch",
                    "set actor_rollout_ref.actor.loss_scale_factor to a constant, e.g. the "
                    "maximum response length",
                )
            )


def token_weight(loss_agg_mode: str, num_tokens: int) -> float:
    """w_{i,t}: the per-token loss weight of a trajectory with ``num_tokens`` scored tokens."""
    check_loss_agg_mode(loss_agg_mode, loss_scale_factor=1.0)
    if loss_agg_mode != "seq-mean-token-mean":
        return 1.0
    if num_tokens <= 0:
        return 0.0  # a fully masked sequence is excluded by verl
    return 1.0 / float(num_tokens)


def token_weights(loss_agg_mode: str, mask: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-token weights w_{i,t} * mask_{i,t} for a [B, T] mask (float64 unless ``dtype``)."""
    dtype = dtype or (mask.dtype if mask.is_floating_point() else torch.float64)
    counts = (mask != 0).sum(dim=-1)  # [B]
    per_seq = torch.tensor(
        [token_weight(loss_agg_mode, int(c)) for c in counts.tolist()], dtype=dtype, device=mask.device
    )  # [B]
    return (mask != 0).to(dtype) * per_seq.unsqueeze(-1)  # [B, T]


@dataclass
class BatchCounts:
    """Scored tokens and non-empty sequences seen in the current batch (local rank)."""

    num_tokens: int = 0
    num_sequences: int = 0

    def add(self, num_tokens: int, num_sequences: int) -> None:
        self.num_tokens += int(num_tokens)
        self.num_sequences += int(num_sequences)


def check_count(name: str, value: object) -> int:
    """Validate a token or sequence count given by the caller."""
    if not int_at_least(value, 0):
        raise StreamingInputError(
            rule_message(
                f"{name} must be a non-negative int (got {value!r})",
                "the deferred normaliser divides the batch gradient by these counts",
                f"pass {name} as the number of scored (loss-mask) tokens, e.g. int(mask.sum())",
            )
        )
    return value


def batch_scale(
    loss_agg_mode: str,
    *,
    num_tokens: int,
    num_sequences: int,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> float | None:
    """c_batch for the mode; ``None`` when the denominator is zero (verl would produce NaN)."""
    check_loss_agg_mode(loss_agg_mode, loss_scale_factor)
    if not int_at_least(dp_size, 1):
        raise StreamingInputError(
            rule_message(
                f"dp_size must be a positive int (got {dp_size!r})",
                "verl scales each rank's loss by the data-parallel size before FSDP averages it",
                "pass the data-parallel world size of the learner",
            )
        )
    if loss_agg_mode == "token-sum":
        return float(dp_size)
    if loss_agg_mode == "token-mean":
        return None if num_tokens == 0 else dp_size / float(num_tokens)
    if num_sequences == 0:
        return None
    scale = dp_size / float(num_sequences)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = scale / float(loss_scale_factor)
    return scale
