"""Tail batching's policy (core/tail_policy.py): the rounds it plans, the groups it keeps, the queue it keeps."""

from __future__ import annotations

import json
import random

import pytest

from thundersync_verl.core import StreamingInputError, StreamingStateError
from thundersync_verl.core.tail_policy import Deferred, TailBatch, TailQueue, launch_size, plan_launch, select_first


@pytest.mark.parametrize("seed", range(20))
def test_online_selection_keeps_the_groups_the_offline_one_keeps(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 12)
    p = rng.randint(1, n)
    pinned = [rng.random() < 0.2 for _ in range(n)]
    while sum(pinned) > p:
        pinned[pinned.index(True)] = False
    close = [rng.choice([rng.random(), 0.5]) for _ in range(n)]  # ties too: launch order breaks them
    kept, closer = select_first(close, pinned, p)
    batch = TailBatch(range(n), [g for g in range(n) if pinned[g]], p)
    online = {}
    for g in sorted(range(n), key=lambda g: close[g]):
        online[g] = batch.complete(g)
        if g == closer:
            assert batch.full  # the group that closes the free places fills the last one
    assert [online[g] for g in range(n)] == kept and sum(kept) == p
    assert batch.closed and sorted(batch.to_abort()) == [g for g in range(n) if not kept[g]]


def test_the_free_groups_still_running_are_aborted_once_the_places_are_full_and_pinned_ones_awaited():
    batch = TailBatch(["a", "b", "c", "d"], pinned=["d"], p=2)
    assert batch.to_abort() == [] and not batch.closed
    assert batch.complete("b") is True  # the one free place
    assert batch.full and batch.to_abort() == ["a", "c"] and not batch.closed  # the pinned group still runs
    assert batch.complete("a") is False  # completed too late: not trained
    assert batch.complete("d") is True and batch.closed
    with pytest.raises(StreamingStateError, match="completed twice"):
        batch.complete("b")
    with pytest.raises(StreamingStateError, match="not launched"):
        batch.complete("z")


def test_bad_rounds_are_refused_naming_the_setting():
    with pytest.raises(StreamingInputError, match="eta=0.9 must be >= 1"):
        launch_size(0.9, 8)
    assert launch_size(1.0, 8) == 8 and launch_size(1.25, 8) == 10 and launch_size(1.3, 10) == 13
    with pytest.raises(StreamingInputError, match="pinned <= P <= launched"):
        TailBatch([1, 2], pinned=[1, 2], p=1)
    with pytest.raises(StreamingInputError, match="max_deferrals"):
        TailQueue(-1)
    with pytest.raises(StreamingInputError, match="rounds='sometimes'"):
        TailQueue(2, "sometimes")


def test_a_prompt_aborted_k_times_is_pinned_and_mixed_rounds_take_the_queue_first():
    queue = [Deferred("old", 2, 0), Deferred("new", 0, 3), Deferred("mid", 1, 2)]
    plan = plan_launch(queue, n=5, p=4, max_deferrals=2, rounds="mixed")
    assert [e.prompt for e in plan.queued] == ["old", "new", "mid"] and plan.pinned == 1 and plan.fresh == 2
    assert plan.size == 5


def test_dedicated_rounds_hold_the_queue_until_it_fills_a_round():
    short = [Deferred(i, 1, 0) for i in range(3)]
    held = plan_launch(short, n=5, p=4, max_deferrals=2, rounds="dedicated")
    assert held.queued == () and held.fresh == 5  # a fresh round: the queue waits
    full = [Deferred(i, 1, 0) for i in range(5)]
    own = plan_launch(full, n=5, p=4, max_deferrals=2, rounds="dedicated")
    assert len(own.queued) == 5 and own.fresh == 0  # a round of queued prompts alone
    pins = [Deferred(i, 2, 0) for i in range(4)] + [Deferred(9, 0, 1)]
    pinned = plan_launch(pins, n=5, p=4, max_deferrals=2, rounds="dedicated")
    assert [e.prompt for e in pinned.queued] == [0, 1, 2, 3] and pinned.pinned == 4 and pinned.fresh == 0


def test_the_queue_loses_and_duplicates_nothing_over_rounds_and_survives_a_checkpoint():
    rng = random.Random(0)
    queue, fresh, trained, p = TailQueue(max_deferrals=2, rounds="dedicated"), 0, [], 4
    for step in range(30):
        plan = queue.plan(launch_size(1.5, p), p)
        launched = [(e.prompt, e.aborted, e.first_step) for e in plan.queued]
        launched += [(fresh + i, 0, step) for i in range(plan.fresh)]
        fresh += plan.fresh
        batch = TailBatch(range(len(launched)), range(plan.pinned), p)
        for g in rng.sample(range(len(launched)), len(launched)):
            batch.complete(g)
        for g, (prompt, aborted, first) in enumerate(launched):
            if g in batch.kept:
                trained.append(prompt)
            else:
                queue.requeue(prompt, aborted, first, ran=True)
        assert all(e.aborted <= 2 for e in queue.items)  # pinned at 2 aborts: kept on its next run
        if step == 15:  # a resume in the middle: the queue is restored exactly
            state = json.loads(json.dumps(queue.state_dict()))
            queue = TailQueue.from_state(state)
            assert queue.state_dict() == state
    queued = [e.prompt for e in queue.items]
    assert sorted(trained + queued) == list(range(fresh))  # every prompt trained once or still queued
    assert len(trained) == 30 * p
