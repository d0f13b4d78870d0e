"""benchmarks/emulated_trace.py: ``streaming_bound`` (the shortest streamed step a Sync run's own timings allow) and the
step-1 update figures (``update_gaps``), with no Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thundersync_harness.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("emulated_rollout")  # it imports its sibling ``modes``


@pytest.fixture(scope="module")
def trace():
    """What a finished run's traces say (the benchmark's reader module)."""
    return load_benchmark("emulated_trace")


@pytest.fixture(scope="module")
def exact():
    """The step-1 update gap's module (a sibling of the benchmark)."""
    return load_benchmark("emulated_exactness")


def sync_run(tmp_path: Path, steps: dict[int, tuple[list[float], float, float]]) -> dict:
    """Sync's step s trains on version s-1: ``{s: (agent loop end times from the first submit, gen s, update s)}``."""
    lines, per_step = [], {1: {"timing_s/gen": 9.0, "timing_s/update_actor": 9.0}}  # step 1 (warm-up) is left out
    for step, (done, gen, update) in steps.items():
        t0 = 1000.0 * step
        lines += [{"policy_version": step - 1, "t_submit": t0, "t_done": t0 + d} for d in done]
        per_step[step] = {"timing_s/gen": gen, "timing_s/update_actor": update}
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return {"per_step": per_step, "traj_path": path}


def test_rewards_that_land_together_leave_nothing_to_overlap(trace, tmp_path):
    run = sync_run(tmp_path, {2: ([2.0] * 4, 2.5, 4.0)})  # every reward at gen's end: the whole update after it
    assert trace.streaming_bound(run) == pytest.approx(2.5 + 4.0)


def test_spread_rewards_hide_the_update_behind_the_rollout_up_to_the_last_row(trace, tmp_path):
    # rewards land at 1, 2, 3, 4 s (gen's end is the last one: no verifier shift), 0.5 s of update per row
    run = sync_run(tmp_path, {2: ([1.0, 2.0, 3.0, 4.0], 4.0, 2.0)})
    assert trace.streaming_bound(run) == pytest.approx(4.5)
    # a slower learner: the first row's start plus the whole update (1 + 4 x 1.5) beats the last landing
    slow = sync_run(tmp_path, {2: ([1.0, 2.0, 3.0, 4.0], 4.0, 6.0)})
    assert trace.streaming_bound(slow) == pytest.approx(7.0)


def test_the_verifier_shift_and_the_median_over_steps(trace, tmp_path):
    # the agent loops end at 1 and 2 s, gen ends at 2.5 s: both rewards land 0.5 s later
    run = sync_run(tmp_path, {2: ([1.0, 2.0], 2.5, 0.2), 3: ([1.0, 1.0], 1.0, 4.0), 4: ([0.5, 3.0], 3.0, 1.0)})
    assert trace.streaming_bound(run) == pytest.approx(3.5)  # median of 2.6, 5.0, 3.5
    assert trace.streaming_bound({"per_step": {1: {}}, "traj_path": run["traj_path"]}) is None


def test_opd_rows_are_turns_landing_when_their_generation_ends(trace, tmp_path):
    # one trajectory of two turns: generation 1 s, a 2 s tool call, generation 1 s (ends at 4 s = gen's end); a
    # second one of one 3 s turn. Rows land at 1, 3 and 4 s; Sync's 3 s update is 1 s a row
    lines = [{"policy_version": 1, "t_submit": 2000.0, "t_done": 2004.0,
              "turns": [{"gen_s": 1.0, "tool_s": 2.0}, {"gen_s": 1.0, "tool_s": 0.0}]},
             {"policy_version": 1, "t_submit": 2000.0, "t_done": 2003.0, "turns": [{"gen_s": 3.0, "tool_s": 0.0}]}]
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = {"per_step": {1: {}, 2: {"timing_s/gen": 4.0, "timing_s/update_actor": 3.0}}, "traj_path": path}
    assert trace.streaming_bound(run, "opd") == pytest.approx(max(1 + 3, 3 + 2, 4 + 1))
    # per trajectory (GRPO's rows) the same run lands at 3 and 4 s, 1.5 s a row
    assert trace.streaming_bound(run) == pytest.approx(max(3 + 3, 4 + 1.5))
    assert trace.turn_ends({"t_submit": 0.0, "t_done": 2.5}) == [2.5]  # no turns recorded: the trajectory's end


def thundersync_run(tmp_path: Path, landed: list[float], chunks: list[tuple[float, int]]) -> dict:
    """A ThunderSync trace of step 2 (step 1 is left out): rewards seen at ``landed`` s, backward chunks of
    ``(seconds, rows)``, a 0.1 s optimizer step and a 0.2 s weight push."""
    recs = [{"kind": "step", "step": s, "t_start": 100.0 * s, "t_end": 100.0 * s + 9} for s in (1, 2)]
    recs += [{"kind": "trajectory", "step": 2, "t_reward": 200.0 + t} for t in landed]
    recs += [{"kind": "learner", "step": 2, "op": "backward", "t0": 200.0, "t1": 200.0 + sec, "rows": rows}
             for sec, rows in chunks]
    recs += [{"kind": "learner", "step": 2, "op": "optimizer", "t0": 209.0, "t1": 209.1}]
    (tmp_path / "grpo_thundersync.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return {"run_dir": tmp_path, "per_step": {1: {}, 2: {"timing_s/update_weights": 0.2}}}


def test_the_schedule_bound_adds_the_learner_work_still_to_come_at_each_arrival(bench, tmp_path):
    """Rewards at 1, 2 and 2.5 s; the cheapest backward 0.5 s a row (a 2-row chunk of 1 s). The rollout bound is
    the last landing plus one row (3.0 s); from the first landing the three rows need 1 + 1.5 = 2.5 s, and from the
    second, 2 + 1.0 = 3.0 s: the schedule bound is 3.0 + 0.1 + 0.2. Rows landing early and fast make the learner's
    work the bound."""
    modes = bench.modes
    run = thundersync_run(tmp_path, [1.0, 2.0, 2.5], [(0.7, 1), (1.0, 2)])
    assert modes.thundersync_lower_bound(run) == pytest.approx(2.5 + 0.5 + 0.3)
    assert modes.thundersync_lower_bound(run, learner_work=True) == pytest.approx(3.0 + 0.3)
    crowded = thundersync_run(tmp_path, [0.5, 2.4, 2.5], [(0.7, 1), (1.6, 2)])  # 0.7 s a row at best
    assert modes.thundersync_lower_bound(crowded) == pytest.approx(2.5 + 0.7 + 0.3)
    assert modes.thundersync_lower_bound(crowded, learner_work=True) == pytest.approx(2.4 + 2 * 0.7 + 0.3)


def _unit(n: int, i: int):
    import torch

    e = torch.zeros(n, dtype=torch.float64)
    e[i] = 1.0
    return e


def test_the_step1_floor_is_the_widest_pair_of_verls_sync_runs(exact):
    """Every run's update is one vector; Sync at micro-batch 4 with its own old-log-prob forward sits 3e-6 off the
    others and ThunderSync 6e-6 off: the floor is the widest Sync pair (3e-6), ThunderSync's gap 6e-6, so 2.0. The
    bypass runs alone agree exactly (their floor 0, ratio inf), and the token-sum pair is measured apart."""
    import torch

    base = torch.linspace(-1.0, 1.0, 64, dtype=torch.float64)
    deltas = {name: base.clone() for name in exact.EXACT_RUNS}
    deltas["sync_micro4"] = base + 3e-6 * _unit(64, 0)
    deltas["thundersync"] = base + 6e-6 * _unit(64, 1)
    deltas["token_sum_sync"] = 10.0 * base
    deltas["token_sum_thundersync"] = 10.0 * base + 5e-6 * _unit(64, 2)
    out = exact.update_gaps(deltas)
    norm = float(base.norm())
    assert out["step1_update_floor"] == pytest.approx(3e-6 / norm)
    assert out["step1_update_gap"] == pytest.approx(6e-6 / norm)
    assert out["step1_update_gap_over_floor"] == pytest.approx(2.0)
    assert out["step1_update_gap_vs_sync_own_old_log_probs"] == pytest.approx(6e-6 / norm)
    assert out["step1_update_floor_bypass_only"] == 0.0
    assert out["step1_update_gap_over_bypass_only_floor"] == float("inf")
    assert out["step1_update_gap_token_sum"] == pytest.approx(5e-6 / (10.0 * norm))
    assert all(name.startswith("sync") for pair in out["step1_update_floor_pairs"] for name in pair.split("-"))
    assert len(out["step1_update_floor_pairs"]) == 15  # the six token-mean Sync runs, pairwise; ThunderSync is not one
    # directions against token-sum Sync (10x longer, same direction as every run but ThunderSync's 6e-6 step aside)
    directions = out["step1_direction_gap_to_token_sum"]
    assert directions["sync"] == pytest.approx(0.0, abs=1e-15)
    step, unit = 6e-6 * _unit(64, 1), base / norm
    assert directions["thundersync"] == pytest.approx(float((step - (step @ unit) * unit).norm()) / norm, rel=1e-3)


def test_host_cpu_splits_each_side_and_each_process_per_step(trace, tmp_path):
    from thundersync_harness.cpu_pin import CoreLoad

    run = sync_run(tmp_path, {2: ([1.0], 2.0, 1.0), 3: ([1.0], 2.0, 1.0), 4: ([1.0], 2.0, 1.0), 5: ([1.0], 2.0, 1.0)})
    hz = __import__("os").sysconf("SC_CLK_TCK")
    load = CoreLoad()  # readings at the first submits of versions 2 and 4: two steps, the first one left out
    load.samples = [(3000.0, {0: (0, 0), 1: (0, 0)}), (5000.0, {0: (6 * hz, 0), 1: (4 * hz, 0)})]
    load.process_samples = [(3000.0, {7: ("ray::WorkerDict", hz), 8: ("ray::AgentLoopWorkerTQ", 0)}),
                            (5000.0, {7: ("ray::WorkerDict", 5 * hz), 8: ("ray::AgentLoopWorkerTQ", 2 * hz),
                                      9: ("python -c", hz)})]  # 9 started inside the window: counted from zero
    run.update(core_load=load, pin={"rollout_side_cpus": [0], "learner_cpus": [1]})
    cpu = trace.host_cpu(run)
    assert cpu["rollout_side"] == 3.0 and cpu["learner_side"] == 2.0 and cpu["step_s"] == 1000.0, cpu
    assert cpu["by_process"] == {"ray::WorkerDict": 2.0, "ray::AgentLoopWorkerTQ": 1.0, "python -c": 0.5}, cpu


def test_emulated_opd_runs_the_paper_workload_and_refuses_the_self_distilling_one(bench, tmp_path, capsys):
    modes = bench.modes  # the sibling script the benchmark imported
    with pytest.raises(SystemExit) as stop:  # refused before any model is built or run started
        modes.main(["--rollout", "emulated", "--algo", "opd", "--workload", "recorded", "--work-dir", str(tmp_path),
                    "--results-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--workload paper" in err.splitlines()[-1] and "Traceback" not in err
    assert not any(tmp_path.iterdir())
    args = modes.build_parser().parse_args(["--rollout", "emulated", "--algo", "opd"])
    assert args.workload is None  # main() resolves it: paper for OPD, recorded for GRPO


def test_opd_row_unit_and_teacher_calls_reach_every_mode_and_name_the_result(bench, tmp_path, capsys):
    modes = bench.modes
    args = modes.build_parser().parse_args(["--algo", "opd", "--opd-granularity", "trajectory",
                                            "--opd-teacher-calls", "trajectory", "--repeats", "3", "--quick"])
    assert modes.opd_overrides(args) == ["thundersync.opd.granularity=trajectory", "thundersync.opd.teacher_calls=trajectory"]
    assert bench._suffix(args) == "_trajectory_whole_teacher_repeats_quick"  # never the per-turn run's file
    assert bench._suffix(modes.build_parser().parse_args(["--algo", "opd"])) == ""
    with pytest.raises(SystemExit) as stop:  # GRPO has no OPD settings: refused, not silently ignored
        modes.main(["--opd-teacher-calls", "trajectory", "--work-dir", str(tmp_path), "--results-dir", str(tmp_path)])
    assert stop.value.code == 2 and "need --algo opd" in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_a_step1_batch_without_an_advantage_is_refused_not_reported_as_nan(exact):
    import torch

    zero = {name: torch.zeros(4, dtype=torch.float64) for name in exact.EXACT_RUNS}
    with pytest.raises(ValueError, match="did not move the weights.*record the workload again"):
        exact.update_gaps(zero)


def test_opd_runs_report_learner_rows_and_teacher_calls_per_scored_turn(bench):
    step = {"timing_s/step": 10.0, "timing_s/gen": 6.0}
    per_step = {1: dict(step, **{"thundersync/opd/turns": 99, "thundersync/opd/rows": 1, "thundersync/opd/teacher_calls": 1}),
                2: dict(step, **{"thundersync/opd/turns": 100, "thundersync/opd/rows": 80, "thundersync/opd/teacher_calls": 90}),
                3: dict(step, **{"thundersync/opd/turns": 100, "thundersync/opd/rows": 60, "thundersync/opd/teacher_calls": 100})}
    row = bench.modes.summarise("thundersync", {"per_step": per_step})  # step 1 (warm-up) is left out
    assert row["opd_rows_per_turn"] == pytest.approx(0.7) and row["opd_teacher_calls_per_turn"] == pytest.approx(0.95)
    assert "opd_rows_per_turn" not in bench.modes.summarise("sync_bypass", {"per_step": per_step})
    grpo = {s: {"timing_s/step": 10.0} for s in (1, 2)}
    assert "opd_rows_per_turn" not in bench.modes.summarise("thundersync", {"per_step": grpo})


def test_the_rollout_pace_is_each_later_version_s_makespan_and_tool_seconds(trace, tmp_path):
    def run_of(name, spans):  # version -> [(submit, done, tool seconds)]
        lines = [{"policy_version": v, "t_submit": s, "t_done": d, "turns": [{"gen_s": 0.1, "tool_s": tool}]}
                 for v, rows in spans.items() for s, d, tool in rows]
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        return {"traj_path": path}

    sync = run_of("sync", {0: [(0.0, 50.0, 9.0)], 1: [(100.0, 104.0, 1.0), (100.5, 106.0, 2.0)],
                           2: [(200.0, 204.0, 3.0)], 3: [(300.0, 308.0, 1.0)]})
    # medians over versions 1-3 (version 0, the first step, is left out): makespans 6, 4, 8 s; tools 3, 3, 1 s
    assert trace.rollout_makespan(sync) == pytest.approx({"makespan_s": 6.0, "tool_s": 3.0})
    # per version, the first included (what ``rollout_under_load.py`` pairs version by version)
    assert trace.version_makespans(sync["traj_path"]) == pytest.approx({0: 50.0, 1: 6.0, 2: 4.0, 3: 8.0})
    assert trace.rollout_makespan({"traj_path": tmp_path / "missing.jsonl"}) is None


def test_the_last_landing_and_what_follows_it_per_mode(trace, tmp_path):
    # Sync: the last landing is gen's end (step 1 left out): gens 6 and 8 s of steps 9 and 10 s
    per_step = {1: {"timing_s/gen": 1.0, "timing_s/step": 2.0}, 2: {"timing_s/gen": 6.0, "timing_s/step": 9.0},
                3: {"timing_s/gen": 8.0, "timing_s/step": 10.0}}
    assert trace.last_landing({"per_step": per_step, "run_dir": tmp_path}, "sync_bypass") == pytest.approx(
        {"last_landing_s": 7.0, "after_s": 2.5})
    # ThunderSync: the last reward its driver saw, from its step record's start, and the step's end after it
    lines = [{"kind": "step", "step": s, "t_start": 100.0 * s, "t_end": 100.0 * s + end}
             for s, end in ((1, 50.0), (2, 7.5), (3, 9.0))]
    lines += [{"kind": "trajectory", "step": s, "t_reward": 100.0 * s + t}
              for s, ts in ((1, (40.0,)), (2, (3.0, 7.0)), (3, (8.0, 2.0))) for t in ts]
    (tmp_path / "grpo_thundersync.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ts = trace.last_landing({"per_step": {1: {}, 2: {}, 3: {}}, "run_dir": tmp_path}, "thundersync")
    assert ts == pytest.approx({"last_landing_s": 7.5, "after_s": 0.75})  # medians of 7, 8 and of 0.5, 1.0
