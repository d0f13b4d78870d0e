"""The ThunderSync step trace: one record set per step, weight push included, versions present."""

from __future__ import annotations

import json
import time

from thundersync_verl.run.step_record import StepRecorder


def _one_step(rec: StepRecorder, step: int, with_push: bool) -> None:
    rec.begin_step(step)
    t = time.time()
    events = {"turns": [{"gen_s": 0.01, "gen_tokens": 3, "tool_s": 0.0, "prompt_tokens": 2}], "response_tokens": 3,
              "prompt_tokens": 2}  # as the agent loop records them (the simulator's trace schema)
    rec.trajectory(f"u{step}_0_0", {"thundersync_events": events}, 1.0, t_reward=t)
    rec.learner_op("backward", t, t + 0.01, items=[("u", f"u{step}_0_0")], tokens=12)
    rec.learner_op("optimizer", t + 0.01, t + 0.02)
    rec.finish_step({"grad_norm": 0.5, "lr": 1e-3}, {"peak_open_groups": 1})
    if with_push:
        rec.learner_op("weight_sync", t + 0.02, t + 0.05)
        rec.flush()


def test_the_weight_push_is_part_of_its_step_and_versions_are_written(tmp_path):
    rec = StepRecorder(str(tmp_path), mode="thundersync", n_rollout_slots=4)
    _one_step(rec, 1, with_push=True)
    _one_step(rec, 2, with_push=False)  # no push recorded: written when the next step begins
    assert not [json.loads(x) for x in open(tmp_path / "grpo_thundersync.jsonl") if '"step": 2' in x]
    rec.begin_step(3)
    records = [json.loads(x) for x in open(tmp_path / "grpo_thundersync.jsonl")]
    ops = [r["op"] for r in records if r["kind"] == "learner" and r["step"] == 1]
    assert ops == ["backward", "optimizer", "weight_sync"]
    step1 = next(r for r in records if r["kind"] == "step" and r["step"] == 1)
    push = next(r for r in records if r["kind"] == "learner" and r["op"] == "weight_sync")
    assert step1["t_end"] >= push["t1"]
    trajs = [r for r in records if r["kind"] == "trajectory"]
    assert [(r["step"], r["learner_version"], r["policy_version"]) for r in trajs] == [(1, 0, 0), (2, 1, 1)]
    costs = [json.loads(x) for x in open(tmp_path / "report_cost.jsonl")]
    assert [c["step"] for c in costs] == [1, 2] and all(c["in_step_s"] >= 0 for c in costs)  # measured (its cost is a benchmark figure)
    rec.close()  # waits for the background drawer
    assert (tmp_path / "timelines" / "thundersync_step001.png").exists()
    drawn = [json.loads(x) for x in open(tmp_path / "timelines" / "draw_cost.jsonl")]
    assert sorted(d["png"] for d in drawn) == ["thundersync_step001.png", "thundersync_step002.png"]
    assert not list((tmp_path / "timelines").glob("*.job.json"))  # each job file is consumed by its drawing


def test_timeline_every_draws_only_every_nth_step_and_zero_draws_none_while_traces_stay_whole(tmp_path):
    every_2, never = tmp_path / "every_2", tmp_path / "never"
    for run_dir, every in ((every_2, 2), (never, 0)):
        rec = StepRecorder(str(run_dir), mode="thundersync", n_rollout_slots=4, timeline_every=every)
        for step in (1, 2, 3, 4):
            _one_step(rec, step, with_push=True)
        rec.close()
        steps = [json.loads(x)["step"] for x in open(run_dir / "grpo_thundersync.jsonl") if '"kind": "step"' in x]
        assert steps == [1, 2, 3, 4]  # the traces the simulator reads are written every step either way
    assert sorted(p.name for p in (every_2 / "timelines").glob("*.png")) == ["thundersync_step002.png",
                                                                               "thundersync_step004.png"]
    assert not (never / "timelines").exists()


def test_draw_trace_draws_every_finished_step_of_a_run_that_drew_none(tmp_path):
    from thundersync_verl.run.timeline import draw_trace

    rec = StepRecorder(str(tmp_path), mode="thundersync", n_rollout_slots=4, timeline_every=0)
    for step in (1, 2):
        _one_step(rec, step, with_push=True)
    rec.begin_step(3)  # a step that never finished: no step record, nothing to draw
    rec.trajectory("u3_0_0", {}, 1.0, t_reward=time.time())
    rec.close()
    with open(tmp_path / "grpo_thundersync.jsonl", "a") as f:  # as if the run died mid-step 3
        f.write(json.dumps({"kind": "trajectory", "mode": "thundersync", "algo": "grpo", "step": 3, "group_id": "u3",
                            "traj_id": "u3_0_1", "t_submit": 0.0, "t_done": 1.0, "t_reward": 1.0, "reward_s": 0.0,
                            "response_tokens": 3, "prompt_tokens": 2, "policy_version": 2,
                            "turns": [{"gen_s": 0.01, "gen_tokens": 3, "tool_s": 0.0, "prompt_tokens": 2}]}) + "\n")
    drawn = draw_trace(tmp_path / "grpo_thundersync.jsonl", tmp_path / "after")
    assert [p.name for p in drawn] == ["thundersync_step001.png", "thundersync_step002.png"]
    assert all(p.stat().st_size > 1000 for p in drawn)
