"""Node-loss faults (``rollout_node_kill``, ``learner_node_kill``) and the stop that names the lost node.

The hooks kill the parent of the process they run in (a Ray worker's parent is its node's raylet) and then that
process; here the parent is a stand-in process, so the kill is real and observable without a cluster (the
cluster runs are ``benchmarks/faults.py`` point 6)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

from thundersync_verl.run import faults, resume

# a "raylet" that starts one "worker"; the worker makes generate calls through the real hook
RAYLET = textwrap.dedent("""
    import subprocess, sys
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    worker.wait()
    print("raylet survived", worker.returncode, flush=True)
""")
WORKER = textwrap.dedent("""
    from thundersync_verl.run import faults
    for call in range(1, 6):
        faults.rollout_generate()
    print("worker survived", flush=True)
""")


def _node(spec: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**__import__("os").environ, faults.ENV: spec, faults.LOG_ENV: str(tmp_path / "fired.jsonl")}
    return subprocess.run([sys.executable, "-c", RAYLET, WORKER], env=env, capture_output=True, text=True, timeout=120)


def test_rollout_node_kill_kills_the_node_process_and_its_worker_at_the_named_call(tmp_path):
    out = _node("rollout_node_kill@call=3", tmp_path)
    assert out.returncode == -signal.SIGKILL  # the "raylet" itself was killed
    assert "survived" not in out.stdout
    assert [(r["fault"], r["call"]) for r in faults.read_log(tmp_path / "fired.jsonl")] == [("rollout_node_kill", 3)]


def test_a_later_call_than_the_run_makes_kills_nothing(tmp_path):
    out = _node("rollout_node_kill@call=9", tmp_path)
    assert out.returncode == 0 and "raylet survived 0" in out.stdout


def test_node_lost_stop_names_the_node_the_step_and_the_resume():
    config = SimpleNamespace(trainer=SimpleNamespace(default_local_dir="/ckpt"))
    msg = str(resume.node_lost(4, ["711f5d0e0e81 at 127.0.0.1 (GPU, thundersync_rollout)"], RuntimeError("x"), config))
    assert "thundersync_rollout" in msg and "step 4" in msg and "left the cluster" in msg
    assert "NOT taken" in msg and "ray start --address" in msg and "trainer.resume_mode=auto" in msg and "/ckpt" in msg


def test_lost_nodes_are_those_alive_at_start_and_gone_now(monkeypatch):
    monkeypatch.setattr(resume, "alive_nodes", lambda: {"a": "node a"})
    assert resume.lost_nodes({"a": "node a", "b": "node b"}) == ["node b"]
    assert resume.lost_nodes({"a": "node a"}) == []
