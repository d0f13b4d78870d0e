"""What replay measures beyond the recorded durations (sim/calibrate.py): each part recovered (CPU, < 20 s)."""

from __future__ import annotations

import numpy as np
import pytest

from thundersync_verl.sim.calibrate import (fit_contention, fit_rollout_contention, overlap_fraction,
                                            slot_residual)
from thundersync_verl.sim.sim_engine import simulate
from thundersync_verl.sim.hardware import LearnerCosts
from thundersync_verl.sim.trace import (Trace, TraceSource, fit_learner_costs, load_trace, measured_step_time, replay,
                                        replay_calibration)
from synthetic_runs import as_trace, records

def replay_error(trace) -> float:
    cfg, source, costs = replay(trace)
    return simulate(cfg, source, costs).step_time_s / measured_step_time(trace) - 1.0


def test_overlap_fraction_of_intervals():
    busy = np.array([[0.0, 1.0], [0.5, 2.0], [3.0, 4.0]])
    got = overlap_fraction(np.array([[0.0, 2.0], [1.5, 3.5], [5.0, 6.0], [1.0, 1.0]]), busy)
    assert np.allclose(got, [1.0, 0.5, 0.0, 0.0])


def test_landing_latency_is_recovered_when_the_trace_has_no_reward_timing():
    """verl's trainers write t_reward == t_done: the reward latency shows as the learner starting late."""
    recs = records("sync")
    for r in recs:
        if r["kind"] == "trajectory":
            r["reward_s"], r["t_reward"] = 0.0, r["t_done"]
    trace = as_trace(recs)
    _, calib = replay_calibration(trace)
    assert not calib.reward_timing
    assert calib.landing_s == pytest.approx(0.7, abs=2e-3)
    assert abs(replay_error(trace)) < 2e-3


@pytest.mark.parametrize("mode", ["sync", "thundersync"])
def test_driver_gap_between_steps_is_recovered(mode):
    costs = LearnerCosts(s_per_token=2e-4, chunk_overhead_s=0.05, optimizer_s=0.3, weight_sync_s=0.2, step_gap_s=0.45)
    trace = as_trace(records(mode, costs=costs))
    _, calib = replay_calibration(trace)
    assert calib.step_gap_s == pytest.approx(0.45, rel=1e-6)
    assert abs(replay_error(trace)) < 1e-3


def test_a_push_inside_running_trajectories_replays_as_streaming():
    recs = records("fully_async", steps=10)
    for r in recs:
        r["mode"] = "async"  # an off-policy trainer that pushed weights mid-rollout
    mode, calib = replay_calibration(as_trace(recs))
    assert mode == "fully_async" and calib.partial_rollout
    mode, calib = replay_calibration(as_trace(records("async")))
    assert mode == "async" and not calib.partial_rollout


def test_slots_are_at_least_the_trajectories_seen_in_flight():
    recs = records("sync")
    for r in recs:
        if r["kind"] == "step":
            r["n_rollout_slots"] = 4  # a writer that logs a constant
    cfg, _, _ = replay(as_trace(recs))
    assert cfg.rollout_slots == 16


def test_slot_residual_excludes_turns_and_pushes():
    rec = {"t_submit": 10.0, "t_done": 11.3, "turns": [{"gen_s": 0.6, "tool_s": 0.2}, {"gen_s": 0.2, "tool_s": 0.0}]}
    assert slot_residual(rec) == pytest.approx(0.3)
    assert slot_residual(rec, np.array([[10.5, 10.6]])) == pytest.approx(0.2)
    assert slot_residual({**rec, "t_done": 10.9}) == 0.0


def test_a_step_that_holds_two_batches_is_split_in_submission_order():
    recs = records("sync")
    plain = TraceSource(as_trace(recs))
    for r in recs:
        if r["kind"] == "trajectory" and r["step"] == 1:
            r["step"] = 2
    merged = TraceSource(as_trace(recs))
    assert len(merged.steps) == len(plain.steps)
    for k in range(len(plain.steps)):
        assert np.allclose(np.sort(merged.batch(k).dur_s), np.sort(plain.batch(k).dur_s))


def test_forward_records_fit_separately_for_turn_streaming():
    rng = np.random.default_rng(0)
    learner = []
    for i in range(30):
        n = int(rng.integers(50, 900))
        t = 10.0 * i
        learner.append({"op": "forward", "t0": t, "t1": t + 0.02 + 1e-4 * n, "tokens": n, "step": 1, "lane": "0"})
        learner.append({"op": "backward", "t0": t + 1, "t1": t + 1 + 0.05 + 4e-4 * n, "tokens": n, "step": 1,
                        "lane": "0"})
    trace = Trace("mem", [], learner, [{"step": 1}])
    split = fit_learner_costs(trace, split_forward=True)
    assert split.forward_s_per_token == pytest.approx(1e-4) and split.forward_overhead_s == pytest.approx(0.02)
    assert split.s_per_token == pytest.approx(4e-4) and split.chunk_overhead_s == pytest.approx(0.05)
    merged = fit_learner_costs(trace)
    assert merged.s_per_token == pytest.approx(5e-4) and merged.forward_s_per_token == 0.0


def _decode_trajectory(t0: float, turns: list[float], tokens: int = 10) -> dict:
    return {"t_submit": t0, "t_done": t0 + sum(turns),
            "turns": [{"gen_s": g, "tool_s": 0.0, "gen_tokens": tokens} for g in turns]}


def test_learner_slowdown_is_fitted_from_ops_that_overlapped_decoding():
    trajs = [_decode_trajectory(0.0, [10.0])]  # the engine decodes during [0, 10)
    rng = np.random.default_rng(1)
    learner = []
    for i in range(24):
        n = int(rng.integers(100, 1000))
        base = 0.05 + 1e-3 * n
        t = 0.4 * i if i < 12 else 20.0 + 2.0 * i  # half inside decoding, half after it
        w = 1.0 if i < 12 else 0.0
        learner.append({"op": "backward", "t0": t, "t1": t + base * (1 + 0.6 * w), "tokens": n})
    k, n_over = fit_contention(Trace("mem", trajs, learner, []))
    assert n_over >= 2 and k == pytest.approx(0.6, abs=0.02)
    k0, _ = fit_contention(Trace("mem", trajs, [r for r in learner if r["t0"] >= 20.0], []))
    assert k0 == 0.0  # no op overlapped decoding: nothing to fit from


def test_rollout_slowdown_compares_rates_at_the_same_concurrency():
    """4 sequences decode alone (0.5 s per 10-token turn), then while the learner computes (0.75 s)."""
    trajs = [_decode_trajectory(0.0, [0.5] * 10) for _ in range(4)]
    trajs += [_decode_trajectory(10.0, [0.75] * 10) for _ in range(4)]
    learner = [{"op": "backward", "t0": 10.0, "t1": 17.5, "tokens": 100}]
    assert fit_rollout_contention(Trace("mem", trajs, learner, [])) == pytest.approx(1.5, rel=1e-6)
    # too little overlap to tell: no slowdown claimed
    short = [{"op": "backward", "t0": 10.0, "t1": 10.5, "tokens": 100}]
    assert fit_rollout_contention(Trace("mem", trajs, short, [])) == 1.0


def test_replay_of_a_recorded_trace_stays_exact_for_every_mode(tmp_path):
    """Calibration adds nothing a synthetic trace does not contain: replay still reproduces it."""
    from thundersync_verl.sim.trace import write_trace

    for mode in ("sync", "thundersync", "fully_async"):
        write_trace(tmp_path / f"{mode}.jsonl", records(mode))
        trace = load_trace(tmp_path / f"{mode}.jsonl")
        _, calib = replay_calibration(trace)
        assert calib.step_gap_s == 0.0 and calib.contention == 1.0
        assert calib.rollout_contention == pytest.approx(1.0, abs=0.01)  # per-turn prefill adds a little noise
        assert abs(replay_error(trace)) < 1e-3
