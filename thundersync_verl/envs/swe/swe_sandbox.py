"""The SWE workspace: one repository per trajectory, behind one small interface, two backends.

Why:
1. The agent's tools and the verifier need five things from a workspace: start it, run a shell
   command with a timeout, read a file, write a file, close it. :class:`Workspace` is exactly that;
   ``swe.sandbox`` picks the implementation in ``backends.open_workspace`` (``local`` here, ``docker``
   in ``docker.py``), so tools, verifier and agent loop never know which one they drive.
2. ``local`` runs every command in the kernel sandbox (``envs/jail.py``): fresh mount, PID, network, IPC
   and UTS namespaces, a read-only root holding only the system and the trainer's interpreter, the
   repository read-write at ``/testbed`` (the docker images' path), a private size-capped ``/tmp`` (also
   ``$HOME``), an unprivileged uid of its own with no capabilities, and kernel limits (rlimits, and a
   cgroup for process count and memory where one can be made). The workspace's files live on a
   tmpfs of ``swe.local_disk_mb`` (``envs/jail_host.py``). When bash exits, the kernel kills every process
   it left. Commands find the trainer's interpreter first on PATH; pytest plugin auto-loading is off,
   since the trainer environment's plugins are not the repository's (and loading them costs seconds).
   Where the kernel sandbox cannot run, the older one (network and PID namespaces, rlimits, the trainer's
   user and filesystem) is used only when the run opts in with ``swe.allow_weak_sandbox``.
3. Start-up puts the repository in the instance's starting state (SWE-smith semantics, see
   ``instance.py``): ``base_commit`` checked out when given, else the bug ``patch`` applied to the clean
   copy; then the state is committed so ``git diff`` shows only the agent's own edits.
4. The file tools read and write through the host, so a path must resolve (symbolic links included)
   to a regular file inside the repository: a link the agent planted to the host is refused.
5. ``start()`` is a coroutine the agent loop launches when the trajectory starts and awaits at the
   first tool call, so copying a repository (or starting a container) overlaps the first generation.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from thundersync_verl.envs import forkserver, jail, jail_host
from thundersync_verl.envs import sandbox as base_sandbox
from thundersync_verl.envs.swe.instance import SWEInstance

logger = logging.getLogger(__name__)
COMMIT_ENV = "git -c user.name=thundersync -c user.email=swe@thundersync.invalid -c commit.gpgsign=false"
DEFAULT_OUTPUT_BYTES = 64 << 10


class WorkspaceError(RuntimeError):
    """A workspace operation that could not be done (the message is shown to the model or logged)."""


@dataclass(frozen=True)
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration_s: float
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def text(self) -> str:
        """stdout then stderr, as a terminal would show them."""
        return self.stdout + (("\n" if self.stdout and not self.stdout.endswith("\n") else "") + self.stderr
                              if self.stderr else "")


class Workspace(abc.ABC):
    """One trajectory's repository (point 1). Paths are relative to the repository root."""

    backend = "abstract"

    def __init__(self, instance: SWEInstance):
        self.instance = instance
        self.start_s: float | None = None  # how long start() took, once it has run

    async def start(self) -> None:
        t0 = time.perf_counter()
        await self._start()
        self.start_s = time.perf_counter() - t0

    @abc.abstractmethod
    async def _start(self) -> None: ...

    @abc.abstractmethod
    async def run(self, command: str, *, timeout_s: float, stdin: str | None = None,
                  max_output_bytes: int = DEFAULT_OUTPUT_BYTES) -> CommandResult: ...

    @abc.abstractmethod
    async def read_file(self, path: str) -> str: ...

    @abc.abstractmethod
    async def write_file(self, path: str, text: str) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def apply_patch(self, patch: str, *, reverse: bool = False, timeout_s: float = 60.0) -> None:
        """``git apply`` (``patch -p1`` as the fallback) of a diff given as text; raises if neither applies."""
        flag = " -R" if reverse else ""
        command = (f'f=$(mktemp) && cat > "$f" && {{ git apply{flag} "$f" || patch --batch -p1{flag} --fuzz=0 -i "$f"; }}; '
                   'rc=$?; rm -f "$f"; exit $rc')
        result = await self.run(command, timeout_s=timeout_s, stdin=patch)
        if not result.ok:
            raise WorkspaceError(f"patch did not apply{' in reverse' if reverse else ''}: {result.text()[-400:]}")

    async def prepare_repository(self, *, timeout_s: float = 120.0) -> None:
        """The instance's starting state, committed (point 3)."""
        inst = self.instance
        if inst.base_commit:
            result = await self.run(f"git checkout -q {shlex.quote(inst.base_commit)}", timeout_s=timeout_s)
            if not result.ok:
                raise WorkspaceError(f"git checkout {inst.base_commit} failed: {result.text()[-400:]}")
        else:
            await self.apply_patch(inst.patch, timeout_s=timeout_s)
        commit = (f"{{ [ -e .git ] || git init -q; }} && git add -A && "
                  f"{COMMIT_ENV} commit -q --allow-empty -m {shlex.quote(inst.instance_id)}")
        result = await self.run(commit, timeout_s=timeout_s)
        if not result.ok:
            raise WorkspaceError(f"committing the starting state failed: {result.text()[-400:]}")


async def communicate(proc, stdin: str | None, cap: int, timeout_s: float, t0: float) -> CommandResult:
    """The sandbox's capped read with its group kill at the deadline, and the same kill when cancelled
    (an aborted trajectory leaves no command running)."""
    try:
        out, err, timed_out = await base_sandbox._communicate(proc, stdin, cap, timeout_s)
    except asyncio.CancelledError:
        base_sandbox._kill_group(proc)
        with contextlib.suppress(BaseException):
            if proc.stdin is not None:
                proc.stdin.close()
            await proc.communicate()  # reaped and its pipes closed before the loop goes away
        raise
    return CommandResult(out.text(), err.text(), proc.returncode, timed_out, time.perf_counter() - t0,
                         out.truncated or err.truncated)


@functools.lru_cache(maxsize=1)
def pidns_prefix() -> tuple[str, ...]:
    """The sandbox's ``netns_prefix()`` plus a fresh PID namespace whose first process is the command, or the
    network prefix alone if the kernel refuses one.

    For sandboxes that must spawn processes (the SWE shell): when the command exits, the kernel
    kills every process left in its namespace, including daemons that left its process group.
    """
    unshare = shutil.which("unshare")
    base = base_sandbox.netns_prefix()
    if unshare is None:
        return base
    head = base or (unshare,)
    for extra in (("--pid", "--fork", "--kill-child", "--mount-proc"), ("--pid", "--fork", "--kill-child")):
        try:
            probe = subprocess.run([*head, *extra, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return (*head, *extra)
    return base


def relative_path(path: str) -> PurePosixPath:
    """A path inside the repository, normalised; refuses absolute paths and ``..`` escapes."""
    pure = PurePosixPath(path.strip())
    if not path.strip() or pure.is_absolute() or ".." in pure.parts:
        raise WorkspaceError(f"path {path!r} must be relative to the repository root and stay inside it")
    return pure


class LocalWorkspace(Workspace):
    """A copy of ``<repos_dir>/<repo>`` whose commands run in the kernel sandbox (point 2).

    ``isolation``: None picks the kernel sandbox, or the older one only where the kernel refuses and
    ``allow_weak`` (``swe.allow_weak_sandbox``) opts in; ``kernel`` requires it; ``weak`` forces the older one
    (benchmarks compare the two). ``disk_mb``: the workspace's tmpfs; ``tmp_mb``: each command's ``/tmp``;
    ``max_procs``: processes the workspace may hold at once; ``spawn``: ``fork`` or ``exec`` as for the
    python tool (None reads ``THUNDERSYNC_SANDBOX_SPAWN``, default ``fork``).
    """

    backend = "local"
    INSIDE = "/testbed"  # where the repository appears to the commands (the docker images' path)

    def __init__(self, instance: SWEInstance, repos_dir: str | Path, *, mem_mb: int = 2048, cpu_s: int = 300,
                 disk_mb: int = 1024, tmp_mb: int = 256, max_procs: int = 256, isolation: str | None = None,
                 allow_weak: bool | None = None, spawn: str | None = None):
        super().__init__(instance)
        self.spawn = spawn  # kernel sandbox: fork (from the sandbox's root server) or exec (a fresh interpreter)
        self.repos_dir = Path(repos_dir)
        self.mem_mb, self.cpu_s = int(mem_mb), int(cpu_s)
        self.disk_mb, self.tmp_mb, self.max_procs = int(disk_mb), int(tmp_mb), int(max_procs)
        self.isolation = jail.resolve(isolation, allow_weak, "the SWE shell (swe.sandbox=local)")
        self.root: Path | None = None  # the temporary folder: repo/ (and the jail's stage, or home/)
        self.uid, self.gid = jail.allocate_ids()
        self.cgroup: jail_host.Cgroup | None = None

    @property
    def repo_dir(self) -> Path:
        if self.root is None:
            raise WorkspaceError("the workspace is not started (or already closed)")
        return self.root / "repo"

    async def _start(self) -> None:
        source = repository_folder(self.repos_dir, self.instance)  # a missing one fails the start, not the row
        if self.isolation == "kernel":
            jail_host.sweep(tempfile.gettempdir())
            self.root = Path(tempfile.mkdtemp(prefix=f"{jail_host.PREFIX}{os.getpid()}-"))
            try:
                await asyncio.to_thread(self._fill_kernel_root, source)
            except OSError as exc:
                raise WorkspaceError(f"the workspace could not be prepared: {exc} (swe.local_disk_mb={self.disk_mb} "
                                     "must hold the repository)") from exc
        else:
            self.root = Path(tempfile.mkdtemp(prefix="tsv-swe-"))
            (self.root / "home").mkdir()
            await asyncio.to_thread(shutil.copytree, source, self.root / "repo", symlinks=True)
        await self.prepare_repository()

    def _fill_kernel_root(self, source: Path) -> None:
        """The tmpfs, the repository copy owned by the workspace's uid, the jail's stage, the cgroup."""
        jail_host.mount_tmpfs(str(self.root), self.disk_mb)
        (self.root / ".stage").mkdir(mode=0o700)
        shutil.copytree(source, self.root / "repo", symlinks=True)
        jail_host.chown_tree(str(self.root / "repo"), self.uid, self.gid)
        self.cgroup = jail_host.Cgroup.create(self.root.name, pids_max=self.max_procs, memory_bytes=self.mem_mb << 20)

    def _env(self) -> dict[str, str]:
        path = os.pathsep.join([os.path.dirname(sys.executable), base_sandbox._MINIMAL_PATH])
        home = "/tmp" if self.isolation == "kernel" else str(self.root / "home")
        return {"PATH": path, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONHASHSEED": "0", "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
                "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the trainer's plugins are not the repository's (5 s a run)

    def _limits(self) -> dict[str, tuple[int, int]]:
        limits = base_sandbox._rlimits(self.mem_mb, self.cpu_s)
        limits["RLIMIT_NOFILE"] = (1024, 1024)  # git and pytest open more files than a python tool call
        limits["RLIMIT_FSIZE"] = (64 << 20, 64 << 20)
        if self.isolation == "kernel":
            limits["RLIMIT_NPROC"] = (self.max_procs, self.max_procs)  # this workspace's own uid: only its processes
        return limits

    def _spec(self) -> jail.Spec:
        return jail.Spec(stage=str(self.root / ".stage"), cwd=self.INSIDE, rw=[(str(self.repo_dir), self.INSIDE)],
                         uid=self.uid, gid=self.gid, env=self._env(), rlimits=self._limits(), tmp_mb=self.tmp_mb,
                         cgroups=self.cgroup.procs if self.cgroup else [])

    async def run(self, command: str, *, timeout_s: float, stdin: str | None = None,
                  max_output_bytes: int = DEFAULT_OUTPUT_BYTES) -> CommandResult:
        if self.isolation == "kernel":
            server = base_sandbox.kernel_fork_server(self.spawn)
            if server is not None:  # a child of the pre-started root server: no interpreter start per command
                t0 = time.perf_counter()
                try:
                    code, out, err, timed_out = await base_sandbox._run_forked(
                        server, str(self.root), self.INSIDE, stdin, self._env(), {}, False, max_output_bytes, timeout_s,
                        self._spec().as_dict(), argv=["bash", "-c", command])
                    return CommandResult(out.text(), err.text(), code, timed_out, time.perf_counter() - t0,
                                         out.truncated or err.truncated)
                except forkserver.ForkServerError as exc:
                    logger.warning("%s; running this command through a fresh interpreter", exc)
            argv, program = jail.shell_command(self._spec(), ["bash", "-c", command])
        else:
            limit_prefix = base_sandbox._limit_prefix(self._limits()) if base_sandbox._prlimit() else ()
            argv, program = [*pidns_prefix(), *limit_prefix, "bash", "-c", command], None
        env = self._env()
        t0 = time.perf_counter()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, cwd=self.repo_dir, env=env, start_new_session=True, close_fds=True,
                pass_fds=() if program is None else (program,),
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except OSError as exc:
            raise WorkspaceError(f"could not start bash: {exc}") from exc
        finally:
            if program is not None:
                os.close(program)
        return await communicate(proc, stdin, max_output_bytes, timeout_s, t0)

    def _inside(self, path: str) -> Path:
        """``path`` in the repository with every link resolved; refused if that leaves it (point 4)."""
        repo = os.path.realpath(self.repo_dir)
        real = os.path.realpath(self.repo_dir / relative_path(path))
        if real != repo and not real.startswith(repo + os.sep):
            raise WorkspaceError(f"{path} resolves outside the repository (a symbolic link?); refused")
        return Path(real)

    async def read_file(self, path: str) -> str:
        target = self._inside(path)
        if not target.is_file():  # not a folder, fifo or device: the trainer must never block on a read
            reason = ("FileNotFoundError" if not target.exists() else
                      "IsADirectoryError" if target.is_dir() else "not a regular file")
            raise WorkspaceError(f"cannot read {path}: {reason}")
        try:
            return await asyncio.to_thread(target.read_text, encoding="utf-8", errors="replace")
        except OSError as exc:
            raise WorkspaceError(f"cannot read {path}: {exc.strerror or exc}") from None

    async def write_file(self, path: str, text: str) -> None:
        rel = relative_path(path)
        try:  # a workspace the agent filled, or any other refusal, is the agent's error, not the trainer's
            for depth in range(1, len(rel.parts)):  # every folder on the way must stay inside, as it is made
                folder = self._inside(str(PurePosixPath(*rel.parts[:depth])))
                if not folder.exists():
                    folder.mkdir()
                    self._own(folder)
                elif not folder.is_dir():
                    raise WorkspaceError(f"cannot write {path}: {folder.name} is not a folder")
            target = self._inside(path)
            if target.exists() and not target.is_file():
                raise WorkspaceError(f"cannot write {path}: " + ("it is a folder" if target.is_dir() else "not a regular file"))
            await asyncio.to_thread(target.write_text, text, encoding="utf-8")
            self._own(target)
        except OSError as exc:
            raise WorkspaceError(f"cannot write {path}: {exc.strerror or exc}") from None

    def _own(self, path: Path) -> None:
        """What the trainer wrote belongs to the workspace's uid, so the agent may change it later."""
        if self.isolation == "kernel":
            os.lchown(path, self.uid, self.gid)

    async def close(self) -> None:
        root, self.root = self.root, None
        if self.cgroup is not None:
            cgroup, self.cgroup = self.cgroup, None
            await asyncio.to_thread(cgroup.remove)
        if root is not None:
            await asyncio.to_thread(_remove_root, root)


def _remove_root(root: Path) -> None:
    if os.path.ismount(root):
        jail_host.unmount(str(root))
    shutil.rmtree(root, ignore_errors=True)


def repository_folder(repos_dir: Path, instance: SWEInstance) -> Path:
    """``<repos_dir>/<repo>``, else ``<repos_dir>/<image_name>``: the clean repository of an instance."""
    for name in (instance.repo, instance.image_name):
        if ".." in PurePosixPath(name).parts:
            continue
        folder = repos_dir / name
        if folder.is_dir():
            return folder
    raise WorkspaceError(
        f"no repository for instance {instance.instance_id}: neither {repos_dir / instance.repo} nor "
        f"{repos_dir / instance.image_name} is a folder (the local sandbox copies the clean repository from "
        "swe.repos_dir; use swe.sandbox=docker for image-based instances)")

