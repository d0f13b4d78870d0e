"""Model-written code that tries to escape the sandbox: each attempt is contained, reported, cleaned up.

GPUs needed: 0 (CPU only). Every attempt runs in a real sandbox process (both spawn paths, and
the SWE shell workspace for the escapes that need a shell); after each test no process started
by it is left and its temporary folder is empty.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import pytest

from thundersync_verl.envs import forkserver, protocol, sandbox
from thundersync_verl.envs.sandbox import run_python
from thundersync_verl.envs.tool import PythonTool

PROJECT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, params=["fork", "exec"])
def spawn(request, monkeypatch, tmp_path):
    """Both spawn paths; sandbox folders go to a private temp dir, checked empty afterwards, and
    no process started during the test may outlive it."""
    monkeypatch.setenv("THUNDERSYNC_SANDBOX_SPAWN", request.param)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    before = _descendants()
    yield request.param
    assert not list(scratch.iterdir()), f"left in the temp dir: {list(scratch.iterdir())}"
    left = _wait_gone(_descendants() - before - _servers())
    assert not left, f"processes left behind: {left}"


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _descendants() -> set[int]:
    """Live (non-zombie) processes below this test process, fork servers' children included."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (fields := _stat(int(name))) is not None and fields[0] not in ("Z", "X"):
            parents[int(name)] = int(fields[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _servers() -> set[int]:
    """The long-lived fork servers (not leftovers: they serve the next call)."""
    return {server.proc.pid for server in forkserver._servers.values() if server.alive}


def _wait_gone(pids: set[int], within_s: float = 2.0) -> set[int]:
    deadline = time.time() + within_s
    while pids and time.time() < deadline:
        time.sleep(0.05)
        pids = {pid for pid in pids if (fields := _stat(pid)) is not None and fields[0] not in ("Z", "X")}
    return pids


def _tool(code: str, **kwargs) -> tuple[str, str, sandbox.SandboxResult]:
    """One call through the python tool as the agent loop makes it: (kind, tool text, sandbox result).
    The default timeout is generous: the first call of a test also starts the fork server."""
    kwargs.setdefault("timeout_s", 20.0)
    outcome = asyncio.run(PythonTool(retry_prob=0.0, **kwargs).execute(protocol.ToolCall("python", code, {"code": code}),
                                                                       random.Random(0)))
    assert outcome.text.startswith(protocol.TOOL_RESPONSE_OPEN) and outcome.text.endswith(protocol.TOOL_RESPONSE_CLOSE)
    return outcome.kind, outcome.text, outcome.sandbox


def _assert_denied(code: str, *words: str) -> str:
    kind, text, result = _tool(code)
    assert kind == "program_error" and result.error == "denied", (text, result)
    assert "error: PermissionError: sandbox:" in text and "denied" in text, text
    for word in words:
        assert word in text, (word, text)
    return text


def test_control_an_allowed_program_runs():
    # Proves the denials below come from the guard, not from a sandbox that runs nothing.
    kind, text, result = _tool("import os, json\nopen('out.txt', 'w').write('hi')\nprint(json.dumps(os.listdir('.')))")
    assert kind == "ok" and result.ok and "out.txt" in text


@pytest.mark.parametrize("code, word", [
    ("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)", "socket"),
    ("import socket\nsocket.getaddrinfo('example.com', 80)", "getaddrinfo"),
    ("import socket\nsocket.gethostbyname('localhost')", "gethostbyname"),
], ids=["socket", "getaddrinfo", "gethostbyname"])
def test_network_and_name_lookups_are_denied(code, word):
    _assert_denied(code, word)


@pytest.mark.parametrize("code, word", [
    ("import os\nwhile True:\n    os.fork()", "os.fork"),
    ("import subprocess\nsubprocess.Popen(['sleep', '60'])", "_posixsubprocess"),
    ("import _posixsubprocess", "_posixsubprocess"),
    ("import os\nos.system(':(){ :|:& };:')", "os.system"),
    ("import os\nos.posix_spawn('/bin/sleep', ['sleep', '60'], {})", "os.posix_spawn"),
    ("import os\nos.execv('/bin/sh', ['sh'])", "os.exec"),
], ids=["fork-bomb", "subprocess", "raw-fork-exec", "system", "posix_spawn", "exec"])
def test_fork_bombs_and_process_spawning_are_denied(code, word):
    _assert_denied(code, word)


def test_a_pty_fork_is_denied():
    # pty.fork falls back to openpty + os.fork when forkpty is refused: the guard refuses the fork, and
    # in the kernel sandbox there is no pty device to open in the first place.
    kind, text, result = _tool("import pty\npty.fork()\nprint('forked')")
    assert kind == "program_error" and "forked" not in result.stdout, text
    assert (result.error == "denied" and "os.fork" in text) or "out of pty devices" in text, text


def test_native_code_and_guard_tampering_are_denied():
    _assert_denied("import ctypes\nctypes.CDLL(None).fork()", "ctypes")
    _assert_denied("import gc\nprint(len(gc.get_objects()))", "gc.get_objects")
    # Rebinding the bootstrap's globals cannot loosen the hook: its state is in a closure.
    _assert_denied("import sys\nvars(sys.modules['__main__']).clear()\nimport socket\nsocket.socket()", "socket")


def test_signals_to_other_processes_are_denied():
    _assert_denied(f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)", "signalling process")  # the trainer
    _assert_denied(f"import os, signal\nos.killpg({os.getpgrp()}, signal.SIGKILL)", "signalling process")  # its group
    kind, _, result = _tool("import os, signal\nsignal.signal(signal.SIGUSR1, lambda *a: print('own'))\n"
                            "os.kill(os.getpid(), signal.SIGUSR1)")
    assert kind == "ok" and result.stdout == "own\n"


def test_memory_past_the_limit_is_a_memory_error():
    kind, text, result = _tool("x = bytearray(1 << 30)\nprint('allocated')", mem_mb=128)
    assert kind == "program_error" and result.error == "memory_limit" and "allocated" not in result.stdout
    assert text == "<tool_response>error: MemoryError</tool_response>"


def test_writes_outside_the_workspace_are_denied(tmp_path):
    outside = tmp_path / "escaped.txt"
    _assert_denied(f"open({str(outside)!r}, 'w').write('x')", "writing")
    _assert_denied(f"import os\nos.mkdir({str(tmp_path / 'newdir')!r})", "os.mkdir")
    _assert_denied(f"import os\nopen('a', 'w').close()\nos.rename('a', {str(outside)!r})", "os.rename")
    _assert_denied(f"import os\nos.symlink({str(outside)!r}, 'link')\nopen('link', 'w').write('x')", "os.symlink")
    _assert_denied(f"open({str(PROJECT / 'README.md')!r}, 'a').write('x')", "writing")
    _assert_denied("import os\nos.chdir('..')\nopen('sibling.txt', 'w')", "writing")
    _assert_denied(f"import os\nfd = os.open({str(outside)!r}, os.O_CREAT | os.O_WRONLY)", "writing")
    assert not outside.exists() and not (tmp_path / "newdir").exists()


def test_files_past_the_size_limit_fail():
    kind, text, result = _tool("open('big', 'wb').write(b'x' * (2 << 20))")
    assert kind == "program_error" and "File too large" in text


def test_project_home_and_system_files_cannot_be_read():
    home = os.path.expanduser("~")
    _assert_denied(f"print(open({str(PROJECT / 'setup.py')!r}).read())", "reading")
    _assert_denied(f"import os\nprint(os.listdir({str(PROJECT)!r}))", "listing")
    _assert_denied(f"import os\nprint(os.listdir({home!r}))", "listing")
    _assert_denied("print(open('/etc/passwd').read())", "reading")
    _assert_denied("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())", "reading")  # the trainer's env
    # ...while the interpreter's own library still imports, and its own /proc entry reads.
    kind, text, _ = _tool("import json, decimal\nprint(open('/proc/self/status').read().split()[0])")
    assert kind == "ok" and "Name" in text


def test_sleeping_forever_is_killed_at_the_timeout():
    started = time.perf_counter()
    kind, text, result = _tool("import time\nwhile True:\n    time.sleep(1000)", timeout_s=1.0)
    assert time.perf_counter() - started < 15.0
    assert kind == "program_error" and result.timed_out and text == "<tool_response>error: timeout</tool_response>"


def test_printing_without_end_costs_a_bounded_buffer():
    code = "import sys\nchunk = 'x' * 65536\nwhile True:\n    sys.stdout.write(chunk)"  # gigabytes, until killed
    kind, text, result = _tool(code, timeout_s=4.0, max_output_bytes=4096)
    assert result.timed_out and result.truncated and len(result.stdout) == 4096
    assert kind == "program_error" and text == "<tool_response>error: timeout</tool_response>"


def test_printing_a_lot_is_cut_with_a_marker():
    code = "import sys\nchunk = 'x' * 65536\nfor _ in range(1 << 10):\n    sys.stdout.write(chunk)\nprint('end')"  # 64 MiB
    kind, text, result = _tool(code, timeout_s=20.0, max_output_bytes=4096)
    assert kind == "ok" and result.truncated and len(result.stdout) == 4096
    assert text.endswith(protocol.TRUNCATED_MARK + protocol.TOOL_RESPONSE_CLOSE), text
    assert len(text) == len(protocol.TOOL_RESPONSE_OPEN + protocol.TOOL_RESPONSE_CLOSE) + protocol.MAX_TOOL_RESPONSE_CHARS


def test_binary_output_reaches_the_agent_as_text():
    kind, text, result = _tool("import sys\nsys.stdout.buffer.write(bytes(range(256)))")
    assert kind == "ok" and isinstance(text, str) and "\ufffd" in result.stdout


@pytest.mark.parametrize("code", [
    "import subprocess\nsubprocess.Popen(['sleep', '300'])\nprint('started')",
    "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        import time\n        time.sleep(300)\n"
    "    os._exit(0)\nprint('started')",
], ids=["background-child", "setsid-daemon"])
def test_background_children_die_with_the_call(code, spawn):
    # With the guard off (as for a shell sandbox) the program can start children; they must not survive it.
    if spawn == "exec" and "setsid" in code:
        pytest.skip("exec path: only the call's process group is killed (the guard forbids the setsid daemon)")
    result = run_python(code, guard_network=False, timeout_s=30.0)
    assert result.ok and result.stdout == "started\n", result
    assert result.duration_s < 15.0  # the call ends with its process, not at the timeout
    # the fixture asserts that nothing below this test process is left


def test_with_the_guard_the_background_child_is_never_started():
    _assert_denied("import subprocess\nsubprocess.Popen(['sleep', '300'], start_new_session=True)", "_posixsubprocess")


def test_swe_shell_leaves_no_process_behind(spawn, tmp_path):
    if spawn == "exec":
        pytest.skip("the shell workspace has one spawn path")
    from thundersync_verl.envs.swe.instance import SWEInstance
    from thundersync_verl.envs.swe.swe_sandbox import LocalWorkspace

    repo = tmp_path / "repos" / "demo"
    repo.mkdir(parents=True)
    (repo / "a.py").write_text("x = 1\n")
    patch = "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    inst = SWEInstance(instance_id="demo-1", repo="demo", patch=patch, FAIL_TO_PASS=(), PASS_TO_PASS=(),
                       image_name="demo", problem_statement="x is wrong")

    async def body():
        ws = LocalWorkspace(inst, tmp_path / "repos", mem_mb=512, cpu_s=20)
        await ws.start()
        try:
            quick = await ws.run("sleep 300 & setsid sleep 301 & echo started", timeout_s=30)
            hung = await ws.run("sleep 302", timeout_s=1)
            return quick, hung
        finally:
            await ws.close()

    quick, hung = asyncio.run(body())
    assert quick.ok and quick.stdout == "started\n" and hung.timed_out
    assert quick.duration_s < 15.0  # bash's exit ends the call: its children do not hold it to the timeout


def test_folders_of_a_process_killed_mid_call_are_swept(spawn, tmp_path):
    # A process SIGKILLed during a call cannot delete its call folder; the next process sweeps it.
    if spawn == "exec":
        pytest.skip("the sweep does not depend on the spawn path")
    import signal
    import subprocess
    import sys

    folder = tmp_path / "shared_tmp"
    folder.mkdir()
    program = ("import sys, tempfile\ntempfile.tempdir = sys.argv[1]\n"
               "from thundersync_verl.envs.sandbox import run_python\n"
               "run_python('import time\\nprint(1, flush=True)\\ntime.sleep(60)', timeout_s=60)")
    victim = subprocess.Popen([sys.executable, "-c", program, str(folder)], cwd=PROJECT)
    deadline = time.time() + 60
    while not list(folder.iterdir()) and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    left = list(folder.iterdir())
    assert [p.name.split("-")[2] for p in left] == [str(victim.pid)]  # the owner's pid names the folder
    alive = folder / f"{sandbox.WORKDIR_PREFIX}{os.getpid()}-x"
    alive.mkdir()
    assert sandbox.sweep_stale_workdirs(str(folder), min_age_s=600.0) == 0  # too recent: perhaps still in use
    sandbox.sweep_stale_workdirs.cache_clear()
    assert sandbox.sweep_stale_workdirs(str(folder), min_age_s=0.0) == 1
    assert list(folder.iterdir()) == [alive]  # a live owner's folder stays
    alive.rmdir()
    sandbox.sweep_stale_workdirs.cache_clear()
