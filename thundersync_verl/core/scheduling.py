"""Scheduling hints and backward chunk plans for the streaming accumulator.

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
4. Everything here reads the ledger only (no gradient tensor), so a planner that holds no
   gradients ranks and chunks exactly as the learner does; chunks.py adds a planned chunk's
   gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError, int_at_least, rule_message
from thundersync_verl.core.groups import canonical_sorted, variant_of
from thundersync_verl.core.ledger import BatchLedger, Item


@dataclass
class ScheduleHint:
    """Ready trajectories split into those to run now (in this order) and those that wait."""

    run: list[Item] = field(default_factory=list)
    wait: list[Item] = field(default_factory=list)


@dataclass(frozen=True)
class ChunkPlan:
    """Trajectories that can share one backward: sum_i loss_weights[i] * sum_t w log pi."""

    batch_serial: int
    items: tuple[tuple[Hashable, Hashable], ...]
    loss_weights: tuple[float, ...]
    sign_classes: tuple[str | None, ...]  # per item, for sign buckets in closed groups
    destination: str  # "direct" (closed groups) or "bucket" (one open group, one reward)
    reward: float | None = None


def rank_ready(ledger: BatchLedger, items: Sequence[Item]) -> ScheduleHint:
    """Order ready trajectories by the rule in the module docstring; see point 1."""
    ledger.require_batch()
    classes: dict[int, list[Item]] = {0: [], 1: [], 2: [], 3: []}
    for item in items:
        g, traj = ledger.unprocessed(item)
        reward_known = traj is not None and traj.reward is not None
        holds = ledger.group_reserved(g.gid) > 0
        if ledger.path != "canonical" and g.closed:
            classes[0].append(item)
        elif holds:
            classes[1 if (reward_known or ledger.path == "canonical") else 2].append(item)
        else:
            classes[3].append(item)
    pos = {gid: i for i, gid in enumerate(ledger.order)}
    rank = _item_ranks(items, pos)

    def key(it: Item):
        return rank[it]

    hint = ScheduleHint(run=sorted(classes[0], key=key) + sorted(classes[1], key=key))
    extra = 0
    n_var = len(ledger.variants)
    for item in sorted(classes[2], key=key):
        if ledger.budget.fits(extra + n_var):
            extra += n_var
            hint.run.append(item)
        else:
            hint.wait.append(item)
    _admit_new_groups(ledger, classes[3], hint, extra, pos, key)
    return hint


def _admit_new_groups(ledger: BatchLedger, items: list[Item], hint: ScheduleHint, extra: int, pos: dict, key) -> None:
    """Admit whole new groups in priority order while their reservations fit (point 1.3)."""
    by_group: dict[Hashable, list[Item]] = {}
    for it in items:
        by_group.setdefault(it[0], []).append(it)

    def priority(gid):
        g = ledger.group(gid)
        if ledger.path == "canonical":
            return (pos[gid],)
        return (-(g.num_rewards + len(by_group[gid])), pos[gid])

    head = ledger.head
    head_reserved = ledger.group_reserved(head) if head is not None else 0
    n_var = len(ledger.variants)
    for gid in sorted(by_group, key=priority):
        g = ledger.group(gid)
        members = sorted(by_group[gid], key=key)
        unknown = sum(1 for it in members if _reward_unknown(g, it[1]))
        need = ledger.group_reservation(g)
        pend = 0 if (g.closed or ledger.path == "canonical") else unknown * n_var
        room = ledger.canonical_headroom(g, reserved_head=head_reserved)
        if ledger.budget.fits(extra + need + pend + room):
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
    ledger: BatchLedger, items: Sequence[Item], max_chunk_size: int, min_open_chunk: int = 1
):
    """Ranked ready trajectories as backward chunks (lists of items) plus the waiting ones.

    ``min_open_chunk`` > 1 defers open-group chunks smaller than that: they wait to grow or for
    their group to close (rewards arrive independently of the learner, so nothing starves).
    Fewer, larger backwards cost less per token; a learner with nothing else to do should
    call again with 1.
    """
    for name, value in (("max_chunk_size", max_chunk_size), ("min_open_chunk", min_open_chunk)):
        if not int_at_least(value, 1):
            raise StreamingConfigError(
                rule_message(
                    f"{name} must be a positive int (got {value!r})",
                    "it bounds how many trajectories share one backward",
                    f"pass e.g. {name}=8",
                )
            )
    hint = rank_ready(ledger, items)
    chunks: list[list[Item]] = []
    open_key_to_chunk: dict[tuple, list[Item]] = {}
    closed_chunk: list[Item] = []
    for item in hint.run:
        g = ledger.group(item[0])
        traj = g.trajs.get(item[1])
        if ledger.path == "canonical" or (not g.closed and (traj is None or traj.reward is None)):
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
    if min_open_chunk == 1 or ledger.path == "canonical":
        return chunks, hint.wait
    keep, wait = [], list(hint.wait)
    for chunk in chunks:
        small_open = len(chunk) < min_open_chunk and not ledger.group(chunk[0][0]).closed
        (wait.extend if small_open else keep.append)(chunk)
    return keep, wait


def plan_chunk(ledger: BatchLedger, items: Sequence[Item]) -> ChunkPlan:
    """The loss weights that let ``items`` share one backward; see point 3."""
    ledger.require_batch()
    if ledger.path == "canonical":
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
    states = [ledger.unprocessed(it) for it in items]
    if all(g.closed for g, _ in states):
        coefs = tuple(g.coefs[it[1]] for (g, _), it in zip(states, items))
        signs = tuple(variant_of(c) if ledger.sign_buckets else None for c in coefs)
        return ChunkPlan(ledger.serial, tuple(items), coefs, signs, "direct")
    rewards = {t.reward if t is not None else None for _, t in states}
    gids = {it[0] for it in items}
    if len(gids) == 1 and len(rewards) == 1 and None not in rewards:
        n = len(items)
        return ChunkPlan(ledger.serial, tuple(items), (1.0,) * n, (None,) * n, "bucket", rewards.pop())
    raise StreamingInputError(
        rule_message(
            f"trajectories {items} cannot share one backward",
            "a chunk's loss weights must be fixed when its backward runs: either all members are "
            "in closed groups (weights -A_i), or all are in ONE open group with the SAME known reward",
            "use split_into_chunks(ready, max_chunk_size) to form valid chunks",
        )
    )
