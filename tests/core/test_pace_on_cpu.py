"""PACE's effective-staleness score, rejection budget and ranking, against hand-computed values.

Each expected number is worked out in the comment above it from the formulas in
``thundersync_verl/core/pace.py`` (numbered there).

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import pytest
import torch

from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError
from thundersync_verl.core.pace import (
    DriftCalibration,
    PaceSettings,
    Segment,
    decide,
    effective_staleness,
    generation_staleness,
    histogram,
    in_version_units,
    measured_drift_nats,
    measured_segment_drift,
    rejection_budget,
    segments_from_span,
    segment_of_tokens,
    segments_from_turns,
    select_rejections,
    waiting_staleness,
)

# 10 tokens by version 2, 20 by version 4, 10 by version 5; the group finished when the learner was at 5.
SEGMENTS = [Segment(10, 2), Segment(20, 4), Segment(10, 5)]


def test_generation_staleness_carries_prefix_drift():
    # lags 3, 1, 0 -> d = 3, 1, 0; e = 3, max(1, 0.5*3) = 1.5, max(0, 0.5*1.5) = 0.75
    # G = (10*3 + 20*1.5 + 10*0.75) / 40 = 67.5 / 40
    assert generation_staleness(SEGMENTS, 5, PaceSettings()) == pytest.approx(1.6875)
    # gamma = 0: each segment alone, G = (30 + 20 + 0) / 40
    assert generation_staleness(SEGMENTS, 5, PaceSettings(prefix_carry=0.0)) == pytest.approx(1.25)
    # gamma = 1: the oldest prefix's drift everywhere, G = 3
    assert generation_staleness(SEGMENTS, 5, PaceSettings(prefix_carry=1.0)) == pytest.approx(3.0)
    # delta = 0.5 halves every proxy drift
    assert generation_staleness(SEGMENTS, 5, PaceSettings(drift_per_version=0.5)) == pytest.approx(0.84375)


def test_measured_drift_replaces_the_proxy():
    # segment 1 measured at 0.2 (the proxy would say 3): e = 0.2, max(1, 0.1) = 1, max(0, 0.5) = 0.5
    # G = (10*0.2 + 20*1 + 10*0.5) / 40 = 27 / 40
    segs = [Segment(10, 2, drift=0.2), Segment(20, 4), Segment(10, 5)]
    assert generation_staleness(segs, 5, PaceSettings()) == pytest.approx(0.675)


def test_on_policy_and_empty_trajectories_score_zero():
    assert generation_staleness([Segment(12, 7)], 7, PaceSettings()) == 0.0
    assert generation_staleness([], 7, PaceSettings()) == 0.0
    # a version ahead of the learner (a push landed first) is lag 0, not negative
    assert generation_staleness([Segment(5, 8)], 7, PaceSettings()) == 0.0


def test_waiting_and_effective_staleness():
    assert waiting_staleness(9, 6) == 3.0
    assert waiting_staleness(6, 9) == 0.0
    # S = G + beta * W = 1.6875 + 0.5 * 3
    assert effective_staleness(1.6875, 3.0, PaceSettings(waiting_weight=0.5)) == pytest.approx(3.1875)


def test_segments_from_span_and_turns():
    assert segments_from_span(7, 2, 4) == [Segment(3, 2), Segment(4, 4)]
    assert segments_from_span(7, 3, 3) == [Segment(7, 3)]
    with pytest.raises(StreamingInputError, match="weights only move forward"):
        segments_from_span(7, 4, 2)
    turns = [{"gen_tokens": 4, "version": 1}, {"gen_tokens": 6, "version": 1}, {"gen_tokens": 5, "version": 3}]
    assert segments_from_turns(turns) == [Segment(10, 1), Segment(5, 3)]


@pytest.mark.parametrize("pool, needed, settings, expected", [
    (10, 2, PaceSettings(target_pool=3, gain=1.0), 5),  # E = 10 - 2 - 3 = 5, B = min(5, 8)
    (10, 2, PaceSettings(target_pool=3, gain=0.5), 2),  # floor(2.5)
    (10, 2, PaceSettings(target_pool=3, gain=3.0), 8),  # min(15, 10 - 2): never below what the sample takes
    (4, 2, PaceSettings(target_pool=3, gain=1.0), 0),  # no excess
    (10, 2, PaceSettings(target_pool=0, gain=0.0), 0),  # observe only
    (2, 2, PaceSettings(), 0),
])
def test_rejection_budget(pool, needed, settings, expected):
    assert rejection_budget(pool, needed, settings) == expected


def test_budget_refuses_non_counts():
    with pytest.raises(StreamingInputError, match="count finished prompt groups"):
        rejection_budget(3.0, 1, PaceSettings())


def test_ranking_rejects_worst_first_and_spares_on_policy_groups():
    scores = {"a": 2.0, "b": 0.0, "c": 3.0, "d": 2.0}
    dispatch = {"a": 5, "d": 3}
    # c is worst; a and d tie at 2.0, d was dispatched earlier; b is on-policy (S = 0 = min_score)
    assert select_rejections(scores, 3, PaceSettings(), dispatch) == ["c", "d", "a"]
    assert select_rejections(scores, 10, PaceSettings(), dispatch) == ["c", "d", "a"]
    assert select_rejections(scores, 1, PaceSettings(), dispatch) == ["c"]
    assert select_rejections(scores, 3, PaceSettings(min_score=2.0), dispatch) == ["c"]


def test_decide_combines_budget_and_ranking():
    scores = {f"g{i}": float(i) for i in range(8)}  # g0 .. g7, S = i
    # pool 8, needed 2, target 1: E = 5, B = floor(0.6 * 5) = 3 -> the 3 worst
    decision = decide(scores, 2, PaceSettings(target_pool=1, gain=0.6))
    assert (decision.pool, decision.budget) == (8, 3)
    assert decision.rejected == ["g7", "g6", "g5"]
    assert decision.kept == ["g0", "g1", "g2", "g3", "g4"]
    assert len(decision.kept) >= decision.needed


def test_measured_segment_drift_by_hand():
    rollout = torch.tensor([-1.0, -2.0, -0.5, -1.0])
    current = torch.tensor([-1.5, -2.0, -0.5, -0.7])
    segment = torch.tensor([0, 0, -1, 1])  # token 2 is a tool observation
    # segment 0: (0.5 + 0) / 2, segment 1: 0.3, segment 2: no tokens
    assert measured_segment_drift(rollout, current, segment, 3) == pytest.approx([0.25, 0.3, 0.0])
    with pytest.raises(StreamingInputError, match="same shape"):
        measured_segment_drift(rollout, current[:3], segment, 3)


def test_histogram_buckets():
    # buckets (-inf, .5], (.5, 1.5], (1.5, 2.5], (2.5, 3.5], (3.5, inf)
    assert histogram([0, 1, 1, 2.6, 7, 4]) == [1, 2, 0, 1, 2]


@pytest.mark.parametrize("bad", [dict(target_pool=-1), dict(target_pool=1.5), dict(gain=-0.1),
                                 dict(gain=float("nan")), dict(prefix_carry=1.5), dict(waiting_weight=-1),
                                 dict(drift_per_version=True), dict(min_score=-0.5)])
def test_settings_refuse_values_outside_their_meaning(bad):
    with pytest.raises(StreamingConfigError, match="why:"):
        PaceSettings(**bad).validate()


def test_generated_tokens_map_to_their_segments_in_order():
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1])  # a 3-token turn, a tool token, a 5-token turn ... 7 generated
    # segments of 3 and 4 generated tokens: the tool token is -1, the rest fill segment 0 then 1
    assert segment_of_tokens([Segment(3, 1), Segment(4, 2)], mask).tolist() == [0, 0, -1, 0, 1, 1, 1, 1]
    # span fallback counted 10 tokens for 4 generated: boundaries scaled, round(5 * 4 / 10) = 2
    assert segment_of_tokens([Segment(5, 1), Segment(5, 3)], torch.tensor([1, 1, 1, 1])).tolist() == [0, 0, 1, 1]
    assert segment_of_tokens([Segment(4, 1)], torch.zeros(3, dtype=torch.long)).tolist() == [-1, -1, -1]


def test_measured_drift_in_nats_then_in_versions():
    rollout = torch.tensor([-1.0, -1.0, -9.0, -1.0, -1.0])
    current = torch.tensor([-1.2, -0.8, -0.1, -1.0, -1.6])  # token 2 is a tool token: its gap of 8.9 is left out
    mask = torch.tensor([1, 1, 0, 1, 1])
    segs = measured_drift_nats([Segment(2, 3), Segment(2, 5)], rollout, current, mask)
    # segment 0: (0.2 + 0.2) / 2 = 0.2; segment 1: (0 + 0.6) / 2 = 0.3
    assert [s.drift for s in segs] == pytest.approx([0.2, 0.3])
    cal = DriftCalibration()
    assert cal.per_version(PaceSettings()) == 1.0  # nothing lagged measured yet
    cal.observe(segs, landed_version=5)  # lags 2, 0: only segment 0 counts, 2 tokens x 0.2 / (2 tokens x 2 versions)
    assert cal.per_version(PaceSettings()) == pytest.approx(0.1)
    assert cal.per_version(PaceSettings(nats_per_version=0.4)) == 0.4  # a fixed k wins
    # d = delta * m / k with k = 0.1, delta = 1: 2 and 3 versions' worth
    converted = in_version_units(segs + [Segment(4, 1)], 0.1, PaceSettings())
    assert [s.drift for s in converted] == pytest.approx([2.0, 3.0, None])
    # G at landing 5: e = 2, max(3, 1) = 3 -> (2*2 + 2*3) / 4
    assert generation_staleness(converted[:2], 5, PaceSettings()) == pytest.approx(2.5)


def test_nats_per_version_refuses_negative():
    with pytest.raises(StreamingConfigError, match="nats_per_version"):
        PaceSettings(nats_per_version=-1.0).validate()
