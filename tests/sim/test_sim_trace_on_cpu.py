"""Trace loader, cost fit and replay on synthetic traces written in the trainer's schema (CPU, < 20 s)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from thundersync_verl.sim.dists import const, lognormal
from thundersync_verl.sim.sim_engine import SimConfig, simulate
from thundersync_verl.sim.hardware import LearnerCosts
from thundersync_verl.sim.trace import (TraceSource, fit_learner_costs, load_trace, measured_step_time, parse_mode,
                                        replay)
from thundersync_verl.sim.tracegen import trace_records, write_synthetic_trace
from thundersync_verl.sim.workload import RolloutSpec, SyntheticSource, WorkloadSpec

WORK = WorkloadSpec(groups_per_step=4, group_size=4, turns=lognormal(4, 0.6), prompt_tokens=const(64),
                    gen_tokens=lognormal(40, 0.5), obs_tokens=lognormal(30, 0.5), tool_s=lognormal(0.2, 0.5),
                    reward_s=lognormal(0.3, 0.3))
ROLL = RolloutSpec(slots=16, decode_s_per_token=0.004, prefill_s_per_token=1e-4, teacher_fixed_s=0.05,
                   teacher_s_per_token=1e-4)
COSTS = LearnerCosts(s_per_token=2e-4, chunk_overhead_s=0.05, optimizer_s=0.3, weight_sync_s=0.2)
CASES = [("grpo", "sync"), ("grpo", "thundersync"), ("grpo", "async"), ("grpo", "fully_async"),
         ("opd", "sync"), ("opd", "thundersync")]


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    """One synthetic trace per (algo, mode), with the step time each encodes."""
    d = tmp_path_factory.mktemp("traces")
    source = SyntheticSource(WORK, ROLL, seed=3)
    truth = {}
    for algo, mode in CASES:
        cfg = SimConfig(mode=mode, algo=algo, steps=10, rollout_slots=16, min_chunk=1)
        truth[(algo, mode)] = write_synthetic_trace(d / f"{algo}_{mode}.jsonl", cfg, source, COSTS)
    return d, truth


@pytest.mark.parametrize("algo,mode", CASES)
def test_replay_reproduces_the_recorded_step_time(trace_dir, algo, mode):
    d, truth = trace_dir
    trace = load_trace(d / f"{algo}_{mode}.jsonl")
    assert trace.algo == algo and parse_mode(trace.mode)[0] == mode
    cfg, source, costs = replay(trace)
    res = simulate(cfg, source, costs)
    measured = measured_step_time(trace)
    assert measured == pytest.approx(truth[(algo, mode)], rel=0.2)  # same spacing, warm-up step excluded
    # async replays its last step's look-ahead batch from the first (the trace never trains it)
    assert res.step_time_s == pytest.approx(measured, rel=0.03 if mode == "async" else 1e-3)


def test_fit_recovers_the_learner_costs(trace_dir):
    d, _ = trace_dir
    costs = fit_learner_costs(load_trace(d / "grpo_thundersync.jsonl"))
    assert costs.s_per_token == pytest.approx(COSTS.s_per_token, rel=1e-6)
    assert costs.chunk_overhead_s == pytest.approx(COSTS.chunk_overhead_s, rel=1e-4)
    assert costs.optimizer_s == pytest.approx(COSTS.optimizer_s, rel=1e-9)
    assert costs.weight_sync_s == pytest.approx(COSTS.weight_sync_s, rel=1e-9)


def test_replayed_batches_keep_durations_and_tokens(trace_dir):
    d, _ = trace_dir
    source = TraceSource(load_trace(d / "grpo_sync.jsonl"))
    original = SyntheticSource(WORK, ROLL, seed=3).batch(2)
    replayed = source.batch(2)
    assert np.allclose(np.sort(replayed.dur_s), np.sort(original.dur_s))
    assert np.array_equal(np.sort(replayed.seq_tokens), np.sort(original.seq_tokens))
    ptr = replayed.turn_ptr
    assert np.array_equal(replayed.turn_hi[ptr[1:] - 1], replayed.seq_tokens)
    assert source.group_size == WORK.group_size and source.batch_size == WORK.batch_size


def _one_record(tmp_path, rec):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(rec) + "\n")
    return p


def test_loader_rejects_malformed_records_with_the_line(tmp_path):
    recs = trace_records(SimConfig("sync", steps=3, rollout_slots=16), SyntheticSource(WORK, ROLL), COSTS)
    traj = next(r for r in recs if r["kind"] == "trajectory")
    bad = dict(traj)
    del bad["reward_s"]
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing key 'reward_s'"):
        load_trace(_one_record(tmp_path, bad))
    with pytest.raises(ValueError, match="should be int"):
        load_trace(_one_record(tmp_path, {**traj, "step": "3"}))
    learner = next(r for r in recs if r["kind"] == "learner")
    with pytest.raises(ValueError, match="op 'adam'"):
        load_trace(_one_record(tmp_path, {**learner, "op": "adam"}))
    with pytest.raises(ValueError, match="kind 'event'"):
        load_trace(_one_record(tmp_path, {"kind": "event"}))
    (tmp_path / "text.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        load_trace(tmp_path / "text.jsonl")


def test_mode_names():
    assert parse_mode("thundersync") == ("thundersync", None)
    assert parse_mode("thundersync:group") == ("thundersync", "group")
    assert parse_mode("thundersync_trajectory") == ("thundersync", "trajectory")
    assert parse_mode("fully_async") == ("fully_async", None)
    with pytest.raises(ValueError, match="not one of"):
        parse_mode("pipelined")


def test_synthetic_traces_refuse_a_quadratic_term():
    with pytest.raises(ValueError, match="s_per_token_sq == 0"):
        trace_records(SimConfig("sync", steps=3), SyntheticSource(WORK, ROLL), replace(COSTS, s_per_token_sq=1e-9))


def test_replay_infers_a_trainer_that_streams_one_trajectory_per_chunk(tmp_path):
    cfg = SimConfig(mode="thundersync", steps=8, rollout_slots=16, min_chunk=1, max_chunk=1)
    truth = write_synthetic_trace(tmp_path / "ts.jsonl", cfg, SyntheticSource(WORK, ROLL, seed=5), COSTS)
    trace = load_trace(tmp_path / "ts.jsonl")
    rcfg, source, costs = replay(trace)
    assert rcfg.max_chunk is not None and rcfg.max_chunk <= 2
    assert simulate(rcfg, source, costs).step_time_s == pytest.approx(measured_step_time(trace), rel=0.02)
    assert measured_step_time(trace) == pytest.approx(truth, rel=0.2)
