"""The ``docker`` SWE workspace: one container per trajectory, driven through the docker CLI.

Why:
1. On a cluster every SWE-smith instance names its environment image (``image_name``: the repository
   at its clean commit, dependencies installed, at ``/testbed``). One container per trajectory keeps
   trajectories from seeing each other's edits and lets a crashed one be removed whole.
2. The CLI (not the SDK) keeps this package free of another dependency and makes every call an argv
   that tests can check without a daemon: :func:`run_argv`, :func:`exec_argv`, :func:`remove_argv`.
3. Limits are docker's: ``--cpus``, ``--memory`` (no swap beyond it), ``--pids-limit``, ``--ulimit nofile``,
   and ``--network none`` unless ``swe.docker.network`` says otherwise. Every command runs under
   ``timeout -s KILL`` inside the container (killing the CLI alone would leave the process running there),
   with an outer deadline on the CLI call itself.
4. Cleanup on abort: ``close()`` removes the container (``docker rm -f``) and its workspace volume; the agent
   loop calls it in a ``finally``, cancellation included, and containers still alive when the process exits
   are removed by an ``atexit`` hook. Containers and volumes carry the label ``thundersync.swe=1`` so an
   operator can find strays after a hard kill (``docker ps -a --filter label=thundersync.swe=1``).
5. The same boundary as the local kernel sandbox (``docs/sandbox.md``): the agent's container runs as an
   unprivileged uid (``swe.docker.user``, never 0) with every capability dropped (``--cap-drop ALL``) and
   ``no-new-privileges``, on a read-only root with a size-capped ``/tmp`` (also ``$HOME``). The repository
   lives on a volume of its own, mounted read-write at ``swe.docker.workdir``: a short-lived preparing
   container (its only capabilities CHOWN, DAC_OVERRIDE and FOWNER, no network) fills the volume, from the
   image's own folder (docker copies it into an empty volume) or from the host's clean repository mounted
   read-only, and hands it to that uid. The agent's container never holds a capability.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import re
import shlex
import subprocess
import time
import uuid
from pathlib import Path

from thundersync_verl.envs.swe.instance import SWEInstance
from thundersync_verl.envs.swe.swe_sandbox import (DEFAULT_OUTPUT_BYTES, CommandResult, Workspace, WorkspaceError,
                                               communicate, relative_path, repository_folder)

LABEL = "thundersync.swe=1"
PREPARE_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER")  # the preparing container's only capabilities
CLI_GRACE_S = 15.0  # the CLI call's own deadline beyond the in-container timeout
logger = logging.getLogger(__name__)
_LIVE: dict[str, str] = {}  # container name -> docker binary, for the exit hook


def container_name(instance: SWEInstance) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", instance.instance_id)[:80]
    return f"tsv-swe-{stem}-{uuid.uuid4().hex[:8]}"


def volume_name(name: str) -> str:
    return f"{name}-ws"


def volume_argv(cfg, name: str) -> list[str]:
    """``docker volume create`` of the container's workspace volume (point 5)."""
    return [cfg.binary, "volume", "create", "--label", LABEL, volume_name(name)]


def prepare_argv(cfg, name: str, image: str, seed: Path | None = None) -> list[str]:
    """The preparing container (point 5): fill the workspace volume and give it to ``cfg.user``."""
    mounts = ["-v", f"{volume_name(name)}:{cfg.workdir}"]
    script = f"chown -R {cfg.user} {shlex.quote(cfg.workdir)}"
    if seed is not None:  # a generic image: the clean repository comes from the host, read-only
        mounts += ["-v", f"{seed}:/seed:ro"]
        script = f"cp -a /seed/. {shlex.quote(cfg.workdir)}/ && {script}"
    return [cfg.binary, "run", "--rm", "--label", LABEL, "--network", "none", "--cap-drop", "ALL",
            *[a for cap in PREPARE_CAPS for a in ("--cap-add", cap)], "--security-opt", "no-new-privileges",
            "--user", "0:0", *mounts, "--entrypoint", "sh", image, "-c", script]


def run_argv(cfg, name: str, image: str) -> list[str]:
    """``docker run`` of a detached, unprivileged container that idles until it is removed (``cfg``: ``swe.docker``)."""
    return [cfg.binary, "run", "-d", "--init", "--name", name, "--label", LABEL,
            "--network", cfg.network, "--cpus", f"{cfg.cpus:g}", "--memory", cfg.memory, "--memory-swap", cfg.memory,
            "--pids-limit", str(cfg.pids_limit), "--ulimit", f"nofile={cfg.nofile}:{cfg.nofile}",
            "--user", cfg.user, "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--read-only", "--tmpfs", f"/tmp:rw,nosuid,nodev,size={cfg.tmp_size}", "-e", "HOME=/tmp",
            "-v", f"{volume_name(name)}:{cfg.workdir}", "-w", cfg.workdir, image, "sleep", "infinity"]


def exec_argv(cfg, name: str, command: str, timeout_s: float, *, stdin: bool = False) -> list[str]:
    """``docker exec`` of ``command`` in the repository folder, killed inside the container at ``timeout_s``; it runs
    as the container's user (``swe.docker.user``, point 5)."""
    seconds = max(1, int(round(timeout_s)))
    script = f"timeout -s KILL {seconds} bash -c {shlex.quote(command)}"
    if cfg.env_setup.strip():
        script = f"{cfg.env_setup}\n{script}"
    return [cfg.binary, "exec", *(["-i"] if stdin else []), "-w", cfg.workdir, name, "bash", "-c", script]


def remove_argv(cfg, name: str) -> list[str]:
    return [cfg.binary, "rm", "-f", name]


def remove_volume_argv(cfg, name: str) -> list[str]:
    return [cfg.binary, "volume", "rm", "-f", volume_name(name)]


async def _cli(argv: list[str], timeout_s: float, stdin: str | None = None,
               max_output_bytes: int = DEFAULT_OUTPUT_BYTES) -> CommandResult:
    t0 = time.perf_counter()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        raise WorkspaceError(f"could not run {argv[0]}: {exc}") from exc
    return await communicate(proc, stdin, max_output_bytes, timeout_s, t0)


class DockerWorkspace(Workspace):
    """One container from the instance's image (or ``swe.docker.image``), removed on close."""

    backend = "docker"

    def __init__(self, instance: SWEInstance, cfg, *, seed_dir: str | Path | None = None):
        super().__init__(instance)
        self.cfg = cfg
        self.image = cfg.image or instance.image_name
        self.name = container_name(instance)
        self.seed_dir = Path(seed_dir) if seed_dir is not None else None  # clean repositories, for a generic image
        self.started = False

    async def _start(self) -> None:
        seed = repository_folder(self.seed_dir, self.instance) if self.seed_dir is not None else None
        _LIVE[self.name] = self.cfg.binary  # registered first: a start cut short is still removed
        for argv, what in ((volume_argv(self.cfg, self.name), "docker volume create"),
                           (prepare_argv(self.cfg, self.name, self.image, seed), f"preparing {self.cfg.workdir} from {self.image}"),
                           (run_argv(self.cfg, self.name, self.image), f"docker run {self.image}")):
            result = await _cli(argv, self.cfg.start_timeout_s)
            if not result.ok:
                raise WorkspaceError(f"{what} failed: {result.text()[-400:].strip()}")
        self.started = True
        await self.prepare_repository()

    async def run(self, command: str, *, timeout_s: float, stdin: str | None = None,
                  max_output_bytes: int = DEFAULT_OUTPUT_BYTES) -> CommandResult:
        argv = exec_argv(self.cfg, self.name, command, timeout_s, stdin=stdin is not None)
        result = await _cli(argv, timeout_s + CLI_GRACE_S, stdin, max_output_bytes)
        if result.exit_code == 137 and result.duration_s >= timeout_s:  # timeout -s KILL inside the container
            result = CommandResult(result.stdout, result.stderr, None, True, result.duration_s, result.truncated)
        return result

    async def read_file(self, path: str) -> str:
        rel = relative_path(path)
        result = await self.run(f"cat -- {shlex.quote(str(rel))}", timeout_s=30.0, max_output_bytes=8 << 20)
        if not result.ok:
            raise WorkspaceError(f"cannot read {path}: {result.stderr.strip()[-200:] or 'cat failed'}")
        return result.stdout

    async def write_file(self, path: str, text: str) -> None:
        rel = shlex.quote(str(relative_path(path)))
        command = f'mkdir -p "$(dirname -- {rel})" && cat > {rel}'
        result = await self.run(command, timeout_s=30.0, stdin=text)
        if not result.ok:
            raise WorkspaceError(f"cannot write {path}: {result.stderr.strip()[-200:] or 'write failed'}")

    async def close(self) -> None:
        if _LIVE.pop(self.name, None) is None:
            return
        for argv in (remove_argv(self.cfg, self.name), remove_volume_argv(self.cfg, self.name)):
            result = await _cli(argv, 60.0)
            if not result.ok and "No such" not in result.stderr:
                logger.warning("could not remove %s: %s", argv[-1], result.text()[-300:])


def docker_available(binary: str = "docker", timeout_s: float = 10.0) -> tuple[bool, str]:
    """Whether a docker daemon answers ``docker info``; the reason when it does not."""
    try:
        probe = subprocess.run([binary, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                               timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"`{binary} info` could not run: {exc}"
    if probe.returncode != 0:
        lines = [line for line in (probe.stderr or probe.stdout).strip().splitlines() if line.strip()]
        return False, f"no docker daemon reachable (`{binary} info`: {lines[-1] if lines else probe.returncode})"
    return True, f"docker server {probe.stdout.strip()}"


@atexit.register
def _remove_live_containers() -> None:
    """Containers still registered when the process exits (an abort that skipped close) are removed."""
    for name, binary in list(_LIVE.items()):
        try:
            subprocess.run([binary, "rm", "-f", name], capture_output=True, timeout=30)
            subprocess.run([binary, "volume", "rm", "-f", volume_name(name)], capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            pass
        _LIVE.pop(name, None)
