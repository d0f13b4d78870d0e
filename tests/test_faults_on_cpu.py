"""Fault injection hooks (``thundersync_verl/run/faults.py``) and the checkpoint run state (``run/resume.py``). CPU only.

The hooks are exercised against the real components they change (the sandboxed tool and verifier
processes, torch gradients, a write to a full disk); the main_ppo runs are in benchmarks/faults.py
and tests/e2e/test_resume_main_ppo_on_cpu.py.
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
import random

import pytest
import torch

from thundersync_verl.run import faults
from thundersync_verl.core import StreamingStateError
from thundersync_verl.envs import protocol
from thundersync_verl.envs.tool import PythonTool
from thundersync_verl.envs.verifier import verify
from thundersync_verl.run import resume


@pytest.fixture(autouse=True)
def plan(monkeypatch, tmp_path):
    """Each test sets its own plan; the log goes to a temp file; faults are off again afterwards."""
    monkeypatch.setenv(faults.LOG_ENV, str(tmp_path / "faults.jsonl"))
    yield tmp_path / "faults.jsonl"
    faults.reload("")


def test_off_by_default_changes_nothing():
    assert faults.reload("").faults == {} and faults.ACTIVE is False
    assert faults.tool_code("print(1)") == "print(1)"
    assert faults.verifier_program("P") == "P"
    faults.checkpoint_disk(1)  # no fault: no error


@pytest.mark.parametrize("spec, named", [("disk_ful@step=1", "disk_ful"), ("nan_grad@every=2", "batch=<int>"),
                                         ("sandbox_kill@every=x", "every=<int>")])
def test_bad_spec_is_refused_naming_the_problem(spec, named):
    with pytest.raises(faults.FaultSpecError) as err:
        faults.reload(spec)
    assert named in str(err.value) and "fix:" in str(err.value)


def test_sandbox_kill_kills_the_real_sandbox_process_and_the_tool_reports_it(plan):
    faults.reload("sandbox_kill@every=2")
    tool = PythonTool(retry_prob=0.0, timeout_s=120.0)  # a loaded machine must not turn a slow start into a timeout
    call = protocol.ToolCall(name="python", code="print(6 * 7)")
    outcomes = [asyncio.run(tool.execute(call, random.Random(0))) for _ in range(4)]
    assert [o.kind for o in outcomes] == ["ok", "program_error", "ok", "program_error"]
    assert outcomes[1].sandbox.error == "killed" and outcomes[0].sandbox.stdout.strip() == "42"
    assert [r["call"] for r in faults.read_log(plan)] == [2, 4]


def test_verifier_crash_scores_zero_with_reason_and_hang_is_cut_by_its_timeout():
    faults.reload("verifier_raise@call=1")
    crashed = verify("<answer>4</answer>", "4", timeout_s=120.0)
    assert crashed.score == 0.0 and "RuntimeError" in crashed.reason
    assert verify("<answer>4</answer>", "4", timeout_s=120.0).score == 1.0  # only the first call was hit
    faults.reload("verifier_hang@after=0")
    hung = verify("<answer>4</answer>", "4", timeout_s=1.0)
    assert hung.score == 0.0 and "timeout" in hung.reason and hung.duration_s < 10


class _Batch:
    """A learner batch's identity and buckets, as ``after_backward`` sees them."""

    def __init__(self):
        self.buckets = {"g0/r1": [torch.zeros(3)]}


def test_nan_grad_hits_exactly_the_named_batch_and_chunk(plan):
    faults.reload("nan_grad@batch=2,chunk=2")
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.zeros(4)
    finite = []
    for batch in (_Batch(), _Batch()):
        for _ in range(3):
            faults.after_backward(batch, [p])
            finite.append(bool(torch.isfinite(p.grad).all()))
    assert finite == [True, True, True, True, False, False]  # poisoned at batch 2, chunk 2; the NaN stays
    assert [(r["batch"], r["chunk"]) for r in faults.read_log(plan)] == [(2, 2)]


def test_nan_grad_reaches_the_batch_gradient_when_only_buckets_were_filled():
    faults.reload("nan_grad@batch=1,chunk=1")
    p = torch.nn.Parameter(torch.ones(4))
    batch = _Batch()
    faults.after_backward(batch, [p])
    assert math.isnan(float(p.grad[0])) and bool(torch.isfinite(p.grad[1:]).all())


def test_disk_full_fails_the_named_step_with_enospc():
    faults.reload("disk_full@step=2")
    faults.checkpoint_disk(1)
    with pytest.raises(OSError) as err:
        faults.checkpoint_disk(2)
    assert err.value.errno == errno.ENOSPC


def test_run_state_counts_skipped_steps_and_round_trips(tmp_path):
    state = resume.RunState()
    assert state.count_step([{"grad_norm": 0.5}]) is False
    assert state.count_step({"grad_norm": float("nan")}) is True
    assert state.metrics()["thundersync/steps_skipped_nonfinite"] == 1
    path = str(tmp_path / "global_step_2" / resume.STATE_FILE)
    resume.save_state(path, state, global_step=2, boundary={"open_batches": 0})
    assert json.load(open(path))["global_step"] == 2
    assert resume.load_state(path) == state
    assert resume.load_state(str(tmp_path / "none.json")) is None


class _Learners:
    """``stream_memory()`` rows of a two-rank learner group."""

    def __init__(self, rows):
        self.rows = rows

    def stream_memory(self):
        return self.rows


def test_checkpoint_refused_inside_a_step():
    idle = {"stream/batch_open": False, "stream/open_buckets": []}
    assert resume.check_step_boundary(_Learners([idle, idle]), 3)["open_batches"] == 0
    for busy in ({"stream/batch_open": True, "stream/open_buckets": []},
                 {"stream/batch_open": True, "stream/open_buckets": ["g1/r0"]}):
        with pytest.raises(StreamingStateError) as err:
            resume.check_step_boundary(_Learners([idle, busy]), 3)
        assert "step 3" in str(err.value) and "fix:" in str(err.value)


def test_save_failure_names_the_step_and_the_resume():
    class Cfg:
        class trainer:
            default_local_dir = "/ckpt"
    err = resume.save_failed(4, OSError(errno.ENOSPC, "No space left on device"), Cfg)
    assert "step 4" in str(err) and "resume_mode=auto" in str(err) and "No space left" in str(err)


def test_replay_resumed_at_a_version_passes_over_the_answers_recorded_before_it(tmp_path):
    """A prompt recorded at steps 1 and 3: a run resumed at version 2 gets step 3's answer, a fresh run step 1's."""
    from thundersync_verl.backends.replay.record import FORMAT
    from thundersync_verl.backends.replay.recording import ReplayMissError, Recording

    lines = [{"kind": "header", "format": FORMAT, "t0_unix": 0.0}]
    for version, token in ((0, 7), (2, 9)):
        lines.append({"kind": "generate", "prompt_ids": [1, 2], "response_ids": [token], "log_probs": [-0.5],
                      "stop_reason": "completed", "start_s": float(version), "end_s": version + 0.1, "version": version,
                      "temperature": 1.0, "max_tokens": 4, "request_id": "r", "pid": 1})
    path = tmp_path / "rec.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert Recording(str(path)).next_generate([1, 2]).response_ids == [7]
    resumed = Recording(str(path))
    assert resumed.next_generate([1, 2], min_version=2).response_ids == [9]
    with pytest.raises(ReplayMissError):
        resumed.next_generate([1, 2], min_version=2)


def test_teacher_hang_is_cut_by_the_attempt_timeout_and_retried(plan):
    """``teacher_hang``: the agent loop's teacher request never answers; the per-attempt timeout retries it."""
    from types import SimpleNamespace

    from thundersync_verl.algos.opd.turn_teacher import AgentTurnTeacher, TeacherRetryPolicy, TeacherScoringError

    class Server:  # verl's teacher client surface: prompt_logprobs rows, one per prefix token
        calls = 0

        async def generate(self, request_id, prompt_ids, sampling_params):
            Server.calls += 1
            return SimpleNamespace(extra_fields={"prompt_logprobs": [[-0.5]] * len(prompt_ids),
                                                 "prompt_ids": [[t] for t in prompt_ids]})

    faults.reload("teacher_hang@call=1")
    teacher = AgentTurnTeacher(Server(), TeacherRetryPolicy(max_attempts=2, timeout_s=0.3))
    values, attempts = asyncio.run(teacher.score("t", 0, [1, 2, 3, 4], 2))
    assert attempts == 2 and values == [-0.5, -0.5] and Server.calls == 1  # the hung attempt never reached the server
    assert [r["fault"] for r in faults.read_log(plan)] == ["teacher_hang"]
    faults.reload("teacher_hang@every=1")  # every attempt hangs: a clear error after the last
    with pytest.raises(TeacherScoringError, match=r"after 2 attempt\(s\); last error: no reply within teacher_timeout_s=0.2"):
        asyncio.run(AgentTurnTeacher(Server(), TeacherRetryPolicy(max_attempts=2, timeout_s=0.2)).score("t", 0, [1, 2, 3], 1))


def test_rollout_kill_kills_the_process_serving_the_named_call(plan):
    """``rollout_kill@call=N``: the rollout server's process dies at its N-th generate call (a real SIGKILL)."""
    import multiprocessing as mp
    import signal

    def serve(spec):
        faults.reload(spec)
        for _ in range(3):
            faults.rollout_generate()

    for spec, code in (("rollout_kill@call=2", -signal.SIGKILL), ("rollout_kill@call=4", 0)):
        proc = mp.get_context("fork").Process(target=serve, args=(spec,))
        proc.start()
        proc.join(30)
        assert proc.exitcode == code, spec
    assert [(r["fault"], r["call"]) for r in faults.read_log(plan)] == [("rollout_kill", 2)]
