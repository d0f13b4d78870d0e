"""The learner-call duration model (``core/call_cost.py``) that times just-in-time planning.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import pytest

from thundersync_verl.core.call_cost import CallCost, queue_end


def test_nothing_is_predicted_before_a_call_of_that_kind_was_seen():
    model = CallCost()
    assert model.predict("backward", 100) is None and model.lead_s is None
    model.observe("fold", 0, 0.004)
    assert model.predict("backward", 100) is None
    assert model.predict("fold", 0) == pytest.approx(0.004)
    assert queue_end(model, 10.0, [("fold", 0, 10.0), ("backward", 80, 10.0)]) is None


def test_backward_durations_recover_the_fixed_and_per_token_cost():
    model = CallCost()
    for tokens in (70, 150, 300, 75, 225, 450):
        model.observe("backward", tokens, 0.02 + 0.0006 * tokens)
    assert model.predict("backward", 0) == pytest.approx(0.02, abs=1e-9)
    assert model.predict("backward", 1000) == pytest.approx(0.62, abs=1e-9)


def test_one_size_seen_gives_its_cost_per_token():
    model = CallCost(decay=1.0)
    model.observe("backward", 100, 0.08)
    model.observe("backward", 100, 0.06)
    assert model.predict("backward", 200) == pytest.approx(0.14)  # 0.07 s per 100 tokens


def test_the_machine_slowing_down_moves_the_estimate_within_a_few_calls():
    model = CallCost(decay=0.8)
    for tokens in (100, 200) * 20:
        model.observe("backward", tokens, 0.001 * tokens)
    for tokens in (100, 200) * 10:
        model.observe("backward", tokens, 0.0015 * tokens)  # 50% slower from here on
    assert model.predict("backward", 200) == pytest.approx(0.3, rel=0.02)


def test_a_negative_fit_falls_back_to_the_mean_cost_per_token():
    model = CallCost(decay=1.0)
    model.observe("backward", 100, 0.2)
    model.observe("backward", 200, 0.1)  # noise: a bigger call ran faster
    assert model.predict("backward", 300) == pytest.approx(0.3)  # 0.3 s over 300 tokens seen


def test_the_lead_is_a_moving_average_of_idle_starts():
    model = CallCost(lead_decay=0.5)
    model.observe_lead(0.04)
    model.observe_lead(0.02)
    assert model.lead_s == pytest.approx(0.03)


def test_the_margin_adds_the_recent_prediction_error_to_the_lead():
    model = CallCost(decay=1.0, lead_decay=0.5)
    model.observe_lead(0.02)
    model.observe("backward", 100, 0.1)
    assert model.margin_s == pytest.approx(0.02)  # nothing was predicted yet: no error
    model.observe("backward", 100, 0.14)  # predicted 0.1: 0.04 off
    assert model.margin_s == pytest.approx(0.02 + 0.5 * 0.04)


def test_the_queue_ends_after_each_call_in_turn_and_no_call_starts_before_it_reached_the_learner():
    model = CallCost()
    model.observe("backward", 100, 0.1)
    model.observe_lead(0.05)
    # the learner is free at 1.0; the head call was submitted at 0.5 (already there), the next at 1.2 (reaches 1.25)
    assert queue_end(model, 1.0, [("backward", 100, 0.5)]) == pytest.approx(1.1)
    assert queue_end(model, 1.0, [("backward", 100, 0.5), ("backward", 200, 1.2)]) == pytest.approx(1.25 + 0.2)


@pytest.mark.parametrize("bad", [0.0, 1.5, -0.1])
def test_a_decay_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="decay must be in"):
        CallCost(decay=bad)
