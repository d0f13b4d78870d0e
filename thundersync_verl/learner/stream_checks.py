"""Checks on what the driver sends the streaming worker: each fails identically on every rank, before any
collective or gradient change, and says the rule, why it exists and how to fix the call."""

from __future__ import annotations

import math

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingInputError
from thundersync_verl.core.errors import rule_message
from thundersync_verl.step.chunk_layout import COEF_KEY, DEST_KEY, TEACHER_KEY, TOKEN_COEF_KEY


def check_chunk(chunk) -> str:
    """The chunk's destination, after checks that fail identically on every rank."""
    dest = va.non_tensor(chunk, DEST_KEY)
    if not isinstance(dest, str) or not dest:
        raise StreamingInputError(
            rule_message(
                f"a chunk needs a non-tensor {DEST_KEY!r}: 'direct' or a bucket key string (got {dest!r})",
                "the worker must know whether the gradient joins the batch now or waits for its group",
                "build chunks with chunk_layout.build_stream_chunk(..., dest=...)",
            )
        )
    if COEF_KEY not in chunk.keys() or chunk[COEF_KEY].dim() != 1:
        raise StreamingInputError(
            rule_message(
                f"a chunk needs a 1-D tensor {COEF_KEY!r} with one coefficient per row",
                "each trajectory's gradient is weighted by its own coefficient (A_i, or 1 for a bucket)",
                "build chunks with chunk_layout.build_stream_chunk",
            )
        )
    return dest


def check_token_chunk(chunk) -> None:
    """A per-token chunk carries ts_token_coef [B, R] (and optionally teacher log-probs [B, R])."""
    rows = int(chunk.batch_size[0])
    shapes = {k: tuple(chunk[k].shape) for k in (TOKEN_COEF_KEY, TEACHER_KEY) if k in chunk.keys()}
    bad_shape = any(len(v) != 2 or v[0] != rows for v in shapes.values()) or len(set(shapes.values())) > 1
    if TOKEN_COEF_KEY not in shapes or bad_shape:
        raise StreamingInputError(
            rule_message(
                f"a per-token chunk needs a [B, R] tensor {TOKEN_COEF_KEY!r} (and {TEACHER_KEY!r} of the same "
                f"shape, if any) with B = {rows} rows (got {shapes})",
                "each response token is weighted by its own coefficient",
                "build per-token chunks with chunk_layout.build_token_chunk and send GRPO chunks to stream_backward",
            )
        )


def check_folds(folds, buckets: dict) -> dict[str, float]:
    if not isinstance(folds, dict):
        raise StreamingInputError(
            rule_message(
                f"stream_fold needs a dict {{bucket_key: coefficient}} (got {type(folds).__name__})",
                "each bucket is folded with its own group advantage",
                "pass FoldOp.folds from the planner",
            )
        )
    missing = sorted(k for k in folds if k not in buckets)
    if missing:
        raise StreamingInputError(
            rule_message(
                f"stream_fold names buckets {missing} that hold no gradient (open: {sorted(buckets)})",
                "folding a bucket that was never filled or was already folded would count trajectories "
                "zero or two times",
                "fold exactly the buckets the planner's FoldOp lists, once",
            )
        )
    out = {}
    for key, coef in folds.items():
        value = float(coef)
        if not math.isfinite(value):
            raise StreamingInputError(
                rule_message(
                    f"fold coefficient of bucket {key!r} is {coef!r}",
                    "a non-finite coefficient poisons the batch gradient",
                    "check the group's rewards and the estimator's epsilon",
                )
            )
        out[key] = value
    return out


def check_scale(scale) -> float:
    value = float(scale)
    if not (math.isfinite(value) and value > 0):
        raise StreamingInputError(
            rule_message(
                f"finalize_step needs a finite positive scale (got {scale!r})",
                "the scale is the deferred batch normaliser (e.g. 1/N_tokens); zero or NaN would "
                "erase or poison the update",
                "pass FinalizeOp.scale from the planner; a batch with no scored tokens cannot step",
            )
        )
    return value
