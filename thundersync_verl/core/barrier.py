"""The batch barrier: the one place where the streamed gradient becomes an optimizer step.

Why:
1. The order is fixed and matters: fold closed groups -> apply the deferred normaliser ->
   data-parallel reduce -> clip the grad norm -> optimizer.step -> lr_scheduler.step -> zero.
   Clipping per chunk changes the update (a norm of partial sums is not the norm of the sum);
   reducing across data-parallel ranks per chunk double-counts with accumulating buffers.
2. Folding happens when each group closes (folding.py); the barrier only checks that
   nothing is left: it REFUSES to step while any group is open or any local trajectory is
   unprocessed, and it refuses before touching any state, so the caller can finish the work
   and call again.
3. Like verl's FSDP engine, a non-finite gradient norm skips the optimizer step (gradients are
   zeroed) but the LR scheduler still advances once per batch. A batch with no scored tokens
   has an undefined normaliser (verl would produce NaN): it is skipped the same way.
4. Gradients arrive as LOCAL shards; the caller owns the conversion. By default the batch
   gradient is written into ``p.grad`` of plain tensors; ``write_grads`` writes it anywhere
   else (e.g. ``p.grad._local_tensor`` of FSDP2 DTensors) and returns the written tensors,
   which the ``dp_reduce`` hook then receives. The normaliser includes dp_size like verl, so
   ``dp_reduce`` must AVERAGE across data-parallel ranks, as FSDP/DDP do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from thundersync_verl.core.errors import StreamingConfigError, StreamingStateError, rule_message
from thundersync_verl.core.gradients import GradientBuffers
from thundersync_verl.core.ledger import BatchLedger
from thundersync_verl.core.normalizers import batch_scale


@dataclass(frozen=True)
class BarrierReport:
    """What the barrier did for one batch."""

    scale: float | None  # c_batch applied to the accumulated gradient
    grad_norm: float | None  # norm before clipping, when clipping was requested
    stepped: bool  # whether optimizer.step() ran
    skipped_reason: str | None
    num_tokens: int
    num_sequences: int


def _guard(ledger: BatchLedger) -> None:
    work = ledger.pending_work()
    if work:
        shown = "; ".join(work[:6]) + (f"; ... ({len(work) - 6} more)" if len(work) > 6 else "")
        raise StreamingStateError(
            rule_message(
                f"optimizer step refused: {shown}",
                "an open group's coefficients are unknown and an unprocessed trajectory is missing "
                "from the sum; stepping now would not be the synchronous update",
                "report the missing rewards and add the missing gradients, or abort_batch()",
            )
        )


def _scale(ledger: BatchLedger, dp_size: int, global_tokens: int | None, global_sequences: int | None) -> float | None:
    counts = ledger.counts
    return batch_scale(
        ledger.loss_agg_mode,
        num_tokens=counts.num_tokens if global_tokens is None else int(global_tokens),
        num_sequences=counts.num_sequences if global_sequences is None else int(global_sequences),
        dp_size=dp_size,
        loss_scale_factor=ledger.loss_scale_factor,
    )


def compute_batch_gradient(
    ledger: BatchLedger,
    bufs: GradientBuffers,
    *,
    dp_size: int = 1,
    global_num_tokens: int | None = None,
    global_num_sequences: int | None = None,
) -> list[torch.Tensor]:
    """A normalised COPY of the batch gradient; the batch stays open (for checks and tests)."""
    _guard(ledger)
    scale = _scale(ledger, dp_size, global_num_tokens, global_num_sequences)
    if scale is None:
        raise StreamingStateError(
            rule_message(
                "the batch has no scored tokens (or no non-empty sequences)",
                "the normaliser divides by that count",
                "add trajectories with num_tokens > 0",
            )
        )
    return [d * scale for d in bufs.batch]  # type: ignore[union-attr]


def _write_param_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for p, g in zip(params, grads):
        g = g.to(device=p.device, dtype=p.dtype)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
        out.append(p.grad)
    return out


def _check_args(bufs: GradientBuffers, params, write_grads, clip_grad, max_grad_norm) -> None:
    if params is None and write_grads is None:
        raise StreamingConfigError(
            rule_message(
                "finish_batch needs params (plain tensors) or a write_grads callable",
                "the batch gradient has to be written where the optimizer reads it",
                "pass the parameter list, or write_grads=lambda grads: [...] for sharded params",
            )
        )
    if params is not None and len(params) != len(bufs.layout.shapes):
        raise StreamingConfigError(
            rule_message(
                f"finish_batch got {len(params)} params, the accumulator holds {len(bufs.layout.shapes)} shards",
                "the batch gradient is written back shard by shard, in construction order",
                "pass the same parameter list as at construction",
            )
        )
    if clip_grad is not None and max_grad_norm is not None:
        raise StreamingConfigError(
            rule_message(
                "pass either clip_grad or max_grad_norm, not both",
                "the norm must be clipped exactly once, on the full batch gradient",
                "keep the one your backend needs (clip_grad for sharded norms)",
            )
        )
    if max_grad_norm is not None and params is None:
        raise StreamingConfigError(
            rule_message(
                "max_grad_norm needs params",
                "torch.nn.utils.clip_grad_norm_ reads p.grad",
                "pass params, or a clip_grad callable that clips your sharded gradients",
            )
        )


def finish_batch(
    ledger: BatchLedger,
    bufs: GradientBuffers,
    params: Sequence[torch.Tensor] | None = None,
    *,
    optimizer=None,
    lr_scheduler=None,
    dp_reduce: Callable[[list[torch.Tensor]], None] | None = None,
    clip_grad: Callable[[], float | torch.Tensor] | None = None,
    max_grad_norm: float | None = None,
    write_grads: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
    dp_size: int = 1,
    global_num_tokens: int | None = None,
    global_num_sequences: int | None = None,
) -> BarrierReport:
    """Run the barrier in the order of the module docstring; the batch is closed afterwards.

    Without an optimizer the normalised gradient is left in the written ``.grad`` tensors.
    """
    _check_args(bufs, params, write_grads, clip_grad, max_grad_norm)
    _guard(ledger)  # 1. every group folded and every local trajectory processed
    scale = _scale(ledger, dp_size, global_num_tokens, global_num_sequences)
    counts = ledger.counts
    direct = bufs.batch
    assert direct is not None
    if scale is None:
        if optimizer is not None:
            optimizer.zero_grad()
        if lr_scheduler is not None:
            lr_scheduler.step()
        _end_batch(ledger, bufs)
        return BarrierReport(None, None, False, "no scored tokens", counts.num_tokens, counts.num_sequences)
    if direct:
        torch._foreach_mul_(list(direct), scale)  # 2. the deferred normaliser, once
    targets = write_grads(direct) if write_grads is not None else _write_param_grads(params, direct)  # type: ignore[arg-type]
    if targets is None:
        targets = direct
    if dp_reduce is not None:  # 3. data-parallel reduce (must average)
        dp_reduce(list(targets))
    norm = None  # 4. clip the norm of the full batch gradient
    if clip_grad is not None:
        norm = float(clip_grad())
    elif max_grad_norm is not None:
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))  # type: ignore[arg-type]
    finite = norm is None or math.isfinite(norm)
    stepped = False
    if optimizer is not None:  # 5. optimizer step (skipped on a non-finite norm, as verl does)
        if finite:
            optimizer.step()
            stepped = True
    if lr_scheduler is not None:  # 6. one scheduler step per batch
        lr_scheduler.step()
    if optimizer is not None:  # 7. zero
        optimizer.zero_grad()
    _end_batch(ledger, bufs)
    reason = None if (finite or optimizer is None) else f"non-finite grad norm {norm}"
    return BarrierReport(scale, norm, stepped, reason, counts.num_tokens, counts.num_sequences)


def _end_batch(ledger: BatchLedger, bufs: GradientBuffers) -> None:
    ledger.end()
    bufs.close_batch()
