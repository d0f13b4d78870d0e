"""The docker SWE workspace: its docker CLI calls, checked without a daemon; and a run on a real daemon.

1. Command construction: the exact argv of ``docker run`` (limits, network off, label), ``exec``
   (in-container timeout, env setup), ``cp`` and ``rm``.
2. The lifecycle against a stand-in ``docker`` executable that records its argv and runs ``exec``
   scripts in a folder per container: start applies the bug, tools work, close removes the container,
   and a trajectory cancelled mid-command still removes it (cleanup on abort); so does the exit hook.
3. A real daemon test (image ``$THUNDERSYNC_DOCKER_TEST_IMAGE``, default ``python:3.11``, which has git):
   skipped, with the reason, where no daemon answers ``docker info``.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from thundersync_verl.envs.swe import docker as swe_docker
from thundersync_verl.envs.swe.swe_config import DockerConfig, SWEConfig
from thundersync_verl.envs.swe.docker import DockerWorkspace, docker_available, exec_argv, remove_argv, run_argv

STAND_IN = textwrap.dedent("""\
    #!{python}
    import json, os, shutil, subprocess, sys
    root, log = os.environ["STAND_IN_ROOT"], os.environ["STAND_IN_LOG"]
    args = sys.argv[1:]
    with open(log, "a") as f:
        f.write(json.dumps(args) + "\\n")
    cmd = args[0]
    if cmd == "run":
        os.makedirs(os.path.join(root, args[args.index("--name") + 1]))
        print("0123456789ab")
    elif cmd == "exec":
        name = args[args.index("-w") + 2]
        sys.exit(subprocess.run(args[args.index("-w") + 3:], cwd=os.path.join(root, name)).returncode)
    elif cmd == "cp":
        name = args[2].split(":", 1)[0]
        shutil.copytree(args[1].rstrip("/."), os.path.join(root, name), dirs_exist_ok=True)
    elif cmd == "rm":
        shutil.rmtree(os.path.join(root, args[-1]), ignore_errors=True)
    elif cmd == "info":
        print("Cannot connect to the Docker daemon", file=sys.stderr)
        sys.exit(1)
""")


# ----- 1. command construction -------------------------------------------------------------------
def test_run_exec_and_rm_commands():
    cfg = DockerConfig.from_mapping({"cpus": 1.5, "memory": "2g", "pids_limit": 256})
    assert run_argv(cfg, "tsv-swe-a", "img:1") == [
        "docker", "run", "-d", "--init", "--name", "tsv-swe-a", "--label", "thundersync.swe=1", "--network", "none",
        "--cpus", "1.5", "--memory", "2g", "--pids-limit", "256", "-w", "/testbed", "img:1", "sleep", "infinity"]
    argv = exec_argv(cfg, "tsv-swe-a", "pytest 'a b'", 30.0, stdin=True)
    assert argv[:7] == ["docker", "exec", "-i", "-w", "/testbed", "tsv-swe-a", "bash"] and argv[7] == "-c"
    assert argv[8] == f"{cfg.env_setup}\ntimeout -s KILL 30 bash -c 'pytest '\"'\"'a b'\"'\"''"
    assert "-i" not in exec_argv(cfg, "n", "ls", 1.0)
    assert remove_argv(cfg, "tsv-swe-a") == ["docker", "rm", "-f", "tsv-swe-a"]
    online = DockerConfig.from_mapping({"network": "bridge", "binary": "/usr/bin/docker", "env_setup": ""})
    assert run_argv(online, "n", "i")[0] == "/usr/bin/docker" and "bridge" in run_argv(online, "n", "i")
    assert exec_argv(online, "n", "ls", 5.0)[-1] == "timeout -s KILL 5 bash -c ls"


def test_container_names_are_unique_and_docker_safe(synthetic_set):
    inst = synthetic_set["instances"][0]
    a, b = swe_docker.container_name(inst), swe_docker.container_name(inst)
    assert a != b and a.startswith("tsv-swe-synthetic__textkit.") and all(c.isalnum() or c in "_.-" for c in a)


# ----- 2. the lifecycle against a stand-in CLI ------------------------------------------------------
@pytest.fixture()
def stand_in(tmp_path, monkeypatch):
    exe = tmp_path / "docker"
    exe.write_text(STAND_IN.format(python=sys.executable))
    exe.chmod(0o755)
    (tmp_path / "containers").mkdir()
    monkeypatch.setenv("STAND_IN_ROOT", str(tmp_path / "containers"))
    monkeypatch.setenv("STAND_IN_LOG", str(tmp_path / "calls.jsonl"))
    cfg = SWEConfig.from_verl({"swe": {"sandbox": "docker", "docker": {"binary": str(exe), "image": "python:3.11"}}})
    log = tmp_path / "calls.jsonl"
    calls = lambda: [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []  # noqa: E731
    return cfg.docker, calls, tmp_path / "containers"


def test_start_tools_and_close_through_the_cli(synthetic_set, stand_in):
    cfg, calls, containers = stand_in
    inst = synthetic_set["instances"][0]

    async def body():
        ws = DockerWorkspace(inst, cfg, seed_dir=synthetic_set["repos_dir"])
        await ws.start()
        try:
            source = await ws.read_file("textkit/core.py")
            await ws.write_file("notes/a.txt", "x y\n")
            listing = await ws.run("cat notes/a.txt; git log --format=%s", timeout_s=20)
            return ws.name, source, listing
        finally:
            await ws.close()

    name, source, listing = asyncio.run(body())
    assert '"_".join(words)' in source  # the bug patch was applied inside the "container"
    assert listing.stdout == f"x y\n{inst.instance_id}\n"
    verbs = [c[0] for c in calls()]
    assert verbs[:2] == ["run", "cp"] and verbs[-1] == "rm" and set(verbs[2:-1]) == {"exec"}
    assert calls()[0] == run_argv(cfg, name, "python:3.11")[1:]
    assert not (containers / name).exists() and name not in swe_docker._LIVE


@pytest.mark.slow  # about 30 s: as long as the cancelled `sleep 30` command
def test_a_cancelled_trajectory_still_removes_its_container(synthetic_set, stand_in):
    from thundersync_verl.envs.swe.swe_agent_loop import _shutdown, _start

    cfg, calls, containers = stand_in
    ws = DockerWorkspace(synthetic_set["instances"][0], cfg, seed_dir=synthetic_set["repos_dir"])

    async def trajectory():  # the agent loop's shape: start, a tool call, shutdown in a finally
        starting = asyncio.create_task(_start(ws))
        try:
            await starting
            await ws.run("sleep 30", timeout_s=60)
        finally:
            await _shutdown(ws, starting)

    async def body():
        task = asyncio.create_task(trajectory())
        while not any("sleep 30" in c[-1] for c in calls() if c[0] == "exec"):
            await asyncio.sleep(0.05)
        task.cancel()  # the trajectory is aborted mid-command
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return task.cancelled()

    assert asyncio.run(body())
    assert calls()[-1] == ["rm", "-f", ws.name] and not (containers / ws.name).exists()


def test_the_exit_hook_removes_containers_left_behind(stand_in):
    cfg, calls, containers = stand_in
    name = f"tsv-swe-left-{uuid.uuid4().hex[:6]}"
    (containers / name).mkdir()
    swe_docker._LIVE[name] = cfg.binary
    swe_docker._remove_live_containers()
    assert ["rm", "-f", name] in calls() and not (containers / name).exists() and name not in swe_docker._LIVE


def test_docker_available_reports_why_not(stand_in):
    cfg, _, _ = stand_in
    ok, reason = docker_available(cfg.binary)
    assert not ok and "no docker daemon reachable" in reason and "Cannot connect" in reason
    assert docker_available("/nonexistent/docker")[0] is False


# ----- 3. a real daemon ----------------------------------------------------------------------------
DAEMON, WHY_NOT = docker_available()
TEST_IMAGE = os.environ.get("THUNDERSYNC_DOCKER_TEST_IMAGE", "python:3.11")


@pytest.mark.skipif(not DAEMON, reason=f"needs a docker daemon: {WHY_NOT}")
def test_one_container_per_trajectory_on_a_real_daemon(synthetic_set):
    have = subprocess.run(["docker", "image", "inspect", TEST_IMAGE], capture_output=True).returncode == 0
    if not have and subprocess.run(["docker", "pull", TEST_IMAGE], capture_output=True, timeout=900).returncode != 0:
        pytest.skip(f"image {TEST_IMAGE} is not present and cannot be pulled (set THUNDERSYNC_DOCKER_TEST_IMAGE)")
    cfg = SWEConfig.from_verl({"swe": {"docker": {"image": TEST_IMAGE, "memory": "1g", "cpus": 1, "env_setup": ""}}}).docker
    inst = synthetic_set["instances"][0]

    async def body():
        ws = DockerWorkspace(inst, cfg, seed_dir=synthetic_set["repos_dir"])
        await ws.start()
        try:
            inspect = subprocess.run(["docker", "inspect", ws.name], capture_output=True, text=True, check=True)
            net = await ws.run("python -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)\"", timeout_s=30)
            return ws.name, await ws.read_file("textkit/core.py"), json.loads(inspect.stdout)[0]["HostConfig"], net
        finally:
            await ws.close()

    name, source, host, net = asyncio.run(body())
    assert '"_".join(words)' in source and not net.ok
    assert host["NetworkMode"] == "none" and host["Memory"] == 1 << 30 and host["NanoCpus"] == 10**9
    gone = subprocess.run(["docker", "ps", "-a", "-q", "--filter", f"name={name}"], capture_output=True, text=True)
    assert gone.stdout.strip() == ""
