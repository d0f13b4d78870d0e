"""The driver's planning work grows with the batch, not with its square (``benchmarks/driver_throughput.py`` measures
the speed; here the work is counted). No GPU, no Ray.

A coalescing step plans a chunk or two per free learner slot (``StreamPlanner.next_ops(max_backwards=...)``). With
a backlog of ready rows every such call used to rank and chunk ALL of them again, so a 16k-trajectory step ranked
rows ~N^2/16 times. The planner keeps a ranking's unplanned chunks until something new arrives: the rows ranked
per step are then bounded by the arrivals, whatever the backlog.
"""

from __future__ import annotations

import math
import random

import pytest

from thundersync_harness.plan_ops import effective_coefficients
from thundersync_verl.step.stream_plan import BackwardOp, FoldOp, StreamPlanner


def _counting(planner: StreamPlanner) -> list[int]:
    """Rows handed to the planner's ranking (``split_into_chunks``), one entry per ranking; the ranking itself runs."""
    ranked: list[int] = []
    rank = planner._acc.split_into_chunks

    def split(items, *args, **kwargs):
        ranked.append(len(items))
        return rank(items, *args, **kwargs)

    planner._acc.split_into_chunks = split
    return ranked


def _batch(groups: int, n: int, seed: int) -> list[tuple[str, int, float, int]]:
    """(group, member, reward, tokens) in a long-tailed landing order (members of a group land close together)."""
    rng = random.Random(seed)
    rows, times = [], []
    for g in range(groups):
        factor = rng.gauss(0.0, 0.8)
        for m in range(n):
            rows.append((f"g{g:05d}", m, float(rng.random() < 0.5), rng.randint(1, 50)))
            times.append(math.exp(factor + rng.gauss(0.0, 0.5)))
    return [row for _, row in sorted(zip(times, rows))]


def _stream(rows, *, wave: int, per_call: int, groups: int, n: int, max_backwards: int | None):
    """Land ``rows`` in waves; after each wave plan ``per_call`` times (as free slots open), then drain."""
    planner = StreamPlanner(max_chunk_size=8)
    ranked = _counting(planner)
    planner.begin_batch({f"g{g:05d}": n for g in range(groups)})
    ops = []
    for start in range(0, len(rows), wave):
        for gid, member, reward, tokens in rows[start:start + wave]:
            planner.arrive(gid, member, reward, tokens)
        for _ in range(per_call):
            ops += planner.next_ops(max_backwards=max_backwards)
    while planner.ready_count or planner.queued_folds:
        ops += planner.next_ops(max_backwards=max_backwards)
    final = planner.finalize()
    return ops, ranked, final


@pytest.mark.parametrize("groups", [64, 256])
def test_a_driver_that_keeps_up_ranks_every_row_once(groups):
    """Arrivals in waves, the driver planning one chunk per call until nothing is ready (the benchmark's regime)."""
    n, wave = 8, 64
    rows = _batch(groups, n, seed=groups)
    ops, ranked, final = _stream(rows, wave=wave, per_call=wave, groups=groups, n=n, max_backwards=1)
    assert sum(isinstance(op, BackwardOp) for op in ops) >= len(rows) // 8  # many chunks, planned one per call
    assert sum(ranked) == len(rows)  # each row ranked once (re-ranking the rest per chunk: ~N^2 / 16 rows)
    assert len(ranked) <= len(rows) // wave  # at most one ranking per wave of arrivals
    assert final.num_sequences == len(rows)


def test_a_backlog_is_ranked_once_per_arrival_wave_not_once_per_chunk():
    """The learner slower than the arrivals (two chunks per wave): the backlog grows, rankings stay one per wave."""
    groups, n, wave = 128, 8, 64
    rows = _batch(groups, n, seed=3)
    ops, ranked, final = _stream(rows, wave=wave, per_call=2, groups=groups, n=n, max_backwards=1)
    chunks = sum(isinstance(op, BackwardOp) for op in ops)
    assert chunks >= len(rows) // 8 and len(ranked) <= len(rows) // wave + 1  # not one ranking per chunk
    assert final.num_sequences == len(rows)


def test_cached_ranking_gives_every_trajectory_its_grpo_coefficient_once():
    groups, n = 48, 8
    rows = _batch(groups, n, seed=7)
    capped, _, final_capped = _stream(rows, wave=40, per_call=1, groups=groups, n=n, max_backwards=1)
    whole, _, final_whole = _stream(rows, wave=40, per_call=1, groups=groups, n=n, max_backwards=None)
    got, want = effective_coefficients(capped), effective_coefficients(whole)
    assert set(got) == set(want) == {(g, m) for g, m, _, _ in rows}
    for item in want:
        assert got[item] == pytest.approx(want[item], rel=1e-6, abs=1e-9)
    assert (final_capped.scale, final_capped.num_tokens) == (final_whole.scale, final_whole.num_tokens)
    bucketed = {op.dest for op in capped if isinstance(op, BackwardOp) and op.dest != "direct"}
    folded = {k for op in capped if isinstance(op, FoldOp) for k in op.folds}
    assert bucketed == folded  # every bucket a planned chunk opened is folded when its group closes


def test_a_new_arrival_reranks_so_a_closed_group_goes_first():
    planner = StreamPlanner(max_chunk_size=2)
    ranked = _counting(planner)
    planner.begin_batch({"a": 3, "b": 2})
    for member, reward in enumerate([1.0, 1.0, 1.0]):
        planner.arrive("a", member, reward, 5)  # group a closes: its rows go direct
    planner.arrive("b", 0, 0.0, 5)  # group b open
    first = planner.next_ops(max_backwards=1)
    assert [op.dest for op in first if isinstance(op, BackwardOp)] == ["direct"] and len(ranked) == 1
    planner.arrive("b", 1, 1.0, 5)  # b closes: its row must not go to a bucket from the old ranking
    rest = []
    while planner.ready_count or planner.queued_folds:
        rest += planner.next_ops(max_backwards=1)
    assert len(ranked) == 2
    assert all(op.dest == "direct" for op in rest if isinstance(op, BackwardOp))
    assert planner.ready == [] and planner.finalize().num_sequences == 5


def test_next_chunk_size_is_the_chunk_one_call_takes_and_ranks_once():
    """An idle learner's wait (``call_cost.call_waits``) asks for the chunk the next call would take: open groups' rows
    share a call only within their (group, reward) bucket, so it is not everything ready."""
    planner = StreamPlanner(max_chunk_size=8)
    ranked = _counting(planner)
    planner.begin_batch({"a": 4, "b": 4, "c": 4})
    for member, reward in enumerate([1.0, 0.0, 1.0]):
        planner.arrive("a", member, reward, 5)  # group a open: buckets r=1 (2 rows) and r=0 (1 row)
    assert planner.ready_count == 3 and planner.next_chunk_size() == 2
    for member in range(4):
        planner.arrive("b", member, 1.0, 5)  # group b closed: 4 rows direct, ranked first
    assert planner.next_chunk_size() == 4 and len(ranked) == 2
    assert planner.next_chunk_size() == 4 and len(ranked) == 2  # nothing new: the ranking is kept for next_ops
    (op,) = planner.next_ops(max_backwards=1)
    assert op.dest == "direct" and len(op.items) == 4 and len(ranked) == 2
    assert planner.next_chunk_size(max_chunk_size=1) == 1
