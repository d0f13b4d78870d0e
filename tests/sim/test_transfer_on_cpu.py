"""Out-of-sample transfer terms (sim/transfer.py): learner calls, the old-log-prob forward, shared cores, step gap,
landings, model size (CPU, no GPU, < 5 s)."""

from __future__ import annotations

import numpy as np
import pytest

from thundersync_verl.sim.calibrate import Calibration
from thundersync_verl.sim.hardware import LearnerCosts
from thundersync_verl.sim.trace import Trace, TraceSource
from thundersync_verl.sim.transfer import (FORWARD_FLOP_SHARE, FORWARD_HOST_SHARE, CallCosts, fit_call_costs,
                                           fit_fused_forward, landing_samples, nonnegative_least_squares,
                                           transfer_costs, unmeasured_terms)

CALL, ROW, TOKEN = 0.02, 0.015, 3e-4  # the learner every synthetic run here has
FWD_ROW, FWD_TOKEN = 0.009, 1.4e-4  # of which its forwards (what a streamed call times inside itself)


def _traj(step: int, group: str, k: int, t_submit: float, t_done: float, t_reward: float, tokens: int = 40) -> dict:
    return {"kind": "trajectory", "mode": "x", "algo": "grpo", "step": step, "group_id": group,
            "traj_id": f"{group}_{k}", "t_submit": t_submit, "t_done": t_done, "t_reward": t_reward,
            "turns": [{"gen_s": t_done - t_submit, "gen_tokens": tokens, "tool_s": 0.0, "prompt_tokens": 8}],
            "reward_s": 0.0, "response_tokens": tokens, "prompt_tokens": 8, "policy_version": step - 1}


def _step(mode: str, step: int, t0: float, t1: float) -> dict:
    return {"kind": "step", "mode": mode, "algo": "grpo", "step": step, "t_start": t0, "t_end": t1,
            "n_rollout_slots": 8}


def _op(mode: str, step: int, op: str, t0: float, secs: float, tokens: int, rows: int | None = None) -> dict:
    rec = {"kind": "learner", "mode": mode, "step": step, "lane": "learner0", "op": op, "t0": t0, "t1": t0 + secs,
           "tokens": tokens}
    return rec if rows is None else {**rec, "rows": rows}


def _trajectories(steps: int, per_step: int = 8, group: int = 4) -> list[dict]:
    return [_traj(s, f"g{s}_{i // group}", i, 10.0 * s, 10.0 * s + 1 + 0.1 * i, 10.0 * s + 1 + 0.1 * i)
            for s in range(1, steps + 1) for i in range(per_step)]


def streamed_run() -> Trace:
    """ThunderSync-like: chunks of 1 to 4 rows and of different lengths, each costing CALL + ROW rows + TOKEN tokens."""
    rng = np.random.default_rng(0)
    learner, t = [], 0.0
    for step in (1, 2, 3):
        for _ in range(12):
            rows, tokens = int(rng.integers(1, 5)), int(rng.integers(20, 400))
            learner.append(_op("thundersync", step, "backward", t, CALL + ROW * rows + TOKEN * tokens, tokens, rows))
            t += 1.0
        learner.append(_op("thundersync", step, "optimizer", t, 0.05, 0))
        learner.append(_op("thundersync", step, "weight_sync", t + 0.1, 0.2, 0))
    steps = [_step("thundersync", s, 10.0 * s, 10.0 * s + 9) for s in (1, 2, 3)]
    return Trace("streamed", _trajectories(3), learner, steps)


def batch_run(mode: str = "sync", forward: bool = True) -> Trace:
    """A batch trainer: one update per step over its 8 rows (micro-batch 1), optionally a separate forward."""
    learner = []
    for step, tokens in ((1, 300), (2, 360), (3, 330)):
        learner.append(_op(mode, step, "backward", 10.0 * step, 0.1 + 8 * ROW + TOKEN * tokens, tokens))
        if forward:
            learner.append(_op(mode, step, "forward", 10.0 * step - 1, 0.5, tokens))
    steps = [_step(mode, s, 10.0 * s, 10.0 * s + 9) for s in (1, 2, 3)]
    return Trace("batch", _trajectories(3), learner, steps)


def _calib(**kw) -> Calibration:
    base = dict(reward_timing=True, landing_s=0.0, step_gap_s=0.3, slots=8, partial_rollout=False,
                contention=1.0, contention_ops=0)
    return Calibration(**{**base, **kw})


def test_nonnegative_least_squares_keeps_every_coefficient_at_or_above_zero():
    x = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert nonnegative_least_squares(x, np.array([3.0, 5.0, 7.0])) == pytest.approx([1.0, 2.0])
    got = nonnegative_least_squares(x, np.array([3.0, 2.0, 1.0]))  # unconstrained: a negative slope
    assert (got >= 0).all() and got[1] == 0.0


def test_a_streamed_run_separates_call_row_and_token_costs():
    got = fit_call_costs(streamed_run(), "backward", contention=1.0, micro_batch=1)
    assert (got.call_s, got.row_s, got.token_s) == pytest.approx((CALL, ROW, TOKEN), rel=1e-6)


def test_a_batch_run_puts_its_per_record_intercept_on_its_rows():
    got = fit_call_costs(batch_run(), "backward", contention=1.0, micro_batch=1)
    assert got.call_s == 0.0
    assert got.row_s == pytest.approx((0.1 + 8 * ROW) / 8)
    assert got.token_s == pytest.approx(TOKEN)
    assert fit_call_costs(batch_run(forward=False), "forward", 1.0, 1) is None


def test_a_batch_update_is_one_call_of_all_its_rows():
    fit = (streamed_run(), _calib(), False)
    costs = transfer_costs(fit, batch_run(forward=False), target_bypass=True, gran="batch", micro_batch=1)
    seq = np.array([30.0, 50.0, 70.0, 90.0])  # [N] one update over 4 rows
    update = costs.chunk_overhead_s + costs.sequence_cost(0.0 * seq, seq).sum()
    assert update == pytest.approx(CALL + 4 * ROW + TOKEN * seq.sum())


def test_the_old_log_prob_forward_is_added_only_where_the_target_runs_one():
    fit = (streamed_run(), _calib(), False)
    plain = transfer_costs(fit, batch_run(), target_bypass=True, gran="batch", micro_batch=1)
    with_fwd = transfer_costs(fit, batch_run(), target_bypass=False, gran="batch", micro_batch=1)
    fwd = CallCosts(CALL, ROW, TOKEN).forward()
    assert (fwd.row_s, fwd.token_s) == pytest.approx((ROW * FORWARD_HOST_SHARE, TOKEN * FORWARD_FLOP_SHARE))
    assert with_fwd.chunk_overhead_s == pytest.approx(plain.chunk_overhead_s + CALL)
    assert with_fwd.s_per_row == pytest.approx(plain.s_per_row + fwd.row_s)
    assert with_fwd.s_per_token == pytest.approx(plain.s_per_token + fwd.token_s)
    streamed = transfer_costs(fit, streamed_run(), target_bypass=False, gran="trajectory", micro_batch=1)
    assert streamed.s_per_token == pytest.approx(TOKEN)  # ThunderSync takes its old log-probs from its own forward


def timed_streamed_run() -> Trace:
    """streamed_run whose calls also report their forwards' seconds (``forward_s``)."""
    trace = streamed_run()
    trace.learner = [{**r, "forward_s": FWD_ROW * r["rows"] + FWD_TOKEN * r["tokens"]} if r["op"] == "backward"
                     else r for r in trace.learner]
    return trace


def test_forwards_timed_inside_streamed_calls_are_fitted_but_do_not_price_verls_forward():
    fit = (timed_streamed_run(), _calib(), False)
    fused = fit_fused_forward(fit[0], CallCosts(CALL, ROW, TOKEN), 1.0, micro_batch=1)
    assert (fused.call_s, fused.row_s, fused.token_s) == pytest.approx((CALL, FWD_ROW, FWD_TOKEN), rel=1e-6)
    assert fit_fused_forward(streamed_run(), CallCosts(CALL, ROW, TOKEN), 1.0, micro_batch=1) is None
    # verl's own forward calls ran 1.3-2.0x the timed forwards (transfer.py, point 3): the rule prices them
    plain = transfer_costs(fit, batch_run(), target_bypass=True, gran="batch", micro_batch=1)
    with_fwd = transfer_costs(fit, batch_run(), target_bypass=False, gran="batch", micro_batch=1)
    assert with_fwd.s_per_row == pytest.approx(plain.s_per_row + ROW * FORWARD_HOST_SHARE)
    assert with_fwd.s_per_token == pytest.approx(plain.s_per_token + TOKEN * FORWARD_FLOP_SHARE)


def test_a_fit_without_verls_forward_names_the_rule_it_prices_one_by():
    for run in (streamed_run(), timed_streamed_run()):
        got = unmeasured_terms((run, _calib(contention=2.0, contention_ops=12)), batch_run(), "sync", "batch")
        assert set(got) == {"old_log_prob_forward"}
        assert unmeasured_terms((run, _calib()), batch_run(), "sync", "batch", target_bypass=True) == {}
    fit = (batch_run(), _calib())  # verl's own forward calls price it
    assert unmeasured_terms(fit, batch_run(), "sync", "batch") == {}


def test_a_fit_that_records_the_forward_prices_it_from_its_records():
    fit = (batch_run(), _calib(), False)
    got = transfer_costs(fit, batch_run(), target_bypass=False, gran="batch", micro_batch=1)
    measured = fit_call_costs(batch_run(), "forward", 1.0, 1)
    train = fit_call_costs(batch_run(), "backward", 1.0, 1)
    assert got.s_per_row == pytest.approx(train.row_s + measured.row_s)
    assert got.s_per_token == pytest.approx(train.token_s + measured.token_s)


def test_the_step_gap_transfers_only_between_runs_of_the_same_trainer():
    fit = (streamed_run(), _calib(step_gap_s=0.3), False)
    same = transfer_costs(fit, streamed_run(), False, "trajectory", 1)
    other = transfer_costs(fit, batch_run(), True, "batch", 1)
    assert (same.step_gap_s, other.step_gap_s) == (0.3, 0.0)


def test_per_token_cost_scales_with_the_policys_parameters():
    fit = (streamed_run(), _calib(), False)
    assert transfer_costs(fit, streamed_run(), False, "trajectory", 1, token_scale=0.25).s_per_token == \
        pytest.approx(0.25 * TOKEN)


def test_record_costs_without_a_micro_batch_keep_one_call_per_record():
    fit = (streamed_run(), _calib(), False)
    target = batch_run(forward=False)
    target.learner = [r for rec in target.learner for r in (rec, {**rec, "t0": rec["t0"] + 0.5})]  # 2 per step
    got = transfer_costs(fit, target, True, "batch", micro_batch=None)
    line = fit_call_costs(streamed_run(), "backward", 1.0, None)
    assert got.s_per_row == 0.0 and got.chunk_overhead_s == pytest.approx(2 * line.call_s)


def test_a_barrier_is_dealt_the_landings_of_a_steps_last_group():
    trajs = [_traj(1, f"g{i // 4}", i, 0.0, 1.0 + i, 1.0 + i + 0.1 * (i + 1)) for i in range(8)]
    trace = Trace("t", trajs, [], [_step("thundersync", 1, 0.0, 10.0)])
    every = landing_samples(trace, barrier=False)
    assert every == pytest.approx([0.1 * (i + 1) for i in range(8)])
    assert landing_samples(trace, barrier=True) == pytest.approx([0.4, 0.5, 0.6, 0.7, 0.8])  # <= 4 still running
    for r in trajs:
        r["t_reward"] = r["t_done"]
    assert landing_samples(trace, barrier=True) is None


def test_dealt_landings_go_to_the_targets_trajectories_in_order():
    trace = Trace("t", _trajectories(2), [], [_step("sync", s, 10.0 * s, 10.0 * s + 9) for s in (1, 2)])
    calib = _calib(reward_timing=False, landing_s=9.0, landing_samples=(0.1, 0.2, 0.3))
    src = TraceSource(trace, calib=calib)
    assert src.batch(0).land_s == pytest.approx([0.1, 0.2, 0.3] * 2 + [0.1, 0.2])
    assert src.batch(1).land_s == pytest.approx([0.3, 0.1, 0.2] * 2 + [0.3, 0.1])
    plain = TraceSource(trace, calib=_calib(reward_timing=False, landing_s=9.0))
    assert plain.batch(0).land_s == pytest.approx([9.0] * 8)


def test_a_rows_host_work_adds_to_every_sequence():
    seq = np.array([10.0, 20.0])
    base = LearnerCosts(s_per_token=1e-3)
    assert base.sequence_cost(0.0 * seq, seq) == pytest.approx([0.01, 0.02])
    rows = LearnerCosts(s_per_token=1e-3, s_per_row=0.5)
    assert rows.sequence_cost(0.0 * seq, seq) == pytest.approx([0.51, 0.52])


def test_a_batch_fit_names_what_a_streamed_target_runs_that_it_never_measured():
    batch = (batch_run(), _calib(reward_timing=False, landing_s=0.6))
    got = unmeasured_terms(batch, streamed_run(), "thundersync", "trajectory")
    assert set(got) == {"learner_calls", "learner_slowdown", "landing_under_load"}
    assert "0.600 s" in got["landing_under_load"]
    as_batch = unmeasured_terms(batch, batch_run(), "sync", "batch")
    assert as_batch == {}  # a barrier target runs one call per step, alone, landing at its barrier


def test_a_streamed_fit_measures_every_term_of_a_batch_target_but_fully_asyncs_updates():
    streamed = (streamed_run(), _calib(contention=2.0, contention_ops=12))
    for mode in ("sync", "async"):  # in bypass mode (no separate forward: that one is priced by rule)
        assert unmeasured_terms(streamed, batch_run(mode, forward=False), mode, "batch") == {}
    assert set(unmeasured_terms(streamed, batch_run("fully_async", forward=False), "fully_async", "mini_batch")) == \
        {"update_bookkeeping"}
    quiet = (streamed_run(), _calib(contention=1.0, contention_ops=0))  # no op overlapped its rollouts
    assert set(unmeasured_terms(quiet, batch_run("async", forward=False), "async", "batch")) == {"learner_slowdown"}
    assert unmeasured_terms(quiet, batch_run("sync", forward=False), "sync", "batch") == {}  # never overlaps


def test_a_turn_streamed_opd_target_needs_a_fit_that_measured_turn_latency():
    opd = streamed_run()
    opd.trajectories = [{**r, "algo": "opd"} for r in opd.trajectories]
    opd.steps = [{**s, "algo": "opd"} for s in opd.steps]
    fit = (streamed_run(), _calib(contention=2.0, contention_ops=12))
    assert "turn_latency" in unmeasured_terms(fit, opd, "thundersync", "turn")
    timed = (streamed_run(), _calib(contention=2.0, contention_ops=12, turn_latency_s=0.5))
    assert unmeasured_terms(timed, opd, "thundersync", "turn") == {}


def _half_contended_run(bias: float) -> Trace:
    """24 ops alone on the cost model, then 24 while one long trajectory decodes, twice as slow and `bias` more
    on their long ones (a slowdown that is not one number)."""
    rng = np.random.default_rng(1)
    learner, t = [], 0.0
    for i in range(48):
        rows, tokens = int(rng.integers(1, 5)), int(rng.integers(20, 400))
        secs = CALL + ROW * rows + TOKEN * tokens
        if i >= 24:
            secs *= 2.0 * (1.0 + bias * (tokens > 200))
        learner.append(_op("thundersync", 1, "backward", t, secs, tokens, rows))
        t += 2.0
    decoding = _traj(1, "g0", 0, 47.5, 200.0, 200.0)  # decodes through every op from the 25th on
    return Trace("contended", [decoding], learner, [_step("thundersync", 1, 0.0, 200.0)])


def test_records_stretched_by_the_slowdown_weigh_less_in_the_cost_fit():
    exact = fit_call_costs(_half_contended_run(0.0), "backward", contention=2.0, micro_batch=1)
    assert (exact.call_s, exact.row_s, exact.token_s) == pytest.approx((CALL, ROW, TOKEN), rel=1e-6)
    got = fit_call_costs(_half_contended_run(0.3), "backward", contention=2.0, micro_batch=1)
    trace = _half_contended_run(0.3)
    secs = np.array([r["t1"] - r["t0"] for r in trace.learner]) / np.array([1.0] * 24 + [2.0] * 24)
    x = np.array([[1.0, r["rows"], r["tokens"]] for r in trace.learner])
    unweighted = nonnegative_least_squares(x, secs)
    assert abs(got.token_s - TOKEN) < abs(unweighted[2] - TOKEN)


def test_sync_on_shared_cores_is_dealt_the_landings_made_while_the_learner_was_idle():
    trajs = [_traj(1, f"g{i // 4}", i, 0.0, 1.0 + i, 1.0 + i + 0.1 * (i + 1)) for i in range(8)]
    ops = [_op("thundersync", 1, "backward", 3.9, 2.6, 10, 1)]  # computes through the landings of trajectories 3 to 5
    trace = Trace("t", trajs, ops, [_step("thundersync", 1, 0.0, 10.0)])
    idle = landing_samples(trace, barrier=True, learner_idle=True)
    assert idle == pytest.approx([0.1, 0.2, 0.3, 0.7, 0.8])
    assert landing_samples(trace, barrier=True) == pytest.approx([0.4, 0.5, 0.6, 0.7, 0.8])  # <= 4 still running
    busy = Trace("t", trajs, [_op("thundersync", 1, "backward", 0.0, 10.0, 10, 1)], trace.steps)
    assert landing_samples(busy, barrier=True, learner_idle=True) == pytest.approx([0.4, 0.5, 0.6, 0.7, 0.8])
