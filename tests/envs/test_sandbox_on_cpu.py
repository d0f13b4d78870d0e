"""The sandbox denies the network, enforces its limits and runs calls concurrently, forked or spawned. CPU only."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time

import pytest

from thundersync_verl.envs import jail, sandbox
from thundersync_verl.envs.sandbox import netns_prefix, run_python, run_python_async

CONNECT = """
import socket
try:
    s = socket.create_connection(({host!r}, {port}), timeout=2)
    print("CONNECTED")
except Exception as exc:
    print("BLOCKED", type(exc).__name__)
"""


@pytest.fixture(autouse=True, params=["fork", "exec"])
def spawn(request, monkeypatch):
    """Every test runs through both paths: the fork server (default) and a fresh interpreter per call."""
    monkeypatch.setenv("THUNDERSYNC_SANDBOX_SPAWN", request.param)
    return request.param


@pytest.fixture()
def listener():
    """A loopback TCP server in the test process: a connect from the sandbox would succeed
    if the sandbox shared our network."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.setblocking(False)
    yield server
    server.close()


def _accepted_any(server: socket.socket) -> bool:
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def test_prints_and_exits_cleanly():
    result = run_python("print(37+45*2)")
    assert result.ok and result.returncode == 0
    assert result.stdout == "127\n" and not result.timed_out and not result.truncated


def test_control_without_any_barrier_the_loopback_connect_succeeds(listener):
    # Proves the network tests below can fail: with both barriers off the connect goes through.
    port = listener.getsockname()[1]
    result = run_python(CONNECT.format(host="127.0.0.1", port=port), isolate_network=False, guard_network=False)
    assert "CONNECTED" in result.stdout
    time.sleep(0.05)
    assert _accepted_any(listener)


@pytest.mark.parametrize("host", ["127.0.0.1", "1.1.1.1"])
def test_default_sandbox_denies_loopback_and_external(listener, host):
    port = listener.getsockname()[1] if host == "127.0.0.1" else 80
    result = run_python(CONNECT.format(host=host, port=port))
    assert "CONNECTED" not in result.stdout
    assert result.stdout.startswith("BLOCKED PermissionError")  # the audit guard fired
    assert not _accepted_any(listener)


@pytest.mark.skipif(not netns_prefix(), reason="no network namespace available on this machine")
@pytest.mark.parametrize("host", ["127.0.0.1", "1.1.1.1"])
def test_network_namespace_alone_denies_network(listener, host):
    port = listener.getsockname()[1] if host == "127.0.0.1" else 80
    result = run_python(CONNECT.format(host=host, port=port), isolate_network=True, guard_network=False)
    assert result.stdout.startswith("BLOCKED") and "PermissionError" not in result.stdout
    assert not _accepted_any(listener)


def test_guard_alone_denies_network_and_process_spawning(listener):
    port = listener.getsockname()[1]
    result = run_python(CONNECT.format(host="127.0.0.1", port=port), isolate_network=False)
    assert result.stdout.startswith("BLOCKED PermissionError")
    spawn = run_python("import os\nos.system('echo escaped')", isolate_network=False)
    assert spawn.error == "denied" and "escaped" not in spawn.stdout


def test_hanging_program_is_killed_at_the_wall_timeout():
    started = time.perf_counter()
    result = run_python("import time\ntime.sleep(30)", timeout_s=1.0)
    elapsed = time.perf_counter() - started
    assert result.timed_out and result.error == "timeout" and not result.ok
    assert 0.9 <= elapsed < 10.0


def test_timeout_kills_the_whole_process_group():
    # With the spawn guard off, the program starts a grandchild; the timeout must kill it too. Its pid may be
    # one of a PID namespace of its own, so it is found on the host by its unique command line.
    marker = f"{60 + random.random():.6f}"
    code = f"import subprocess, time\np = subprocess.Popen(['sleep', '{marker}'])\nprint(p.pid, flush=True)\ntime.sleep(60)"
    result = run_python(code, timeout_s=1.0, guard_network=False)
    assert result.timed_out and result.stdout.strip().isdigit()  # the grandchild was started
    deadline = time.time() + 5
    while _running_with(marker) and time.time() < deadline:
        time.sleep(0.05)
    assert not _running_with(marker), "the grandchild outlived the timeout"


def _running_with(marker: str) -> list[int]:
    """Live (non-zombie) host processes whose command line contains ``marker``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def test_memory_hog_fails_with_memory_limit():
    result = run_python("x = bytearray(1 << 30)\nprint('allocated')", mem_mb=256)
    assert result.error == "memory_limit" and "allocated" not in result.stdout


def test_cpu_bound_loop_hits_the_cpu_limit():
    result = run_python("while True:\n    pass", cpu_s=1, timeout_s=10.0)
    assert result.error in ("cpu_limit", "killed") and not result.timed_out  # the CPU limit ended it, not the 10 s timeout


def test_output_is_truncated_at_the_cap():
    result = run_python("print('x' * 10000)\nprint('end')", max_output_bytes=512)
    assert result.ok and result.truncated
    assert len(result.stdout) == 512 and result.stdout == "x" * 512
    small = run_python("print('x' * 100)", max_output_bytes=512)
    assert not small.truncated and small.stdout == "x" * 100 + "\n"


def test_stderr_keeps_the_tail_where_the_error_is():
    result = run_python("import sys\nsys.stderr.write('noise\\n' * 500)\nraise ValueError('the real error')")
    assert result.error == "nonzero_exit" and result.truncated
    assert result.stderr.strip().endswith("ValueError: the real error")


def test_stdin_cwd_and_environment_are_isolated():
    code = "import os, sys\nprint(sys.stdin.read().upper())\nprint(os.getcwd())\nprint(sorted(os.environ))\nprint(os.listdir('.'))"
    result = run_python(code, stdin="hello")
    lines = result.stdout.splitlines()
    assert lines[0] == "HELLO"
    if jail.support().ok:  # the call's folder, where the kernel sandbox mounts it
        assert lines[1] == sandbox.JAIL_WORKDIR
    else:
        assert os.path.basename(lines[1]).startswith("tsv-sandbox-") and not os.path.exists(lines[1])
    assert eval(lines[2]) == ["HOME", "LANG", "PATH", "PYTHONHASHSEED", "PYTHONIOENCODING", "TMPDIR"]
    assert eval(lines[3]) == ["main.py"]


def test_async_calls_run_concurrently(tmp_path, monkeypatch):
    """Each call's child waits for a go file in its own folder, which the test writes only once all n children
    are alive at once (the folder is the one place both the test and a kernel-sandboxed call can see)."""
    n = 6
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    server = sandbox.default_fork_server()
    child = ("import os, time\nt = time.monotonic()\nwhile not os.path.exists('go') and time.monotonic() - t < 120:\n"
             "    time.sleep(0.01)\nprint(os.path.exists('go'))")

    async def release():
        most, deadline = 0, time.monotonic() + 60  # a hang guard: calls run one after another never reach n
        while most < n and time.monotonic() < deadline:
            most = max(most, len(_children(server.proc.pid)))
            await asyncio.sleep(0.01)
        for folder in tmp_path.glob(f"{sandbox.WORKDIR_PREFIX}*"):
            ((folder / "work") if (folder / "work").is_dir() else folder).joinpath("go").touch()
        return most

    async def many():
        nonlocal calls
        calls = [asyncio.ensure_future(run_python_async(child, spawn="fork", timeout_s=300)) for _ in range(n)]
        most = await release()
        return most, await asyncio.gather(*calls)

    calls = []
    most, results = asyncio.run(many())
    assert most == n, f"at most {most} of {n} calls were running at once"
    assert [r.stdout for r in results] == ["True\n"] * n  # every child was released by the go file, none timed out


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def test_extra_latency_is_added_and_overlaps(latency_sleeps):
    async def many():
        return await asyncio.gather(*(run_python_async("print(1)", extra_latency_s=0.5) for _ in range(5)))

    latency_sleeps.delay = 0.5
    results = asyncio.run(many())
    assert all(r.ok and r.duration_s >= 0.5 for r in results)
    assert latency_sleeps.count == 5 and latency_sleeps.most == 5  # all five latencies were awaited at once


def test_blocking_call_works_inside_a_running_event_loop():
    async def inside():
        return run_python("print('ok')")

    assert asyncio.run(inside()).stdout == "ok\n"


@pytest.mark.parametrize("use_prlimit", [True, False], ids=["prlimit", "preexec_fn"])
def test_limits_hold_with_and_without_prlimit(monkeypatch, use_prlimit):
    from thundersync_verl.envs import sandbox

    if use_prlimit and sandbox._prlimit() is None:
        pytest.skip("prlimit (util-linux) is not installed here")
    if not use_prlimit:
        monkeypatch.setattr(sandbox, "_prlimit", lambda: None)
    result = run_python("import resource\nprint(resource.getrlimit(resource.RLIMIT_AS)[0], resource.getrlimit(resource.RLIMIT_NOFILE)[0])",
                        mem_mb=200)
    assert result.ok, result
    assert result.stdout.split() == [str(200 * 1024 * 1024), "64"]
    hog = run_python("x = bytearray(1 << 30)\nprint('allocated')", mem_mb=200)
    assert not hog.ok and "allocated" not in hog.stdout
