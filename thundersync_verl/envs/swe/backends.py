"""The one place that turns ``swe.sandbox`` into a workspace: ``local`` or ``docker``.

Why its own module: the backends import the workspace interface (``sandbox.py``); the factory imports
the backends. Kept apart, neither backend module imports the other and there is no import cycle.
"""

from __future__ import annotations

from pathlib import Path

from thundersync_verl.envs.swe.docker import DockerWorkspace
from thundersync_verl.envs.swe.instance import SWEInstance
from thundersync_verl.envs.swe.swe_sandbox import LocalWorkspace, Workspace, WorkspaceError

BACKENDS = ("local", "docker")


def open_workspace(settings, instance: SWEInstance, *, repos_dir: str | Path | None = None) -> Workspace:
    """The workspace ``settings.sandbox`` names (``settings``: an ``SWEConfig``); nothing is started yet.

    ``repos_dir`` holds the clean repositories: the local backend copies ``<repos_dir>/<repo>``; the docker
    backend copies it into the container only when ``swe.docker.image`` replaces the instance's own image.
    """
    if settings.sandbox == "local":
        if repos_dir is None:
            raise WorkspaceError("the local sandbox needs swe.repos_dir (the folder of clean repositories)")
        return LocalWorkspace(instance, repos_dir, mem_mb=settings.local_mem_mb, cpu_s=settings.local_cpu_s,
                              disk_mb=settings.local_disk_mb, tmp_mb=settings.local_tmp_mb,
                              max_procs=settings.local_max_procs, allow_weak=settings.allow_weak_sandbox)
    if settings.sandbox == "docker":
        return DockerWorkspace(instance, settings.docker, seed_dir=repos_dir if settings.docker.image else None)
    raise WorkspaceError(f"unknown swe.sandbox {settings.sandbox!r}; the backends are {', '.join(BACKENDS)}")
