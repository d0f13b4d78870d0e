"""Tail batching in the one streamed step (``step/tail_gate.py``), without Ray: the batch closes on its first P
complete groups, the rest never reach the learner, and the update is GRPO's update of exactly the kept groups."""

from __future__ import annotations

import pytest

from thundersync_harness.stream_fakes import FakeLearner, FakeTQ, effective_coefficients, grpo_advantages, grpo_step
from thundersync_verl.step.tail_gate import TailGate, TailRound
from thundersync_verl.step.trajectory_source import TrajectoryNeverArrived

REWARDS = {"a": [1.0, 0.0, 1.0], "b": [0.0, 0.0, 1.0], "c": [1.0, 1.0, 0.0], "d": [0.0, 1.0, 1.0]}


def _launch(tq: FakeTQ, complete_at: dict[str, int]) -> None:
    """Every group's members land one poll apart, its last one at ``complete_at[uid]`` (None: never completes)."""
    for uid, rewards in REWARDS.items():
        last = complete_at.get(uid)
        for s, r in enumerate(rewards):
            at = (last if last is not None else 10) - (len(rewards) - 1 - s)
            if last is not None or s == 0:  # a group that never completes lands its first member only
                tq.add(f"{uid}_{s}_0", r, visible_at=at)


@pytest.mark.parametrize("coalesce", [True, False])
def test_the_first_p_complete_groups_are_the_batch_and_the_rest_are_aborted_once(coalesce):
    tq, learner, aborted = FakeTQ(), FakeLearner(), []
    _launch(tq, {"b": 4, "d": 6, "a": 9, "c": None})  # b then d complete first; a completes later; c never does
    tail = TailRound(p=2, on_abort=aborted.append)
    step = grpo_step(tq, learner, list(REWARDS), 3, coalesce=coalesce, tail=tail)
    out, state = step.run()
    kept = {u: REWARDS[u] for u in ("b", "d")}
    assert state.tail_kept == {"b": "00000000", "d": "00000001"}
    assert sorted(state.tail_dropped) == ["a", "c"] and aborted == [["a", "c"]]  # both still running when d closed
    assert sorted(state.keys) == sorted(f"{u}_{s}_0" for u in kept for s in range(3))  # nothing of a or c trained
    assert sorted(effective_coefficients(learner.calls)) == pytest.approx(grpo_advantages(kept), abs=1e-6)
    assert not any(c[0] == "fold" for c in learner.calls)  # a kept group is handed on whole: every row direct
    assert learner.steps == [pytest.approx(1 / 6)]  # the normaliser counts the kept groups' 6 sequences only


def test_a_pinned_group_is_kept_whatever_its_length_and_awaited():
    tq, learner, aborted = FakeTQ(), FakeLearner(), []
    _launch(tq, {"a": 3, "b": 4, "c": 5, "d": 12})  # d, pinned, completes last
    step = grpo_step(tq, learner, list(REWARDS), 3, tail=TailRound(p=2, pinned=["d"], on_abort=aborted.append))
    out, state = step.run()
    assert state.tail_kept == {"a": "00000000", "d": "00000001"} and aborted == [["b", "c"]]
    kept = {u: REWARDS[u] for u in ("a", "d")}
    assert sorted(effective_coefficients(learner.calls)) == pytest.approx(grpo_advantages(kept), abs=1e-6)


def test_an_aborted_groups_failed_agent_loop_is_not_the_steps_failure_but_a_kept_ones_is():
    tq, learner = FakeTQ(), FakeLearner()
    _launch(tq, {"a": 3, "b": 4, "c": None, "d": None})
    tq.add("c", 0.0, visible_at=6, status="failure", is_prompt=True)  # the abort ends c's agent loop
    out, state = grpo_step(tq, learner, list(REWARDS), 3, tail=TailRound(p=2)).run()
    assert sorted(state.tail_kept) == ["a", "b"] and learner.steps == [pytest.approx(1 / 6)]
    tq2, learner2 = FakeTQ(), FakeLearner()
    _launch(tq2, {"a": 3, "b": None, "c": None, "d": None})
    tq2.add("b", 0.0, visible_at=2, status="failure", is_prompt=True)  # before the places are full: the batch's
    with pytest.raises(TrajectoryNeverArrived, match="prompt b: its agent loop failed"):
        grpo_step(tq2, learner2, list(REWARDS), 3, tail=TailRound(p=3)).run()
    assert learner2.steps == []


def test_the_gate_refuses_a_stranger_and_hands_on_members_by_sample_index():
    gate = TailGate(["x", "y"], 2, p=1)
    with pytest.raises(ValueError, match="not an expected sample"):
        gate.add([("z_0_0", {})])
    gate.add([("y_1_0", {}), ("x_0_0", {}), ("y_0_0", {})])
    assert [k for k, _ in gate.take()] == ["y_0_0", "y_1_0"] and gate.alias["y_1_0"] == "00000000_0001"
    assert gate.empty and gate.dropped == ["x"] and gate.aborted == ["x"]
    with pytest.raises(ValueError, match="landed twice"):
        gate.add([("y_0_0", {})])
