"""Run untrusted model-written Python in a real, isolated, resource-limited subprocess.

Why it is built this way:
1. Tool latency is what streaming training hides, so the tool must be a real process with real
   failure modes (hangs, memory blow-ups, floods of output), not an ``eval`` in the trainer's process.
2. Two independent barriers: the kernel sandbox (point 8) and an audit hook installed by a tiny
   bootstrap before user code runs (``sandbox_guard.py``). The hook alone is not a security boundary
   (native code can bypass it); it refuses early, with a clear error, what the kernel also stops.
3. Limits live in the kernel (``setrlimit`` in the child); the wall-clock timeout kills the call's
   whole process group, so grandchildren cannot outlive the call.
4. Output is read incrementally and capped, so a program that prints gigabytes costs us a
   bounded buffer; the rest is drained and dropped so the child never blocks on a full pipe.
5. One async implementation (:func:`run_python_async`) lets hundreds of tool calls wait
   concurrently in one event loop; :func:`run_python` is the same code behind a private loop.
   ``extra_latency_s`` models slow remote sandboxes by sleeping in the parent, asynchronously.
6. Each call is a child forked from a small pre-started sandbox interpreter (:mod:`forkserver`: no
   interpreter start per call, whose CPU the rollout and learner cores need). ``spawn="exec"`` (or
   ``THUNDERSYNC_SANDBOX_SPAWN=exec``) starts a fresh interpreter per call instead; the fork path
   falls back to it, call by call, if its server cannot start or dies.
7. What the python tool's sandbox guarantees (``tests/envs/test_sandbox_escape_on_cpu.py`` tries
   each escape, on both spawn paths; ``tests/envs/test_kernel_sandbox_on_cpu.py`` the kernel alone):
   - the kernel boundary (point 8): the call sees a read-only root holding only the system and the
     interpreter, its own folder read-write at ``/workspace``, a 16 MiB ``/tmp``; fresh mount, PID,
     network, IPC and UTS namespaces; an unprivileged uid of its own, no capabilities, no-new-privileges;
   - and, inside it, the guard: sockets other than AF_UNIX, connects, binds, name lookups, fork, exec,
     spawn, ``subprocess``, ctypes, raw memory, gc walks and signals to other processes are refused;
     writes only inside the call's folder, reads only there and in Python's own library;
   - bounded resources: address space (``MemoryError``), CPU seconds, 64 open files, 1 MiB per
     written file, 32 processes (its own uid's), no core dumps, the wall-clock timeout, and
     ``max_output_bytes`` kept per stream however much is printed;
   - clean-up: the call's folder is deleted; every process of the call dies with it (its PID namespace;
     the process group on the weaker path); a killed process's folder is swept by the next one's call;
   - every violation is a ``SandboxResult`` with ``error`` set (``denied``, ``memory_limit``, ``timeout``...):
     an ``error: ...`` tool turn, never an exception.
   Not guaranteed: file metadata inside the read-only root is visible; CPU time is limited per process,
   not shared between calls; the kernel itself (a kernel bug) is trusted.
8. Isolation (``isolation`` / ``allow_weak``, :func:`jail.resolve`): the kernel sandbox wherever it runs
   (root, namespaces allowed); elsewhere the call fails with a rule/why/fix error unless the run opts in
   to the weaker sandbox (``THUNDERSYNC_SANDBOX_ALLOW_WEAK=1``): the guard, a network namespace where
   ``unshare --net`` works, rlimits, the trainer's user and filesystem.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from thundersync_verl.envs import forkserver, jail
from thundersync_verl.envs.jail import JAIL_SOURCE
from thundersync_verl.envs.sandbox_guard import GUARD_SOURCE

# Executed with ``python -I -S -c``: enters the kernel sandbox (a spec in argv[2], inside ``unshare``), installs
# the guard, then runs ``main.py`` from the cwd.
_BOOTSTRAP = GUARD_SOURCE + JAIL_SOURCE + r"""
import os, sys
if len(sys.argv) > 2:
    import marshal
    _spec = marshal.loads(bytes.fromhex(sys.argv[2]))
    _jail_start(_spec, _spec["parent"])
    del _spec
if sys.argv[1] == "guard":
    _install_guard(os.getcwd())
del _install_guard
with open("main.py", encoding="utf-8") as _f:
    _src = _f.read()
_globals = {"__name__": "__main__", "__builtins__": __builtins__}  # user code sees none of ours
exec(compile(_src, "main.py", "exec"), _globals)
"""

_MINIMAL_PATH = "/usr/local/bin:/usr/bin:/bin"
T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run. ``error`` is None on success, else a short reason code:
    ``timeout``, ``memory_limit``, ``cpu_limit``, ``denied`` (network or process spawn),
    ``killed``, ``nonzero_exit`` or ``spawn_failed``."""

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    truncated: bool
    duration_s: float
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


class _CappedBuffer:
    """Keeps ``cap`` bytes of a stream (the head, or the tail where the error line of a
    traceback lives) and remembers whether more arrived."""

    def __init__(self, cap: int, keep_tail: bool = False) -> None:
        self.cap = cap
        self.keep_tail = keep_tail
        self.data = bytearray()
        self.truncated = False

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self.data += chunk
            if len(self.data) > self.cap:
                self.truncated = True
                self.data = self.data[-self.cap :] if self.keep_tail else self.data[: self.cap]

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=1)
def netns_prefix() -> tuple[str, ...]:
    """The command prefix that gives a child an empty network namespace, or () if impossible.

    Probed once per process: plain ``unshare --net`` works as root; ``--map-root-user`` adds an
    unprivileged user namespace where the kernel allows it.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for prefix in ((unshare, "--net"), (unshare, "--map-root-user", "--net")):
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return prefix
    return ()


@functools.lru_cache(maxsize=1)
def _prlimit() -> str | None:
    return shutil.which("prlimit")


def _rlimits(mem_mb: int, cpu_s: int) -> dict[str, tuple[int, int]]:
    """Every sandbox's kernel limits, ``{RLIMIT_name: (soft, hard)}``, whichever way the call starts."""
    mem = mem_mb << 20
    return {"RLIMIT_AS": (mem, mem), "RLIMIT_CPU": (cpu_s, cpu_s + 1), "RLIMIT_NOFILE": (64, 64),
            "RLIMIT_FSIZE": (1 << 20, 1 << 20), "RLIMIT_CORE": (0, 0)}


_PRLIMIT_FLAGS = {"RLIMIT_AS": "--as", "RLIMIT_CPU": "--cpu", "RLIMIT_NOFILE": "--nofile", "RLIMIT_FSIZE": "--fsize",
                  "RLIMIT_CORE": "--core"}


def _limit_prefix(limits: dict[str, tuple[int, int]]) -> tuple[str, ...]:
    """``prlimit`` sets the limits on itself and execs the sandbox: no Python code between fork and exec.

    That matters for throughput: with a ``preexec_fn`` CPython must fork() the whole parent (page
    tables of a multi-GB trainer process) and waits for the exec, blocking the agent loop's event
    loop ~30 ms per tool call; without one it uses vfork/posix_spawn (measured: 32 concurrent
    calls from a 0.4 GB process block the loop 0.92 s with preexec_fn, 0.13 s with prlimit).
    """
    flags = tuple(f"{_PRLIMIT_FLAGS[name]}={soft}:{hard}" for name, (soft, hard) in limits.items())
    return (_prlimit(), *flags, "--")


def _set_limits(limits: dict[str, tuple[int, int]]) -> None:
    """Fallback without ``prlimit``: runs in the child between fork and exec (the same limits)."""
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), value)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session made pid the group id
    except (ProcessLookupError, PermissionError):
        pass


def _classify(returncode: int | None, timed_out: bool, stderr: str) -> str | None:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return None
    if "MemoryError" in stderr:
        return "memory_limit"
    if "PermissionError: sandbox:" in stderr:
        return "denied"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL) and not stderr:
        return "cpu_limit" if returncode == -signal.SIGXCPU else "killed"
    return "nonzero_exit"


async def run_python_async(
    code: str,
    *,
    timeout_s: float = 5.0,
    mem_mb: int = 256,
    cpu_s: int = 5,
    max_output_bytes: int = 512,
    extra_latency_s: float = 0.0,
    stdin: str | None = None,
    isolate_network: bool | None = None,
    guard_network: bool = True,
    spawn: str | None = None,
    isolation: str | None = None,
    allow_weak: bool | None = None,
) -> SandboxResult:
    """Run ``code`` in an isolated interpreter and return what it printed.

    ``isolation`` / ``allow_weak``: the kernel sandbox or the weaker one (:func:`jail.resolve`; point 8).
    ``isolate_network``: None uses a network namespace when available, True requires one,
    False skips it (and with it the kernel sandbox: tests only). ``guard_network`` installs the
    in-interpreter audit hook (keep it on; tests switch it off to check the kernel barriers alone).
    ``spawn``: ``fork`` (a child of this process's pre-started sandbox server, :mod:`forkserver`) or
    ``exec`` (a fresh interpreter per call); None reads ``THUNDERSYNC_SANDBOX_SPAWN`` (default ``fork``).
    """
    kernel = isolate_network is not False and jail.resolve(isolation, allow_weak, "the python tool") == "kernel"
    prefix = () if kernel else _resolve_netns(isolate_network)
    server = _fork_server(prefix, spawn, kernel)
    env = {"PATH": _MINIMAL_PATH, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"}
    limits = _rlimits(mem_mb, cpu_s)
    start = time.perf_counter()
    sweep_stale_workdirs(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-") as calldir:
        workdir, spec = _call_folder(calldir, code, kernel, env, limits)
        inside = spec.cwd if spec is not None else workdir
        env["HOME"] = env["TMPDIR"] = inside
        outcome = None
        if server is not None:
            try:
                outcome = await _run_forked(server, workdir, inside, stdin, env, limits, guard_network,
                                            max_output_bytes, timeout_s, None if spec is None else spec.as_dict())
            except forkserver.ForkServerError as exc:
                logger.warning("%s; running this call in a fresh interpreter", exc)
        if outcome is None:
            outcome = await _run_spawned(prefix, workdir, stdin, env, mem_mb, cpu_s, guard_network, max_output_bytes,
                                         timeout_s, spec)
    if isinstance(outcome, SandboxResult):  # the spawn itself failed
        return outcome
    returncode, out, err, timed_out = outcome
    if extra_latency_s > 0:
        await asyncio.sleep(extra_latency_s)
    stderr = err.text()
    return SandboxResult(
        stdout=out.text(),
        stderr=stderr,
        returncode=returncode,
        timed_out=timed_out,
        truncated=out.truncated or err.truncated,
        duration_s=time.perf_counter() - start,
        error=_classify(returncode, timed_out, stderr),
    )


JAIL_WORKDIR = "/workspace"  # where a kernel-sandboxed call's folder appears to it
JAIL_TMP_MB = 16
JAIL_NPROC = 32  # the call's own uid: only its processes count (the guard refuses new ones anyway)


def _call_folder(calldir: str, code: str, kernel: bool, env: dict, limits: dict) -> tuple[str, "jail.Spec | None"]:
    """Write ``main.py``; with the kernel sandbox, in ``work/`` owned by the call's uid, beside the jail's stage."""
    if not kernel:
        with open(os.path.join(calldir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        return calldir, None
    uid, gid = jail.allocate_ids()
    workdir, stage = os.path.join(calldir, "work"), os.path.join(calldir, "stage")
    os.mkdir(workdir, 0o755)
    os.mkdir(stage, 0o700)
    with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
        f.write(code)
    for path in (workdir, os.path.join(workdir, "main.py")):
        os.chown(path, uid, gid)
    spec = jail.Spec(stage=stage, cwd=JAIL_WORKDIR, rw=[(workdir, JAIL_WORKDIR)], uid=uid, gid=gid, env=env,
                     rlimits={**limits, "RLIMIT_NPROC": (JAIL_NPROC, JAIL_NPROC)}, tmp_mb=JAIL_TMP_MB)
    return workdir, spec


WORKDIR_PREFIX = "tsv-sandbox-"  # + the owning process's pid + "-": a folder whose owner died is swept


@functools.lru_cache(maxsize=None)
def sweep_stale_workdirs(folder: str, min_age_s: float = 600.0) -> int:
    """Remove the call folders under ``folder`` left by a process killed mid-call (its pid is gone and
    the folder is older than ``min_age_s``); once per process and folder. Returns how many went."""
    removed, now = 0, time.time()
    try:
        names = [n for n in os.listdir(folder) if n.startswith(WORKDIR_PREFIX)]
    except OSError:
        return 0
    for name in names:
        pid = name[len(WORKDIR_PREFIX):].split("-", 1)[0]
        path = os.path.join(folder, name)
        try:
            if not pid.isdigit() or now - os.stat(path).st_mtime < min_age_s:
                continue
            os.kill(int(pid), 0)
            continue  # its owner is alive
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        except OSError:
            continue
    return removed


_fork_failure_logged = False


def _fork_server(prefix: tuple[str, ...], spawn: str | None, kernel: bool = False) -> forkserver.ForkServer | None:
    """This process's fork server, or None for ``exec`` (or if it cannot start: logged once).

    ``kernel``: the server whose children enter the kernel sandbox (it runs as root, in no namespace of its own)."""
    global _fork_failure_logged
    spawn = spawn or os.environ.get("THUNDERSYNC_SANDBOX_SPAWN", "fork")
    if spawn not in ("fork", "exec"):
        raise ValueError(f"sandbox spawn must be 'fork' or 'exec', got {spawn!r} (argument or THUNDERSYNC_SANDBOX_SPAWN)")
    if spawn == "exec":
        return None
    try:
        return forkserver.shared(prefix, GUARD_SOURCE, kernel=kernel)
    except forkserver.ForkServerError as exc:
        if not _fork_failure_logged:
            logger.warning("%s; sandbox calls start a fresh interpreter each", exc)
            _fork_failure_logged = True
        return None


def default_fork_server() -> forkserver.ForkServer | None:
    """The fork server a call with default arguments uses in this process (started if needed)."""
    kernel = jail.resolve(None, None, "the python tool") == "kernel"
    return _fork_server(() if kernel else _resolve_netns(None), "fork", kernel)


def kernel_fork_server(spawn: str | None = None) -> forkserver.ForkServer | None:
    """The fork server whose children enter the kernel sandbox, also for commands (the SWE shell), or None
    for ``exec`` (``spawn`` or ``THUNDERSYNC_SANDBOX_SPAWN``) or when it cannot start."""
    return _fork_server((), spawn, True)


async def _run_forked(server, workdir, inside, stdin, env, limits, guard, cap, timeout_s, jail_spec, argv=None):
    """One call through the fork server: our pipes become the child's stdout/stderr. A cancelled call is killed."""
    loop = asyncio.get_running_loop()
    if stdin is not None:  # an in-memory file: not in the call's folder, and no disk a full workspace lacks
        in_fd = os.memfd_create("tsv-stdin")
        os.write(in_fd, stdin.encode("utf-8"))
        os.lseek(in_fd, 0, os.SEEK_SET)
    else:
        in_fd = os.open(os.devnull, os.O_RDONLY)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        rid, exit_future = server.submit(inside, (in_fd, out_w, err_w), limits=limits, env=env, guard=guard,
                                         jail=jail_spec, argv=argv)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        for fd in (in_fd, out_w, err_w):
            os.close(fd)
    out, err = _CappedBuffer(cap), _CappedBuffer(cap, keep_tail=True)
    transports = []
    try:
        readers = []
        for fd in (out_r, err_r):
            reader = asyncio.StreamReader()
            transport, _ = await loop.connect_read_pipe(lambda r=reader: asyncio.StreamReaderProtocol(r), os.fdopen(fd, "rb", 0))
            transports.append(transport)
            readers.append(reader)
        exit_code = asyncio.wrap_future(exit_future)
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.gather(out.drain(readers[0]), err.drain(readers[1]), asyncio.shield(exit_code)), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            server.kill(rid)
        returncode = await exit_code
    except asyncio.CancelledError:
        server.kill(rid)  # an aborted trajectory leaves nothing running
        raise
    finally:
        for transport in transports:
            transport.close()
    return returncode, out, err, timed_out


async def _run_spawned(prefix, workdir, stdin, env, mem_mb, cpu_s, guard, cap, timeout_s, spec=None):
    """One call in a fresh interpreter (the jail, ``prlimit`` or a ``preexec_fn`` sets the limits)."""
    mode = "guard" if guard else "open"
    if spec is not None:  # the kernel sandbox: the bootstrap makes the jail and runs the code inside it
        cmd = [sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, mode, spec.encode()]
        limits = None
    elif _prlimit() is not None:
        cmd = [*_limit_prefix(_rlimits(mem_mb, cpu_s)), *prefix, sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, mode]
        limits = None
    else:
        cmd = [*prefix, sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, mode]
        limits = functools.partial(_set_limits, _rlimits(mem_mb, cpu_s))
    start = time.perf_counter()
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=workdir,
            env=env,
            preexec_fn=limits,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as exc:
        elapsed = time.perf_counter() - start
        return SandboxResult("", f"{type(exc).__name__}: {exc}", None, False, False, elapsed, "spawn_failed")
    out, err, timed_out = await _communicate(proc, stdin, cap, timeout_s)
    return proc.returncode, out, err, timed_out


async def _communicate(
    proc: asyncio.subprocess.Process, stdin: str | None, cap: int, timeout_s: float
) -> tuple[_CappedBuffer, _CappedBuffer, bool]:
    """Feed stdin, drain both pipes with a cap, wait for exit; kill the group at the deadline."""
    out, err = _CappedBuffer(cap), _CappedBuffer(cap, keep_tail=True)

    async def feed() -> None:
        if stdin is None or proc.stdin is None:
            return
        try:
            proc.stdin.write(stdin.encode("utf-8"))
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the program exited without reading its input

    async def wait_then_kill_group() -> None:
        # proc.wait() also waits for the pipes to close: a child left behind would hold them (and
        # the call) open until the timeout. Once the process itself has exited, kill its group.
        waiter = asyncio.ensure_future(proc.wait())
        while not waiter.done():
            if proc.returncode is not None:
                _kill_group(proc)
            await asyncio.wait({waiter}, timeout=0.05)
        _kill_group(proc)  # also a child that closed its pipes

    assert proc.stdout is not None and proc.stderr is not None
    work = asyncio.gather(feed(), out.drain(proc.stdout), err.drain(proc.stderr), wait_then_kill_group())
    timed_out = False
    try:
        await asyncio.wait_for(work, timeout_s)
    except asyncio.TimeoutError:
        # Kill the whole group: a child the program left behind would keep the pipes open. Then read
        # the pipes to their end: proc.wait() waits for them, and a full, unread one never ends.
        timed_out = True
        _kill_group(proc)
        try:
            await asyncio.wait_for(asyncio.gather(out.drain(proc.stdout), err.drain(proc.stderr), proc.wait()), 5.0)
        except asyncio.TimeoutError:
            logger.warning("sandbox: pipes still open 5 s after the kill (held outside the process group)")
    return out, err, timed_out


def _resolve_netns(isolate_network: bool | None) -> tuple[str, ...]:
    if isolate_network is False:
        return ()
    prefix = netns_prefix()
    if isolate_network and not prefix:
        raise RuntimeError("isolate_network=True needs a Linux network namespace, but `unshare --net` failed here: "
                           "the sandbox must not reach the network. Run as root, enable unprivileged user namespaces "
                           "(kernel.unprivileged_userns_clone=1), or pass isolate_network=None (the guard alone).")
    return prefix


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion and return its result; safe to call from any thread,
    including one that already runs an event loop (it then uses a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def run_python(code: str, **kwargs) -> SandboxResult:
    """Blocking :func:`run_python_async` (same arguments), through :func:`run_blocking`."""
    return run_blocking(run_python_async(code, **kwargs))
