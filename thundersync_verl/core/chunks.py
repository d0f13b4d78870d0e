"""Adding the gradient of a planned chunk: several trajectories from one backward.

Why:
1. ``plan_chunk`` (scheduling.py) fixes a chunk's loss weights before its backward runs; the
   gradient that comes back is sum_i w_i H_i, and only the destination decides how it enters
   the batch: closed groups -> the batch gradient as is (weights were -A_i); one open group
   with one known reward -> that reward's buffer (weights were 1).
2. A group may close between planning and adding (its last reward arrived meanwhile): the
   chunk then goes straight into the batch gradient with the group's coefficient, and with
   sign buckets only the gradient of the coefficient's sign class counts.
3. Everything is checked before anything changes: the plan's batch, the token counts, that no
   member was added already, the gradients' layout, the bucket room and the reservation.
"""

from __future__ import annotations

from typing import Sequence

from thundersync_verl.core.buffers import GradLayout
from thundersync_verl.core.errors import StreamingInputError, StreamingStateError, rule_message
from thundersync_verl.core.folding import advance_commits, route_open
from thundersync_verl.core.gradients import GradientBuffers
from thundersync_verl.core.groups import ANY, NEG, POS, variant_of
from thundersync_verl.core.ledger import BatchLedger
from thundersync_verl.core.normalizers import check_count
from thundersync_verl.core.scheduling import ChunkPlan


def add_chunk_grad(
    ledger: BatchLedger, bufs: GradientBuffers, plan: ChunkPlan, grads, num_tokens: Sequence[int], grads_negative=None
) -> None:
    """Add the gradient of sum_i plan.loss_weights[i] * sum_t w_{i,t} log pi_i."""
    _check_plan(ledger, plan, num_tokens)
    g = ledger.group(plan.items[0][0])
    if plan.destination == "direct" or g.closed:
        dest = _closed_chunk_grads(ledger, plan, g, grads, grads_negative)
        if dest is not None:
            bufs.layout.check(dest[0])
        _mark(ledger, plan, num_tokens)
        if dest is not None:
            bufs.add_to_batch(dest[0], dest[1])
    else:
        variants = {ANY: grads} if not ledger.sign_buckets else {POS: grads, NEG: grads_negative}
        _check_open_variants(bufs.layout, variants)
        ledger.check_bucket_room(g, plan.reward)  # type: ignore[arg-type]
        ledger.reserve(g, need_group=True, pending=False, tid=None)
        _mark(ledger, plan, num_tokens)
        route_open(ledger, bufs, g, variants, plan.reward)  # type: ignore[arg-type]
    advance_commits(ledger, bufs)


def _check_plan(ledger: BatchLedger, plan: ChunkPlan, num_tokens: Sequence[int]) -> None:
    ledger.require_batch()
    if plan.batch_serial != ledger.serial:
        raise StreamingStateError(
            rule_message(
                "this chunk plan belongs to an earlier batch",
                "its coefficients were computed for other rewards and weights",
                "plan chunks again after begin_batch",
            )
        )
    if len(num_tokens) != len(plan.items):
        raise StreamingInputError(
            rule_message(
                f"num_tokens has {len(num_tokens)} entries for {len(plan.items)} trajectories",
                "each trajectory's scored tokens enter the batch normaliser",
                "pass one token count per chunk member, in plan order",
            )
        )
    for n in num_tokens:
        check_count("num_tokens", n)
    for it in plan.items:
        ledger.unprocessed(it)


def _check_open_variants(layout: GradLayout, variants: dict) -> None:
    for v, gr in variants.items():
        if gr is None:
            raise StreamingInputError(
                rule_message(
                    "an open-group chunk with sign buckets needs grads and grads_negative",
                    "the sign of the group's advantage for this reward is not known yet",
                    "backpropagate the chunk once with each sign class's token weights",
                )
            )
        layout.check(gr, "grads_negative" if v == NEG else "grads")


def _closed_chunk_grads(ledger: BatchLedger, plan: ChunkPlan, g, grads, grads_negative):
    """(gradient, alpha) to add to the batch gradient for a chunk whose group(s) are closed."""
    if plan.destination == "direct":
        if grads_negative is not None:
            raise StreamingInputError(
                rule_message(
                    "a closed-group chunk takes one gradient",
                    "its members' sign classes are known and their weights went into one backward",
                    "apply plan.sign_classes per member and pass grads only",
                )
            )
        return grads, 1.0
    coef = g.coefs[plan.items[0][1]]  # bucket planned while open, group closed since then
    if not ledger.sign_buckets:
        return grads, coef
    v = variant_of(coef)
    if v is None:
        return None  # advantage 0: the chunk contributes nothing
    chosen = grads if v == POS else grads_negative
    if chosen is None:
        raise StreamingInputError(
            rule_message(
                f"the chunk's group closed with sign class {v!r} but that gradient is missing",
                "with sign buckets each sign class has its own token weights",
                "pass both grads and grads_negative for chunks planned while the group was open",
            )
        )
    return chosen, coef


def _mark(ledger: BatchLedger, plan: ChunkPlan, num_tokens: Sequence[int]) -> None:
    for (gid, tid), n in zip(plan.items, num_tokens):
        ledger.mark_processed(ledger.group(gid), tid, n)
