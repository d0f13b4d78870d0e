"""The sandbox fork server: one child per call, nothing shared between calls, survives its own death. CPU only."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from thundersync_verl.envs import forkserver, jail, sandbox
from thundersync_verl.envs.sandbox import run_python, run_python_async


def _server() -> forkserver.ForkServer:
    return sandbox.default_fork_server()


def test_calls_are_separate_children_of_one_server():
    code = "import os\nprint(os.getpid(), os.getppid(), os.readlink('/proc/self/ns/pid')[5:-1])"
    server = _server()
    first = run_python(code, spawn="fork", guard_network=False)
    second = run_python(code, spawn="fork", guard_network=False)
    pid1, parent1, ns1 = map(int, first.stdout.split())
    pid2, parent2, ns2 = map(int, second.stdout.split())
    if jail.support().ok:  # each call runs below the init of a fresh namespace (an inode number may be reused)
        host = int(os.readlink("/proc/self/ns/pid")[5:-1])
        assert (pid1, parent1, pid2, parent2) == (2, 1, 2, 1) and host not in (ns1, ns2)
    else:
        assert pid1 != pid2 and parent1 == parent2 == server.proc.pid and parent1 != os.getpid()
    assert _server() is server and server.alive  # one server served both


def test_no_state_leaks_from_one_call_to_the_next():
    run_python("import builtins, sys\nbuiltins.LEAK = 1\nsys.modules['leak'] = sys\nopen('/tmp/x', 'a') if False else None", spawn="fork")
    result = run_python("import builtins, sys\nprint(hasattr(builtins, 'LEAK'), 'leak' in sys.modules)", spawn="fork")
    assert result.stdout.split() == ["False", "False"]


def test_child_holds_only_its_three_standard_streams():
    # The server's control socket must not reach user code (it could ask for more forks).
    result = run_python("import os\nprint(sorted(int(f) for f in os.listdir('/proc/self/fd')))", spawn="fork")
    fds = eval(result.stdout)
    assert fds[:3] == [0, 1, 2] and len(fds) == 4, fds  # the 4th is listdir's own handle


def test_fork_and_exec_paths_give_the_same_results_and_leave_no_child_behind():
    """What each path does, not what it costs: benchmarks/sandbox_spawn.py measures the CPU per call."""

    async def many(spawn: str, n: int = 12):
        return await asyncio.gather(*(run_python_async(f"print({i} * {i})", spawn=spawn) for i in range(n)))

    server = _server()
    fork, exec_ = asyncio.run(many("fork")), asyncio.run(many("exec"))
    assert [r.stdout for r in fork] == [r.stdout for r in exec_] == [f"{i * i}\n" for i in range(12)]
    assert all(r.ok for r in fork + exec_)
    assert _wait_for(lambda: not _children(server.proc.pid)), _children(server.proc.pid)  # every call reaped


def _children(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == pid]


def _wait_for(condition, timeout_s: float = 30.0) -> bool:
    """Poll ``condition`` until it holds; a hang guard, not a speed claim."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_dead_server_is_restarted_and_an_inflight_call_still_completes():
    server = _server()

    async def call_while_killing():
        task = asyncio.create_task(run_python_async("import time\ntime.sleep(0.5)\nprint('done')", spawn="fork"))
        await asyncio.sleep(0.2)
        os.kill(server.proc.pid, signal.SIGKILL)
        return await task

    result = asyncio.run(call_while_killing())
    assert result.ok and result.stdout == "done\n"  # rerun in a fresh interpreter, not lost
    assert _wait_for(lambda: not server.alive)
    again = run_python("print('back')", spawn="fork")
    assert again.ok and _server() is not server and _server().alive


def test_children_die_with_their_server():
    server = _server()

    async def orphan_pid():
        task = asyncio.create_task(run_python_async("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(30)",
                                                    spawn="fork", timeout_s=3.0))
        while not _children(server.proc.pid):  # the call's child has started (the test's timeout guards a hang)
            await asyncio.sleep(0.02)
        pids = _children(server.proc.pid)
        os.kill(server.proc.pid, signal.SIGKILL)
        await task
        return pids

    pids = asyncio.run(orphan_pid())
    assert pids
    for pid in pids:
        assert _wait_for(lambda: _ppid(pid) in (None, 1) and not _running(pid)), pid


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_unknown_spawn_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="'fork' or 'exec'"):
        run_python("print(1)", spawn="thread")
