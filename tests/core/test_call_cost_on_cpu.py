"""The learner-call duration model (``core/call_cost.py``) that times just-in-time planning.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import pytest

from thundersync_verl.core.call_cost import CallCost, call_waits, queue_end


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


def _fitted(fixed: float, per_token: float) -> CallCost:
    model = CallCost(decay=1.0)
    for tokens in (80, 160, 320, 640):
        model.observe("backward", tokens, fixed + per_token * tokens)
    return model


@pytest.mark.parametrize("chunk, ready, coming, full, waits", [
    (80, 80, 10_000, 10_000, True),       # one row of 80 tokens: the call would be 0.8 s fixed, 0.08 s work
    (7_000, 7_000, 10_000, 10_000, True),  # 7 s of work: still below 0.9 of the call (7.2 s of work wanted)
    (7_300, 7_300, 10_000, 10_000, False),  # past 0.9: it goes
    (80, 80, 10_000, 640, True),          # a full chunk (640 tokens) is less than 0.9 wants: wait for the full chunk
    (640, 640, 10_000, 640, False),       # ... and it is there
    (80, 80, 5_000, 10_000, False),       # what is still to land could not make the call efficient: go now (the tail)
    (80, 7_300, 10_000, 10_000, False),   # a small bucket chunk, but a whole efficient call's work is ready: go
    (80, 7_000, 10_000, 10_000, True),    # ... not yet
])
def test_an_idle_call_waits_while_rows_still_to_land_would_make_it_efficient(chunk, ready, coming, full, waits):
    model = _fitted(fixed=0.8, per_token=0.001)  # a call's fixed cost is 800 tokens of work
    assert call_waits(model, chunk_tokens=chunk, ready_tokens=ready, coming_tokens=coming, full_tokens=full,
                      efficiency=0.9) is waits


def test_no_call_waits_without_a_fixed_cost_model_or_with_the_knob_off_or_rows_that_outweigh_the_fixed_cost():
    never = dict(chunk_tokens=1, ready_tokens=1, coming_tokens=1e9, full_tokens=1e9)
    assert not call_waits(CallCost(), efficiency=0.9, **never)
    assert not call_waits(_fitted(0.8, 0.001), efficiency=0.0, **never)
    gpu = _fitted(fixed=0.05, per_token=0.0005)  # a GPU row of 4000 tokens: 2 s against a 50 ms fixed cost
    assert not call_waits(gpu, chunk_tokens=4000, ready_tokens=4000, coming_tokens=1e9, full_tokens=32_000,
                          efficiency=0.9)
