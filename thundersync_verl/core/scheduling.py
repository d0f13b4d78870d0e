"""Scheduling hints and backward chunks for the streaming accumulator.

Why:
1. Open groups cost memory (about 2 full gradients each on the affine path). The learner
   decides which ready trajectory to backpropagate next; ranking them bounds the open groups:
       0. trajectories whose group is closed: straight into the batch gradient, no memory;
       1. trajectories of groups that already hold buffers: no new memory;
       2. the same, with the reward still unknown: one pending buffer each, if it fits;
       3. trajectories of NEW groups while the budget allows, the group with the most known
          rewards first (it is the closest to closing and freeing its buffers).
   Anything that does not fit WAITS. Exactness never trades for memory.
2. Canonical order folds groups strictly in sorted order, so a later group cannot free its
   buffers before the earlier ones commit. To stay deadlock-free the budget always keeps room
   for the first uncommitted group (the head): a non-head group is admitted only if the head's
   worst-case reservation still fits afterwards.
3. One backward per trajectory costs kernel-launch and framework overhead per call. A CHUNK
   of several trajectories shares one backward when every member's loss weight is fixed:
   all members in closed groups (weights -A_i, destination: batch gradient), or all members
   of ONE open group with the SAME known reward (weight 1, destination: that reward's bucket,
   also exact on the affine path since S0 and S1 are both linear in the chunk's sum).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Sequence

from . import folding as _folding
from .buffers import axpy_
from .errors import StreamingConfigError, StreamingInputError, StreamingStateError, rule_message
from .groups import ANY, NEG, POS, TrajectoryState, canonical_sorted, variant_of
from .normalizers import check_count

if TYPE_CHECKING:
    from .accumulator import ChunkPlan, StreamingGradientAccumulator

Item = tuple[Hashable, Hashable]


@dataclass
class ScheduleHint:
    """Ready trajectories split into those to run now (in this order) and those that wait."""

    run: list[Item] = field(default_factory=list)
    wait: list[Item] = field(default_factory=list)


def group_reservation(acc: "StreamingGradientAccumulator", g) -> int:
    """Buffers a group reserves when it first needs memory: its worst case on its path."""
    if acc.path == "canonical":
        return g.n_local * (len(acc.variants) + (1 if acc.independent_terms else 0))
    if acc.path == "affine":
        return 2
    cap = g.n_local if acc.max_distinct_rewards is None else min(g.n_local, acc.max_distinct_rewards)
    return cap * len(acc.variants)


def reserve(acc: "StreamingGradientAccumulator", g, *, need_group: bool, pending: bool, tid: Hashable | None) -> None:
    """Reserve what one incoming gradient needs, all or nothing (raises before reserving)."""
    group_owner = ("group", g.gid)
    extra_group = 0
    if need_group and acc.pool.reserved_buffers(group_owner) == 0:
        extra_group = group_reservation(acc, g)
    extra_pending = len(acc.variants) if pending else 0
    headroom = canonical_headroom(acc, g) if extra_group else 0
    acc.pool.check_fits(group_owner, extra_group + extra_pending + headroom)
    if extra_group:
        acc.pool.reserve(group_owner, extra_group, is_group=True)
    if extra_pending:
        acc.pool.reserve(("pending", g.gid, tid), extra_pending, is_group=False)


def canonical_headroom(acc: "StreamingGradientAccumulator", g, reserved_head: int | None = None) -> int:
    """Buffers to keep free for the head group when admitting non-head group ``g``."""
    if acc.path != "canonical" or acc._commit_pos >= len(acc._order):
        return 0
    head = acc._order[acc._commit_pos]
    if g.gid == head:
        return 0
    worst = max(group_reservation(acc, acc._groups[gid]) for gid in acc._order[acc._commit_pos :])
    if reserved_head is None:
        reserved_head = acc.pool.reserved_buffers(("group", head))
    return max(0, worst - reserved_head)


def _unprocessed(acc: "StreamingGradientAccumulator", item: Item):
    gid, tid = item
    g = acc._group(gid)
    g.check_member(tid, for_gradient=True)
    traj = g.trajs.get(tid)
    if traj is not None and traj.processed:
        raise StreamingInputError(
            rule_message(
                f"trajectory {item!r} was already added",
                "a ready list must only hold trajectories still waiting for their backward",
                "drop trajectories from the ready list once they are added",
            )
        )
    return g, traj


def rank_ready(acc: "StreamingGradientAccumulator", items: Sequence[Item]) -> ScheduleHint:
    """Order ready trajectories by the rule in the module docstring; see point 1."""
    acc._require_batch()
    classes: dict[int, list[Item]] = {0: [], 1: [], 2: [], 3: []}
    for item in items:
        g, traj = _unprocessed(acc, item)
        reward_known = traj is not None and traj.reward is not None
        holds = acc.pool.reserved_buffers(("group", g.gid)) > 0
        if acc.path != "canonical" and g.closed:
            classes[0].append(item)
        elif holds:
            classes[1 if (reward_known or acc.path == "canonical") else 2].append(item)
        else:
            classes[3].append(item)
    pos = {gid: i for i, gid in enumerate(acc._order)}
    rank = _item_ranks(items, pos)

    def key(it: Item):
        return rank[it]

    hint = ScheduleHint(run=sorted(classes[0], key=key) + sorted(classes[1], key=key))
    extra = 0
    n_var = len(acc.variants)
    for item in sorted(classes[2], key=key):
        if acc.pool.fits(extra + n_var):
            extra += n_var
            hint.run.append(item)
        else:
            hint.wait.append(item)
    _admit_new_groups(acc, classes[3], hint, extra, pos, key)
    return hint


def _admit_new_groups(acc, items: list[Item], hint: ScheduleHint, extra: int, pos: dict, key) -> None:
    """Admit whole new groups in priority order while their reservations fit (point 1.3)."""
    by_group: dict[Hashable, list[Item]] = {}
    for it in items:
        by_group.setdefault(it[0], []).append(it)

    def priority(gid):
        g = acc._groups[gid]
        if acc.path == "canonical":
            return (pos[gid],)
        return (-(g.num_rewards + len(by_group[gid])), pos[gid])

    head = acc._order[acc._commit_pos] if acc._commit_pos < len(acc._order) else None
    head_reserved = acc.pool.reserved_buffers(("group", head)) if head is not None else 0
    n_var = len(acc.variants)
    for gid in sorted(by_group, key=priority):
        g = acc._groups[gid]
        members = sorted(by_group[gid], key=key)
        unknown = sum(1 for it in members if _reward_unknown(g, it[1]))
        need = group_reservation(acc, acc._groups[gid])
        pend = 0 if (g.closed or acc.path == "canonical") else unknown * n_var
        room = canonical_headroom(acc, g, reserved_head=head_reserved)
        if acc.pool.fits(extra + need + pend + room):
            extra += need + pend
            if gid == head:
                head_reserved = need
            hint.run.extend(members)
        else:
            hint.wait.extend(members)


def _item_ranks(items: Sequence[Item], pos: dict) -> dict:
    """Canonical rank of each item: sorted group order, then sorted trajectory id."""
    by_group: dict[Hashable, list[Hashable]] = {}
    for gid, tid in items:
        by_group.setdefault(gid, []).append(tid)
    ranks, i = {}, 0
    for gid in sorted(by_group, key=lambda g: pos[g]):
        for tid in canonical_sorted(by_group[gid]):
            ranks[(gid, tid)] = i
            i += 1
    return ranks


def _reward_unknown(g, tid) -> bool:
    t = g.trajs.get(tid)
    return t is None or t.reward is None


def split_into_chunks(
    acc: "StreamingGradientAccumulator", items: Sequence[Item], max_chunk_size: int, min_open_chunk: int = 1
):
    """Ranked ready trajectories as backward chunks (lists of items) plus the waiting ones.

    ``min_open_chunk`` > 1 defers open-group chunks smaller than that: they wait to grow or for
    their group to close (rewards arrive independently of the learner, so nothing starves).
    Fewer, larger backwards cost less per token; a learner with nothing else to do should
    call again with 1.
    """
    for name, value in (("max_chunk_size", max_chunk_size), ("min_open_chunk", min_open_chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise StreamingConfigError(
                rule_message(
                    f"{name} must be a positive int (got {value!r})",
                    "it bounds how many trajectories share one backward",
                    f"pass e.g. {name}=8",
                )
            )
    hint = rank_ready(acc, items)
    chunks: list[list[Item]] = []
    open_key_to_chunk: dict[tuple, list[Item]] = {}
    closed_chunk: list[Item] = []
    for item in hint.run:
        g = acc._groups[item[0]]
        traj = g.trajs.get(item[1])
        if acc.path == "canonical" or (not g.closed and (traj is None or traj.reward is None)):
            chunks.append([item])
            continue
        if g.closed:
            if len(closed_chunk) == max_chunk_size:
                closed_chunk = []
            if not closed_chunk:
                chunks.append(closed_chunk)
            closed_chunk.append(item)
            continue
        k = (item[0], traj.reward)  # type: ignore[union-attr]
        cur = open_key_to_chunk.get(k)
        if cur is None or len(cur) == max_chunk_size:
            cur = []
            open_key_to_chunk[k] = cur
            chunks.append(cur)
        cur.append(item)
    if min_open_chunk == 1 or acc.path == "canonical":
        return chunks, hint.wait
    keep, wait = [], list(hint.wait)
    for chunk in chunks:
        small_open = len(chunk) < min_open_chunk and not acc._groups[chunk[0][0]].closed
        (wait.extend if small_open else keep.append)(chunk)
    return keep, wait


def plan_chunk(acc: "StreamingGradientAccumulator", items: Sequence[Item]) -> "ChunkPlan":
    """The loss weights that let ``items`` share one backward; see point 3."""
    from .accumulator import ChunkPlan

    acc._require_batch()
    if acc.path == "canonical":
        raise StreamingConfigError(
            rule_message(
                "chunks are not available with canonical_order=True",
                "the canonical order sums each trajectory's gradient separately in a fixed order; "
                "a chunk's backward would sum its members in whatever order they were batched",
                "use add_policy_grad per trajectory, or turn canonical_order off",
            )
        )
    items = [tuple(it) for it in items]  # type: ignore[misc]
    if not items or len(set(items)) != len(items):
        raise StreamingInputError(
            rule_message("a chunk needs distinct trajectories", "each is counted once", "pass unique (gid, tid) pairs")
        )
    states = [_unprocessed(acc, it) for it in items]
    if all(g.closed for g, _ in states):
        coefs = tuple(g.coefs[it[1]] for (g, _), it in zip(states, items))
        signs = tuple(variant_of(c) if acc.sign_buckets else None for c in coefs)
        return ChunkPlan(acc._serial, tuple(items), coefs, signs, "direct")
    rewards = {t.reward if t is not None else None for _, t in states}
    gids = {it[0] for it in items}
    if len(gids) == 1 and len(rewards) == 1 and None not in rewards:
        n = len(items)
        return ChunkPlan(acc._serial, tuple(items), (1.0,) * n, (None,) * n, "bucket", rewards.pop())
    raise StreamingInputError(
        rule_message(
            f"trajectories {items} cannot share one backward",
            "a chunk's loss weights must be fixed when its backward runs: either all members are "
            "in closed groups (weights -A_i), or all are in ONE open group with the SAME known reward",
            "use split_into_chunks(ready, max_chunk_size) to form valid chunks",
        )
    )


def add_chunk_grad(acc, plan: "ChunkPlan", grads, num_tokens: Sequence[int], grads_negative=None) -> None:
    """Add the gradient of sum_i plan.loss_weights[i] * sum_t w_{i,t} log pi_i."""
    acc._require_batch()
    if plan.batch_serial != acc._serial:
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
        _unprocessed(acc, it)
    g = acc._groups[plan.items[0][0]]
    if plan.destination == "direct" or g.closed:
        dest = _closed_chunk_grads(acc, plan, g, grads, grads_negative)
        if dest is not None:
            acc.layout.check(dest[0])
        _mark(acc, plan, num_tokens)
        if dest is not None:
            axpy_(acc._direct, dest[0], dest[1])
    else:
        variants = {ANY: grads} if not acc.sign_buckets else {POS: grads, NEG: grads_negative}
        for v, gr in variants.items():
            if gr is None:
                raise StreamingInputError(
                    rule_message(
                        "an open-group chunk with sign buckets needs grads and grads_negative",
                        "the sign of the group's advantage for this reward is not known yet",
                        "backpropagate the chunk once with each sign class's token weights",
                    )
                )
            acc.layout.check(gr, "grads_negative" if v == NEG else "grads")
        acc._check_bucket_room(g, plan.reward)
        reserve(acc, g, need_group=True, pending=False, tid=None)
        _mark(acc, plan, num_tokens)
        _folding.route_open(acc, g, variants, plan.reward)
    _folding.advance_commits(acc)


def _closed_chunk_grads(acc, plan, g, grads, grads_negative):
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
    if not acc.sign_buckets:
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


def _mark(acc, plan, num_tokens) -> None:
    for (gid, tid), n in zip(plan.items, num_tokens):
        traj = acc._groups[gid].trajs.setdefault(tid, TrajectoryState())
        traj.processed = True
        acc._counts.add(n, 1 if n > 0 else 0)
