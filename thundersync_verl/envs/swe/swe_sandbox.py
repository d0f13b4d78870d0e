"""The SWE workspace: one repository per trajectory, behind one small interface, two backends.

Why:
1. The agent's tools and the verifier need five things from a workspace: start it, run a shell
   command with a timeout, read a file, write a file, close it. :class:`Workspace` is exactly that;
   ``swe.sandbox`` picks the implementation in ``backends.open_workspace`` (``local`` here, ``docker``
   in ``docker.py``), so tools, verifier and agent loop never know which one they drive.
2. ``local`` is this project's subprocess sandbox (``envs/sandbox.py``) around a temporary copy of the
   instance's clean repository (``<swe.repos_dir>/<repo>``): every command runs as ``bash -c`` in a
   fresh network namespace when the kernel allows one, under the same kernel limits (``prlimit``),
   with a minimal environment, in its own process group that the timeout kills whole, and with
   capped output. Unlike the python tool it must spawn processes (git, pytest), so the
   in-interpreter spawn guard is not installed; the namespace keeps it off the network. Where the
   kernel allows, ``bash`` is the first process of a fresh PID namespace (``pidns_prefix``): when it
   exits, every process it left behind is killed, even one that left its process group. Commands
   find the trainer's interpreter first on PATH; pytest plugin auto-loading is off, since the
   trainer environment's plugins are not the repository's (and loading them costs seconds a run).
3. Start-up puts the repository in the instance's starting state (SWE-smith semantics, see
   ``instance.py``): ``base_commit`` checked out when given, else the bug ``patch`` applied to the clean
   copy; then the state is committed so ``git diff`` shows only the agent's own edits.
4. ``start()`` is a coroutine the agent loop launches when the trajectory starts and awaits at the
   first tool call, so copying a repository (or starting a container) overlaps the first generation.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from thundersync_verl.envs import sandbox as base_sandbox
from thundersync_verl.envs.swe.instance import SWEInstance

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
    """A temporary copy of ``<repos_dir>/<repo>`` driven through the project's subprocess sandbox (point 2)."""

    backend = "local"

    def __init__(self, instance: SWEInstance, repos_dir: str | Path, *, mem_mb: int = 2048, cpu_s: int = 300):
        super().__init__(instance)
        self.repos_dir = Path(repos_dir)
        self.mem_mb, self.cpu_s = int(mem_mb), int(cpu_s)
        self.root: Path | None = None  # the temporary folder: repo/ and home/

    @property
    def repo_dir(self) -> Path:
        if self.root is None:
            raise WorkspaceError("the workspace is not started (or already closed)")
        return self.root / "repo"

    async def _start(self) -> None:
        source = repository_folder(self.repos_dir, self.instance)  # a missing one fails the start, not the row
        self.root = Path(tempfile.mkdtemp(prefix="tsv-swe-"))
        (self.root / "home").mkdir()
        await asyncio.to_thread(shutil.copytree, source, self.root / "repo", symlinks=True)
        await self.prepare_repository()

    def _env(self) -> dict[str, str]:
        path = os.pathsep.join([os.path.dirname(sys.executable), base_sandbox._MINIMAL_PATH])
        home = str(self.root / "home")
        return {"PATH": path, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONHASHSEED": "0", "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
                "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the trainer's plugins are not the repository's (5 s a run)

    async def run(self, command: str, *, timeout_s: float, stdin: str | None = None,
                  max_output_bytes: int = DEFAULT_OUTPUT_BYTES) -> CommandResult:
        limits = base_sandbox._rlimits(self.mem_mb, self.cpu_s)
        limits["RLIMIT_NOFILE"] = (1024, 1024)  # git and pytest open more files than a python tool call
        limits["RLIMIT_FSIZE"] = (64 << 20, 64 << 20)
        limit_prefix = base_sandbox._limit_prefix(limits) if base_sandbox._prlimit() else ()
        argv = [*pidns_prefix(), *limit_prefix, "bash", "-c", command]
        t0 = time.perf_counter()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, cwd=self.repo_dir, env=self._env(), start_new_session=True, close_fds=True,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except OSError as exc:
            raise WorkspaceError(f"could not start bash: {exc}") from exc
        return await communicate(proc, stdin, max_output_bytes, timeout_s, t0)

    async def read_file(self, path: str) -> str:
        target = self.repo_dir / relative_path(path)
        try:
            return await asyncio.to_thread(target.read_text, encoding="utf-8", errors="replace")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise WorkspaceError(f"cannot read {path}: {type(exc).__name__}") from None

    async def write_file(self, path: str, text: str) -> None:
        target = self.repo_dir / relative_path(path)
        if target.is_dir():
            raise WorkspaceError(f"cannot write {path}: it is a folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(target.write_text, text, encoding="utf-8")

    async def close(self) -> None:
        root, self.root = self.root, None
        if root is not None:
            await asyncio.to_thread(shutil.rmtree, root, True)


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

