"""The docker SWE workspace: its docker CLI calls, checked without a daemon; and a run on a real daemon.

1. Command construction: the exact argv of ``docker run`` (limits, network off, label, unprivileged uid, no
   capability, read-only root), the preparing container, ``exec`` (in-container timeout, env setup) and ``rm``.
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
    volume = lambda a: os.path.join(root, "volumes", a[a.index("-v") + 1].split(":")[0])
    if cmd == "volume" and args[1] == "create":
        os.makedirs(os.path.join(root, "volumes", args[-1]))
    elif cmd == "volume" and args[1] == "rm":
        shutil.rmtree(os.path.join(root, "volumes", args[-1]), ignore_errors=True)
    elif cmd == "run" and "--rm" in args:  # the preparing container: copy the read-only seed into the volume
        seed = [a.rsplit(":", 2)[0] for a in args if a.endswith(":/seed:ro")]
        if seed:
            shutil.copytree(seed[0], volume(args), dirs_exist_ok=True)
    elif cmd == "run":
        with open(os.path.join(root, "containers", args[args.index("--name") + 1]), "w") as f:
            f.write(volume(args))
        print("0123456789ab")
    elif cmd == "exec":
        name = args[args.index("-w") + 2]
        with open(os.path.join(root, "containers", name)) as f:
            cwd = f.read()
        sys.exit(subprocess.run(args[args.index("-w") + 3:], cwd=cwd).returncode)
    elif cmd == "rm":
        path = os.path.join(root, "containers", args[-1])
        if os.path.exists(path):
            os.remove(path)
    elif cmd == "info":
        print("Cannot connect to the Docker daemon", file=sys.stderr)
        sys.exit(1)
""")


# ----- 1. command construction -------------------------------------------------------------------
def test_run_exec_and_rm_commands():
    cfg = DockerConfig.from_mapping({"cpus": 1.5, "memory": "2g", "pids_limit": 256})
    assert run_argv(cfg, "tsv-swe-a", "img:1") == [
        "docker", "run", "-d", "--init", "--name", "tsv-swe-a", "--label", "thundersync.swe=1", "--network", "none",
        "--cpus", "1.5", "--memory", "2g", "--memory-swap", "2g", "--pids-limit", "256", "--ulimit", "nofile=1024:1024",
        "--user", "1000:1000", "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--read-only",
        "--tmpfs", "/tmp:rw,nosuid,nodev,size=512m", "-e", "HOME=/tmp", "-v", "tsv-swe-a-ws:/testbed",
        "-w", "/testbed", "img:1", "sleep", "infinity"]
    argv = exec_argv(cfg, "tsv-swe-a", "pytest 'a b'", 30.0, stdin=True)
    assert argv[:7] == ["docker", "exec", "-i", "-w", "/testbed", "tsv-swe-a", "bash"] and argv[7] == "-c"
    assert argv[8] == f"{cfg.env_setup}\ntimeout -s KILL 30 bash -c 'pytest '\"'\"'a b'\"'\"''"
    assert "-i" not in exec_argv(cfg, "n", "ls", 1.0)
    assert "--user" not in exec_argv(cfg, "n", "ls", 1.0)  # commands run as the container's unprivileged user
    assert remove_argv(cfg, "tsv-swe-a") == ["docker", "rm", "-f", "tsv-swe-a"]
    assert swe_docker.remove_volume_argv(cfg, "tsv-swe-a") == ["docker", "volume", "rm", "-f", "tsv-swe-a-ws"]
    online = DockerConfig.from_mapping({"network": "bridge", "binary": "/usr/bin/docker", "env_setup": ""})
    assert run_argv(online, "n", "i")[0] == "/usr/bin/docker" and "bridge" in run_argv(online, "n", "i")
    assert exec_argv(online, "n", "ls", 5.0)[-1] == "timeout -s KILL 5 bash -c ls"


def test_only_the_preparing_container_holds_capabilities(tmp_path):
    """The agent's container drops every capability; the short-lived preparing one keeps three, has no network
    and mounts the host's repository read-only; both run with no-new-privileges."""
    cfg = DockerConfig.from_mapping({"user": "2000:3000"})
    prep = swe_docker.prepare_argv(cfg, "tsv-swe-a", "img:1", tmp_path)
    caps = [prep[i + 1] for i, a in enumerate(prep) if a == "--cap-add"]
    assert caps == ["CHOWN", "DAC_OVERRIDE", "FOWNER"] and prep[prep.index("--cap-drop") + 1] == "ALL"
    assert prep[prep.index("--network") + 1] == "none" and "--rm" in prep and f"{tmp_path}:/seed:ro" in prep
    assert prep[-1] == "cp -a /seed/. /testbed/ && chown -R 2000:3000 /testbed"
    assert swe_docker.prepare_argv(cfg, "tsv-swe-a", "img:1")[-1] == "chown -R 2000:3000 /testbed"
    run = run_argv(cfg, "tsv-swe-a", "img:1")
    assert "--cap-add" not in run and run[run.index("--user") + 1] == "2000:3000"
    assert all("no-new-privileges" in argv for argv in (prep, run))


@pytest.mark.parametrize("user", ["0:0", "root", "1000", "0:1000", "a:b"])
def test_a_root_or_malformed_user_is_refused(user):
    with pytest.raises(Exception, match=r"swe\.docker\.user.*uid not 0"):
        DockerConfig.from_mapping({"user": user})


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
    (tmp_path / "volumes").mkdir()
    monkeypatch.setenv("STAND_IN_ROOT", str(tmp_path))
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
    assert verbs[:3] == ["volume", "run", "run"] and verbs[-2:] == ["rm", "volume"] and set(verbs[3:-2]) == {"exec"}
    assert calls()[2] == run_argv(cfg, name, "python:3.11")[1:] and "--rm" in calls()[1]
    assert not (containers / name).exists() and name not in swe_docker._LIVE
    assert not (containers.parent / "volumes" / swe_docker.volume_name(name)).exists()


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
            if task.done():  # the start failed: its error, not a wait for a command that never comes
                task.result()
            await asyncio.sleep(0.05)
        task.cancel()  # the trajectory is aborted mid-command
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return task.cancelled()

    assert asyncio.run(body())
    assert calls()[-2:] == [["rm", "-f", ws.name], ["volume", "rm", "-f", swe_docker.volume_name(ws.name)]]
    assert not (containers / ws.name).exists()


def test_the_exit_hook_removes_containers_left_behind(stand_in):
    cfg, calls, containers = stand_in
    name = f"tsv-swe-left-{uuid.uuid4().hex[:6]}"
    (containers / name).write_text("")
    swe_docker._LIVE[name] = cfg.binary
    swe_docker._remove_live_containers()
    assert ["rm", "-f", name] in calls() and not (containers / name).exists() and name not in swe_docker._LIVE
    assert ["volume", "rm", "-f", swe_docker.volume_name(name)] in calls()


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
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"] and host["ReadonlyRootfs"]
    assert "no-new-privileges" in host["SecurityOpt"]
    gone = subprocess.run(["docker", "ps", "-a", "-q", "--filter", f"name={name}"], capture_output=True, text=True)
    assert gone.stdout.strip() == ""
