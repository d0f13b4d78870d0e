"""The sandbox fork server: one child per call, nothing shared between calls, survives its own death. CPU only."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from thundersync_verl.envs import forkserver, sandbox
from thundersync_verl.envs.sandbox import run_python, run_python_async


def _server() -> forkserver.ForkServer:
    return forkserver.shared(sandbox._resolve_netns(None), sandbox.GUARD_SOURCE)


def test_calls_are_separate_children_of_one_server():
    first = run_python("import os\nprint(os.getpid(), os.getppid())", spawn="fork")
    second = run_python("import os\nprint(os.getpid(), os.getppid())", spawn="fork")
    pid1, parent1 = map(int, first.stdout.split())
    pid2, parent2 = map(int, second.stdout.split())
    assert pid1 != pid2 and parent1 == parent2 == _server().proc.pid
    assert parent1 != os.getpid()


def test_no_state_leaks_from_one_call_to_the_next():
    run_python("import builtins, sys\nbuiltins.LEAK = 1\nsys.modules['leak'] = sys\nopen('/tmp/x', 'a') if False else None", spawn="fork")
    result = run_python("import builtins, sys\nprint(hasattr(builtins, 'LEAK'), 'leak' in sys.modules)", spawn="fork")
    assert result.stdout.split() == ["False", "False"]


def test_child_holds_only_its_three_standard_streams():
    # The server's control socket must not reach user code (it could ask for more forks).
    result = run_python("import os\nprint(sorted(int(f) for f in os.listdir('/proc/self/fd')))", spawn="fork")
    fds = eval(result.stdout)
    assert fds[:3] == [0, 1, 2] and len(fds) == 4, fds  # the 4th is listdir's own handle


def test_fork_is_several_times_cheaper_in_cpu_than_a_fresh_interpreter():
    def cpu_per_call(spawn: str, n: int = 24) -> float:
        asyncio.run(run_python_async("print(0)", spawn=spawn))  # server start is not per call
        before = os.times()
        asyncio.run(_many(spawn, n))
        after = os.times()
        return sum(a - b for a, b in zip(after[:4], before[:4])) / n

    async def _many(spawn, n):
        results = await asyncio.gather(*(run_python_async("print(1)", spawn=spawn) for _ in range(n)))
        assert all(r.ok for r in results)

    # children's CPU lands in os.times() only for our own children: count the exec path's
    # children and the fork path's client side; the server's children are measured in its rusage.
    server = _server()
    before_server = _proc_cpu(server.proc.pid)
    fork_client = cpu_per_call("fork")
    fork_server = (_proc_cpu(server.proc.pid) - before_server) / 24  # includes reaped children
    exec_cost = cpu_per_call("exec")
    assert fork_client + fork_server < 0.6 * exec_cost, (fork_client, fork_server, exec_cost)


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(x) for x in fields[11:15]) / ticks  # utime, stime, cutime, cstime


def test_a_dead_server_is_restarted_and_an_inflight_call_still_completes():
    server = _server()

    async def call_while_killing():
        task = asyncio.create_task(run_python_async("import time\ntime.sleep(0.5)\nprint('done')", spawn="fork"))
        await asyncio.sleep(0.2)
        os.kill(server.proc.pid, signal.SIGKILL)
        return await task

    result = asyncio.run(call_while_killing())
    assert result.ok and result.stdout == "done\n"  # rerun in a fresh interpreter, not lost
    deadline = time.time() + 5
    while server.alive and time.time() < deadline:
        time.sleep(0.05)
    assert not server.alive
    again = run_python("print('back')", spawn="fork")
    assert again.ok and _server() is not server and _server().alive


def test_children_die_with_their_server():
    server = _server()

    async def orphan_pid():
        task = asyncio.create_task(run_python_async("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(30)",
                                                    spawn="fork", timeout_s=3.0))
        await asyncio.sleep(0.3)
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == server.proc.pid]
        os.kill(server.proc.pid, signal.SIGKILL)
        await task
        return pids

    pids = asyncio.run(orphan_pid())
    assert pids
    time.sleep(0.3)
    for pid in pids:
        assert _ppid(pid) in (None, 1) and not _running(pid), pid


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
