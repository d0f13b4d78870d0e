"""Where each streamed gradient goes, and how open groups fold into the batch gradient.

Why:
1. The accumulator validates and budgets; this module does the arithmetic, in one place, so
   the exactness argument can be read next to the code that implements it.
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

from typing import TYPE_CHECKING, Hashable

from .buffers import axpy_, copy_into_
from .groups import ANY, GroupState, TrajectoryState, canonical_sorted, variant_of

if TYPE_CHECKING:
    from .accumulator import StreamingGradientAccumulator


def close_group(acc: "StreamingGradientAccumulator", g: GroupState, coefs: dict) -> None:
    """Mark ``g`` closed with loss coefficients ``coefs`` and fold its buffers (not canonical)."""
    g.closed, g.coefs = True, coefs
    if acc.path == "canonical":
        return
    direct = acc._direct
    assert direct is not None
    if acc.path == "affine" and g.s0 is not None:
        _, rewards = g.sorted_rewards()
        alpha, beta = acc.estimator.affine_coefficients(rewards)
        if g.s1 is not None:
            axpy_(direct, g.s1, -alpha)
        axpy_(direct, g.s0, -(alpha * g.r_ref + beta))  # type: ignore[operator]
    coef_of_reward = {g.trajs[t].reward: c for t, c in coefs.items()}
    for (r, variant), buf in g.buckets.items():
        coef = coef_of_reward[r]
        if variant in (ANY, variant_of(coef)):
            axpy_(direct, buf, coef)
    for tid, traj in g.trajs.items():
        if traj.pending is not None:
            add_direct(acc, g, tid, traj.pending)
            traj.pending = None
            acc.pool.release(("pending", g.gid, tid))
    g.s0 = g.s1 = None
    g.buckets = {}
    acc.pool.release(("group", g.gid))


def route(
    acc: "StreamingGradientAccumulator", g: GroupState, tid: Hashable, traj: TrajectoryState, variants: dict, pending: bool
) -> None:
    """Send one trajectory's gradient variants along the route of point 2."""
    if acc.path == "canonical":
        for v, grads in variants.items():
            buf = acc.pool.allocate(("group", g.gid))
            copy_into_(buf, grads)
            traj.stored[v] = buf
    elif g.closed:
        add_direct(acc, g, tid, variants)
    elif pending:
        owner = ("pending", g.gid, tid)
        traj.pending = {}
        for v, grads in variants.items():
            buf = acc.pool.allocate(owner)
            copy_into_(buf, grads)
            traj.pending[v] = buf
    else:
        route_open(acc, g, variants, traj.reward)  # type: ignore[arg-type]


def add_direct(acc: "StreamingGradientAccumulator", g: GroupState, tid: Hashable, variants: dict) -> None:
    """batch += c_i H_i, with the sign class's variant when sign buckets are on."""
    coef = g.coefs[tid]
    v = ANY if not acc.sign_buckets else variant_of(coef)
    if v is not None and v in variants:
        axpy_(acc._direct, variants[v], coef)  # type: ignore[arg-type]


def route_open(acc: "StreamingGradientAccumulator", g: GroupState, variants: dict, r: float) -> None:
    """Add gradient(s) with known reward ``r`` into the buffers of open group ``g``."""
    owner = ("group", g.gid)
    if acc.path == "affine":
        grads = variants[ANY]
        if g.r_ref is None:
            g.r_ref = r
        if g.s0 is None:
            g.s0 = acc.pool.allocate(owner)
        axpy_(g.s0, grads, 1.0)
        if r != g.r_ref:
            if g.s1 is None:
                g.s1 = acc.pool.allocate(owner)
            axpy_(g.s1, grads, r - g.r_ref)
        return
    for v, grads in variants.items():
        key = (r, v)
        if key not in g.buckets:
            g.buckets[key] = acc.pool.allocate(owner)
        axpy_(g.buckets[key], grads, 1.0)


def advance_commits(acc: "StreamingGradientAccumulator") -> None:
    """Canonical order: fold every complete group at the head of the sorted group list."""
    if acc.path != "canonical":
        return
    while acc._commit_pos < len(acc._order):
        g = acc._groups[acc._order[acc._commit_pos]]
        if not (g.closed and g.locally_complete(acc.independent_terms)):
            return
        for tid in canonical_sorted(g.trajs):
            traj = g.trajs[tid]
            v = ANY if not acc.sign_buckets else variant_of(g.coefs[tid])
            if traj.processed and v is not None:
                axpy_(acc._direct, traj.stored[v], g.coefs[tid])  # type: ignore[arg-type]
            if "independent" in traj.stored:
                axpy_(acc._direct, traj.stored["independent"], 1.0)  # type: ignore[arg-type]
            traj.stored = {}
        g.committed = True
        acc.pool.release(("group", g.gid))
        acc._commit_pos += 1
