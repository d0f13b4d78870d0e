"""A pre-started sandbox interpreter that forks one isolated child per call.

Why:
1. A fresh ``python -I -S`` costs ~10 ms of CPU per call (interpreter start, exec, tear-down);
   an agentic step makes hundreds of tool and verifier calls, so on a small machine the
   interpreter starts alone take the cores the rollout and the learner need. A fork of a small,
   idle interpreter costs well under a millisecond of it.
2. The isolation is the one of a spawned sandbox: every call is its own process, in its own
   session (the timeout kills the whole group). With the kernel sandbox (``envs/jail.py``) the
   server runs as root and each child makes the call's fresh namespaces, in which an init (PID 1,
   so everything the call starts dies with it) and the call's process are forked, the root built
   and the call's uid taken before user code runs; the child waits and ends the way the call ended.
   Otherwise the child sets the limits itself and the network is denied by the namespace the server
   was started in. The python tool's audit hook is installed before user code runs; a child may
   instead exec a command (the SWE shell). The server itself never runs user code, so one call
   cannot leave state for the next.
5. Nothing a call started outlives it: when the call's process exits, the server kills its
   process group while the exited process is still an unreaped zombie (so the group id cannot
   have been reused), and, being the children's subreaper, it kills every process reparented to
   it (a daemon that left the group with ``setsid``) before it reports the exit.
3. The caller's process holds only a socket: requests carry the child's stdin/stdout/stderr as
   file descriptors (``SCM_RIGHTS``), so output is read with the same capped buffers as a
   spawned sandbox; replies (pid, exit status) come back on the socket and are picked up by one
   reader thread, so any thread or event loop may call.
4. If the server cannot start or dies, the error says so; :mod:`sandbox` then spawns per call.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import socket
import subprocess
import sys
import threading

# Run by ``python -I -S -B /dev/fd/N`` after the sandbox's guard and jail sources (``_install_guard``, ``_jail_*``):
# serves fork requests on the socket whose fd is argv[1] until it closes.
SERVER = r"""
import ctypes, json, os, resource, signal, socket, select, sys, traceback
sock = socket.socket(fileno=int(sys.argv[1]))
prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before any guard: children die with the server
live = {}
def child(req, fds):
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != server_pid:
        os._exit(1)
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, 1 << 16)
    spec = req.get("jail")
    if spec is not None:  # the kernel sandbox: this process relays; below an init, the call runs in the jail
        _jail_start(spec)
    os.chdir(req["dir"])
    for name, value in ({} if spec is not None else req["limits"]).items():
        resource.setrlimit(getattr(resource, name), (value[0], value[1]))
    if req.get("argv"):  # a command (the SWE shell), not Python: it replaces this process
        try:
            os.execvpe(req["argv"][0], req["argv"], req["env"])
        except OSError as exc:
            os.write(2, ("sandbox: %s: %s\n" % (req["argv"][0], exc.strerror)).encode())
            os._exit(127)
    os.environ.clear()
    os.environ.update(req["env"])
    code = 0
    try:
        import types
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        if req["guard"]:
            _install_guard(req["dir"])
        with open("main.py", encoding="utf-8") as f:
            src = f.read()
        exec(compile(src, "main.py", "exec"), main.__dict__)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:
            code = code or 1
    os._exit(code)
def reap():
    while True:
        try:  # WNOWAIT: the exited child stays a zombie, so its group id cannot be reused yet
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        rid = live.pop(info.si_pid, None)
        if rid is not None:
            try:
                os.killpg(info.si_pid, signal.SIGKILL)  # whatever the call left in its group
            except OSError:
                pass
        _, status = os.waitpid(info.si_pid, 0)
        if rid is not None:
            kill_orphans()
            sock.send(json.dumps({"id": rid, "exit": os.waitstatus_to_exitcode(status)}).encode())
def kill_orphans():
    # We are the subreaper: a process whose parent exited (a daemon that left its call's group
    # with setsid) is now our child. Every child of ours that is not a running call is one. Each
    # is killed and reaped before we look again: its own children are reparented to us when it dies.
    for _ in range(100):
        try:
            with open("/proc/self/task/%d/children" % server_pid) as f:
                children = [int(p) for p in f.read().split()]
        except OSError:
            children = [int(p) for p in os.listdir("/proc") if p.isdigit() and parent_of(p) == server_pid]
        orphans = [pid for pid in children if pid not in live]
        if not orphans:
            return
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
def parent_of(pid):
    try:
        with open("/proc/%s/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
server_pid = os.getpid()
prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of the calls are reparented to us, not to init
rd, wr = os.pipe()
os.set_blocking(wr, False)
signal.set_wakeup_fd(wr)
signal.signal(signal.SIGCHLD, lambda *a: None)
try:
    while True:
        ready, _, _ = select.select([sock, rd], [], [])
        if rd in ready:
            os.read(rd, 4096)
        if sock in ready:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
            if not msg:
                break
            req = json.loads(msg)
            if "kill" in req:
                for pid, rid in list(live.items()):
                    if rid == req["kill"]:
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except OSError:  # not yet its own group leader
                            os.kill(pid, signal.SIGKILL)
                kill_orphans()
                continue
            pid = os.fork()
            if pid == 0:
                try:
                    child(req, fds)
                except BaseException:  # a failed setup (a jail that could not be built): never a second server
                    traceback.print_exc()
                finally:
                    os._exit(125)
            for fd in fds:
                os.close(fd)
            live[pid] = req["id"]
        reap()
finally:
    for pid in live:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    live.clear()
    kill_orphans()
"""


class ForkServerError(RuntimeError):
    """The fork server could not start, or stopped answering."""


class ForkServer:
    """One server process per client process; :meth:`submit` is thread-safe."""

    def __init__(self, prefix: tuple[str, ...], guard_source: str) -> None:
        from thundersync_verl.envs.jail import JAIL_SOURCE, program_file

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        program = program_file(guard_source + "\n" + JAIL_SOURCE + "\n" + SERVER)  # not on the command line: ps shows it
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"}
        try:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-I", "-S", "-B", f"/dev/fd/{program}", str(theirs.fileno())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(), program), env=env, start_new_session=True,
            )
        except OSError as exc:
            raise ForkServerError(f"the sandbox fork server could not start: {exc}") from exc
        finally:
            theirs.close()
            os.close(program)
        self.sock = ours
        self.pid = os.getpid()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._waiters: dict[int, concurrent.futures.Future] = {}
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read, name="sandbox-forkserver", daemon=True)
        self._reader.start()

    def submit(self, workdir: str, fds: tuple[int, int, int], *, limits: dict[str, tuple[int, int]],
               env: dict[str, str], guard: bool, jail: dict | None = None,
               argv: list[str] | None = None) -> tuple[int, concurrent.futures.Future]:
        """Fork one child running ``workdir/main.py`` with ``fds`` as its stdin, stdout, stderr.

        Returns the request id and a future of the child's exit code (negative: the signal
        that ended it, as ``subprocess`` reports it). ``limits``: ``{"RLIMIT_AS": (soft, hard)}``...
        ``jail``: a kernel-sandbox spec (``jail.Spec.as_dict``; ``workdir`` is then the path inside it).
        ``argv``: exec this command in ``workdir`` instead of running ``main.py``.
        """
        rid = next(self._ids)
        waiter: concurrent.futures.Future = concurrent.futures.Future()
        request = json.dumps({"id": rid, "dir": workdir, "limits": limits, "env": env, "guard": guard,
                              "jail": jail, "argv": argv}).encode()
        with self._lock:
            if self._dead is not None:
                raise ForkServerError(self._dead)
            self._waiters[rid] = waiter
            try:
                socket.send_fds(self.sock, [request], list(fds))
            except OSError as exc:
                self._waiters.pop(rid, None)
                raise ForkServerError(f"the sandbox fork server stopped answering: {exc}") from exc
        return rid, waiter

    def kill(self, rid: int) -> None:
        """SIGKILL the process group of request ``rid`` (the server does it: no pid-reuse race)."""
        with self._lock:
            if self._dead is None:
                try:
                    self.sock.send(json.dumps({"kill": rid}).encode())
                except OSError:
                    pass

    @property
    def alive(self) -> bool:
        return self._dead is None and self.proc.poll() is None

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(1 << 16)
            except OSError:
                msg = b""
            if not msg:
                break
            reply = json.loads(msg)
            with self._lock:
                waiter = self._waiters.pop(reply["id"], None)
            if waiter is not None:
                try:
                    waiter.set_result(reply["exit"])
                except concurrent.futures.InvalidStateError:
                    pass  # the caller stopped waiting
        stderr = b""
        try:
            self.proc.wait(timeout=5)
            stderr = self.proc.stderr.read() if self.proc.stderr else b""
        except (subprocess.TimeoutExpired, OSError):
            pass
        reason = (f"the sandbox fork server exited (code {self.proc.returncode}): "
                  f"{stderr.decode('utf-8', 'replace').strip()[-400:] or 'no error output'}")
        with self._lock:
            self._dead = reason
            waiters, self._waiters = list(self._waiters.values()), {}
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(ForkServerError(reason))

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_servers: dict[tuple, ForkServer] = {}
_servers_lock = threading.Lock()


def shared(prefix: tuple[str, ...], guard_source: str, *, kernel: bool = False) -> ForkServer:
    """This process's server for ``prefix`` (started on first use, restarted if it died); ``kernel``: the one
    whose children enter the kernel sandbox (kept apart from a weaker one the same process may also use)."""
    key = (os.getpid(), prefix, kernel)
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive:
            server = _servers[key] = ForkServer(prefix, guard_source)
        return server
