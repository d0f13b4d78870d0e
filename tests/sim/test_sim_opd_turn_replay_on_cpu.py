"""Replay of an OPD ThunderSync trace as its trainer records it (CPU, < 20 s).

The recorded driver polls for scored turns and trains every turn it got in chunks of at most 8 rows,
back to back; each row is the trajectory prefix up to the end of its turn, recomputed with grad, so a
backward record's tokens are its rows' prefix lengths; the old-log-prob forward is fused into each
backward (no forward records); a trajectory's turns that go in one chunk share one row, its latest prefix
(``opd_stream`` point 7). The trace below is written that way from known costs and a known turn latency, over
the trajectories of a simulated run.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from thundersync_verl.sim.calibrate import fit_turn_latency, turn_intervals, turn_polls
from thundersync_verl.sim.sim_engine import lane_work, place_rollouts, simulate
from thundersync_verl.sim.trace import fit_learner_costs, records_recompute_prefix, replay
from synthetic_runs import as_trace, records

H, A, B, CAP = 0.3, 0.02, 1e-4, 8  # turn latency, per-record overhead, seconds per prefix token, rows per chunk


def simulated_records() -> list[dict]:
    return records("thundersync", algo="opd")


def driver_records(recs: list[dict], poll_s: float = 0.05) -> list[dict]:
    """The backward records the ThunderSync OPD driver writes for these trajectories."""
    out = [r for r in recs if not (r["kind"] == "learner" and r["op"] == "backward")]
    trajs = [r for r in recs if r["kind"] == "trajectory"]
    for step in sorted({r["step"] for r in trajs}):
        mine = [r for r in trajs if r["step"] == step]
        turns = sorted((min(end + H, r["t_done"]), t["prompt_tokens"] + t["gen_tokens"], k)
                       for k, r in enumerate(mine) for (_, end), t in zip(turn_intervals(r), r["turns"]))
        avail = np.asarray([a for a, _, _ in turns])
        t, had = min(r["t_submit"] for r in mine), 0
        while had < len(turns):
            n = int((avail <= t).sum())
            for i in range(had, n, CAP):  # every turn it got, in chunks run back to back
                latest = {}  # a trajectory's turns in one chunk share a row: its latest prefix
                rows = turns[i:min(i + CAP, n)]  # the record's ``rows`` counts the turns it trained, as the trainer's
                for _, p, k in rows:
                    latest[k] = max(latest.get(k, 0), p)
                tokens = sum(latest.values())
                out.append({"kind": "learner", "mode": mine[0]["mode"], "step": step, "lane": "0", "op": "backward",
                            "t0": t, "t1": t + A + B * tokens, "tokens": tokens, "rows": len(rows)})
                t += A + B * tokens + 1e-5
            had = n
            t += poll_s
    return out


@pytest.fixture(scope="module")
def recorded():
    plain = simulated_records()
    return as_trace(plain), as_trace(driver_records(plain))


def test_prefix_records_are_recognised_and_fitted_per_prefix_token(recorded):
    plain, trace = recorded
    assert records_recompute_prefix(trace) and not records_recompute_prefix(plain)
    costs = fit_learner_costs(trace, split_forward=True)  # fused: no forward records, nothing split off
    assert costs.s_per_token == pytest.approx(B, rel=1e-6) and costs.chunk_overhead_s == pytest.approx(A, rel=1e-4)
    assert costs.forward_s_per_token == 0.0 and costs.forward_overhead_s == 0.0


def test_replay_costs_each_turn_as_its_prefix_like_the_records(recorded):
    _, trace = recorded
    cfg, source, costs = replay(trace)
    assert costs.prefix_recompute and cfg.resolved_granularity() == "turn"
    assert cfg.max_chunk == max(r["rows"] for r in trace.learner if r["op"] == "backward")
    res = simulate(cfg, source, costs)
    assert not source.dropped_steps and len(source.steps) == len(trace.steps)
    recorded_tokens = sum(r["tokens"] for r in trace.learner if r["op"] == "backward")
    prefixes = sum(int(source.batch(k).turn_hi.sum()) for k in range(len(source.steps)))
    # which turns share a row depends on the schedule (lane.py point 6): the replay's is the simulator's own, so its
    # tokens come near the recorded ones, never above one row per turn
    assert recorded_tokens < prefixes and res.compute_tokens <= prefixes
    assert res.compute_tokens == pytest.approx(recorded_tokens, rel=0.05)  # 3.4% above; one row a turn: 9.4%
    assert abs(res.compute_tokens - recorded_tokens) < prefixes - recorded_tokens
    plain = replace(costs, prefix_recompute=False)
    batch = source.batch(0)
    place = place_rollouts(batch.dur_s, 0.0, cfg.rollout_slots)
    work, computed = lane_work(batch, place, "opd", "turn", costs)
    assert work.size == len(batch.turn_lo)  # one unit per turn row: no separate forward units
    assert computed == int(batch.turn_hi.sum()) > lane_work(batch, place, "opd", "turn", plain)[1]


def test_turn_latency_is_fitted_from_the_driver_polls(recorded):
    plain, trace = recorded
    assert turn_polls(plain) == [] and fit_turn_latency(plain) is None  # records without rows: not measured
    assert fit_turn_latency(trace) == pytest.approx(H, abs=0.03)


def test_replayed_turns_are_ready_after_the_latency_and_no_later_than_their_slot_end(recorded):
    _, trace = recorded
    cfg, source, costs = replay(trace)
    h = source.calib.turn_latency_s
    batch = source.batch(1)
    left = np.repeat(batch.dur_s, batch.n_turns) - batch.turn_end_s
    assert np.allclose(batch.turn_score_s, np.minimum(h, left))
    last = batch.turn_ptr[1:] - 1
    assert np.all(batch.turn_end_s[last] + batch.turn_score_s[last] <= batch.dur_s + 1e-9)
