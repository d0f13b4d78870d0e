"""Where each streamed gradient goes, and how open groups fold into the batch gradient.

Why:
1. The accumulator validates, the ledger decides and budgets; this module turns the ledger's
   decisions into buffer arithmetic, in one place, so the exactness argument can be read next
   to the code that implements it. Every buffer is charged in the ledger before it is
   allocated in ``GradientBuffers``, and released in both at once.
2. Routes for a trajectory's gradient H_i (loss coefficient c_i = -A_i):
   - closed group            -> batch += c_i H_i                       (no buffer)
   - open, affine estimator  -> S0 += H_i ; S1 += (r_i - r_ref) H_i    (2 buffers per group)
   - open, reward buckets    -> B[r_i, sign] += H_i                    (1 buffer per reward/sign)
   - open, reward unknown    -> pending copy of H_i until the reward arrives
   - canonical order         -> a copy of H_i per trajectory, summed in sorted order later
3. Folding at close: batch += -(alpha S1 + (alpha r_ref + beta) S0) on the affine path, since
   sum_i A_i H_i = alpha sum_i r_i H_i + beta sum_i H_i = alpha S1 + (alpha r_ref + beta) S0;
   batch += c(r) B[r, sign(c(r))] for buckets. Buffers are released at once.
4. Canonical commits walk the groups in sorted order and stop at the first one that is not
   complete, so the floating-point summation order never depends on arrival order.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from thundersync_verl.core.gradients import GradientBuffers
from thundersync_verl.core.groups import ANY, GroupState, TrajectoryState, canonical_sorted, variant_of
from thundersync_verl.core.ledger import BatchLedger, group_owner, pending_owner

S0, S1 = ("s0",), ("s1",)  # affine path: sum_i H_i and sum_i (r_i - r_ref) H_i
INDEPENDENT = "independent"  # canonical order: a trajectory's reward-independent gradient


def bucket(r: float, variant: str) -> tuple:
    """Name of an open group's buffer for reward ``r`` and gradient variant ``variant``."""
    return ("bucket", r, variant)


def stored(tid: Hashable, variant: str) -> tuple:
    """Name of a trajectory's own copy of a gradient variant (canonical order)."""
    return ("stored", tid, variant)


def store(ledger: BatchLedger, bufs: GradientBuffers, owner, name, grads: Sequence[torch.Tensor | None]) -> None:
    """A new buffer (owner, name) holding a copy of ``grads``."""
    ledger.charge(owner, name)
    bufs.allocate(owner, name)
    bufs.copy_in(owner, name, grads)


def accumulate(ledger: BatchLedger, bufs: GradientBuffers, owner, name, grads, alpha: float) -> None:
    """buffer (owner, name) += alpha * grads, creating the buffer on first use."""
    if not ledger.has_buffer(owner, name):
        ledger.charge(owner, name)
        bufs.allocate(owner, name)
    bufs.add(owner, name, grads, alpha)


def release(ledger: BatchLedger, bufs: GradientBuffers, owner) -> None:
    ledger.release(owner)
    bufs.drop(owner)


def close_group(ledger: BatchLedger, bufs: GradientBuffers, g: GroupState, coefs: dict) -> None:
    """Mark ``g`` closed with loss coefficients ``coefs`` and fold its buffers (not canonical)."""
    g.closed, g.coefs = True, coefs
    if ledger.path == "canonical":
        return
    owner = group_owner(g.gid)
    if ledger.path == "affine" and ledger.has_buffer(owner, S0):
        _, rewards = g.sorted_rewards()
        alpha, beta = ledger.estimator.affine_coefficients(rewards)
        if ledger.has_buffer(owner, S1):
            bufs.fold(owner, S1, -alpha)
        bufs.fold(owner, S0, -(alpha * g.r_ref + beta))  # type: ignore[operator]
    coef_of_reward = {g.trajs[t].reward: c for t, c in coefs.items()}
    for name in ledger.buffer_names(owner):
        if name[0] != "bucket":
            continue
        _, r, variant = name
        coef = coef_of_reward[r]
        if variant in (ANY, variant_of(coef)):
            bufs.fold(owner, name, coef)
    for tid, traj in g.trajs.items():
        if traj.pending:
            add_direct(ledger, bufs, g, tid, bufs.held(pending_owner(g.gid, tid)))
            traj.pending = False
            release(ledger, bufs, pending_owner(g.gid, tid))
    release(ledger, bufs, owner)


def route(
    ledger: BatchLedger, bufs: GradientBuffers, g: GroupState, tid: Hashable, traj: TrajectoryState, variants: dict,
    pending: bool,
) -> None:
    """Send one trajectory's gradient variants along the route of point 2."""
    if ledger.path == "canonical":
        for v, grads in variants.items():
            store(ledger, bufs, group_owner(g.gid), stored(tid, v), grads)
    elif g.closed:
        add_direct(ledger, bufs, g, tid, variants)
    elif pending:
        traj.pending = True
        for v, grads in variants.items():
            store(ledger, bufs, pending_owner(g.gid, tid), v, grads)
    else:
        route_open(ledger, bufs, g, variants, traj.reward)  # type: ignore[arg-type]


def route_pending(ledger: BatchLedger, bufs: GradientBuffers, g: GroupState, tid: Hashable) -> None:
    """The reward of a pending trajectory arrived (its group still open): move it to its buffers."""
    owner = pending_owner(g.gid, tid)
    traj = g.trajs[tid]
    route_open(ledger, bufs, g, bufs.held(owner), traj.reward)  # type: ignore[arg-type]
    traj.pending = False
    release(ledger, bufs, owner)


def store_independent(ledger: BatchLedger, bufs: GradientBuffers, g: GroupState, tid: Hashable, grads) -> None:
    """Canonical order: keep a trajectory's reward-independent gradient for its group's commit."""
    store(ledger, bufs, group_owner(g.gid), stored(tid, INDEPENDENT), grads)


def add_direct(ledger: BatchLedger, bufs: GradientBuffers, g: GroupState, tid: Hashable, variants: dict) -> None:
    """batch += c_i H_i, with the sign class's variant when sign buckets are on."""
    coef = g.coefs[tid]
    v = ANY if not ledger.sign_buckets else variant_of(coef)
    if v is not None and v in variants:
        bufs.add_to_batch(variants[v], coef)


def route_open(ledger: BatchLedger, bufs: GradientBuffers, g: GroupState, variants: dict, r: float) -> None:
    """Add gradient(s) with known reward ``r`` into the buffers of open group ``g``."""
    owner = group_owner(g.gid)
    if ledger.path == "affine":
        grads = variants[ANY]
        if g.r_ref is None:
            g.r_ref = r
        accumulate(ledger, bufs, owner, S0, grads, 1.0)
        if r != g.r_ref:
            accumulate(ledger, bufs, owner, S1, grads, r - g.r_ref)
        return
    for v, grads in variants.items():
        accumulate(ledger, bufs, owner, bucket(r, v), grads, 1.0)


def advance_commits(ledger: BatchLedger, bufs: GradientBuffers) -> None:
    """Canonical order: fold every complete group at the head of the sorted group list."""
    if ledger.path != "canonical":
        return
    g = ledger.head_complete()
    while g is not None:
        owner = group_owner(g.gid)
        for tid in canonical_sorted(g.trajs):
            traj = g.trajs[tid]
            v = ANY if not ledger.sign_buckets else variant_of(g.coefs[tid])
            if traj.processed and v is not None:
                bufs.fold(owner, stored(tid, v), g.coefs[tid])
            if ledger.has_buffer(owner, stored(tid, INDEPENDENT)):
                bufs.fold(owner, stored(tid, INDEPENDENT), 1.0)
        release(ledger, bufs, owner)
        ledger.commit_head()
        g = ledger.head_complete()
