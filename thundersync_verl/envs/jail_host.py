"""Host-side pieces a kernel-sandboxed workspace holds between its commands: a size-capped tmpfs and a cgroup.

Why:
1. Per-process limits do not bound a workspace's disk: many files, each under ``RLIMIT_FSIZE``, fill the
   host's. The workspace's folder is therefore a tmpfs of ``swe.local_disk_mb`` (pages are used only as
   files grow): a full workspace is the command's own "No space left on device", never the host's disk.
2. A fork bomb of processes each under ``RLIMIT_AS`` can still take all memory together. Where the
   trainer can create a cgroup (v1 ``pids`` and ``memory`` hierarchies, or v2 with both delegated), all
   processes of a workspace share one ``pids.max`` and one memory limit; elsewhere ``RLIMIT_NPROC`` (one
   uid per workspace, so it counts only that workspace) and ``RLIMIT_AS`` per process remain.
3. Both carry the owning process's pid in their name (``tsv-swe-<pid>-...``): a trainer killed mid-run
   leaves nothing the next workspace start does not sweep (tmpfs unmounted, folder and cgroup removed).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import signal
import time

logger = logging.getLogger(__name__)
PREFIX = "tsv-swe-"
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def mount_tmpfs(path: str, size_mb: int) -> None:
    """A tmpfs of ``size_mb`` MiB on ``path`` (host mount namespace); raises OSError with the reason."""
    data = f"size={int(size_mb)}m,mode=0755".encode()
    if _libc().mount(b"tsv-workspace", path.encode(), b"tmpfs", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting a tmpfs on {path}: {os.strerror(err)}")


def unmount(path: str) -> None:
    """Detach the mount on ``path`` (lazily: a process still inside keeps it until it leaves)."""
    if _libc().umount2(path.encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unmounting {path}: {os.strerror(err)}")


def chown_tree(root: str, uid: int, gid: int) -> None:
    """``root`` and everything below it to ``uid:gid``; symbolic links themselves, never what they point to."""
    os.lchown(root, uid, gid)
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            os.lchown(os.path.join(folder, name), uid, gid)


# ----- cgroups -----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def cgroup_parents() -> tuple[str, dict[str, str]]:
    """``("v1"|"v2"|"", {controller: folder})``: where this process may create child cgroups for pids and memory."""
    own: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for name in controllers.split(",") if controllers else [""]:
                    own[name] = path
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except (OSError, ValueError):
        return "", {}
    v1, v2 = {}, None
    for fields in mounts:
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup":
            for name in ("pids", "memory"):
                if name in options and name in own:
                    v1[name] = fields[4] + own[name]
        elif fstype == "cgroup2" and "" in own:
            v2 = fields[4] + own[""]
    if len(v1) == 2 and all(os.access(p, os.W_OK) for p in v1.values()):
        return "v1", v1
    if v2 is not None:
        try:
            with open(os.path.join(v2, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
        except OSError:
            enabled = []
        if {"pids", "memory"} <= set(enabled) and os.access(v2, os.W_OK):
            return "v2", {"pids": v2, "memory": v2}
    return "", {}


class Cgroup:
    """One workspace's cgroup (point 2): ``procs`` lists the ``cgroup.procs`` files a command joins."""

    def __init__(self, folders: list[str], version: str):
        self.folders, self.version = folders, version

    @property
    def procs(self) -> list[str]:
        return [os.path.join(f, "cgroup.procs") for f in self.folders]

    @classmethod
    def create(cls, name: str, *, pids_max: int, memory_bytes: int) -> "Cgroup | None":
        """The cgroup, or None where none can be created here (logged once)."""
        version, parents = cgroup_parents()
        if not version:
            _log_once("no writable pids+memory cgroup here: process count and memory are capped per uid and "
                      "per process (RLIMIT_NPROC, RLIMIT_AS) only")
            return None
        folders = sorted({os.path.join(p, name) for p in parents.values()})
        settings = {"pids": [("pids.max", pids_max)]}
        if version == "v1":
            settings["memory"] = [("memory.limit_in_bytes", memory_bytes), ("memory.memsw.limit_in_bytes", memory_bytes)]
        else:
            settings["pids"] += [("memory.max", memory_bytes), ("memory.swap.max", 0)]
        made = []
        try:
            for folder in folders:
                os.mkdir(folder)
                made.append(folder)
            for controller, values in settings.items():
                folder = os.path.join(parents[controller], name)
                for key, value in values:
                    path = os.path.join(folder, key)
                    if os.path.exists(path):  # memsw / swap files exist only with swap accounting
                        with open(path, "w") as f:
                            f.write(str(value))
        except OSError as exc:
            for folder in made:
                _remove_cgroup(folder)
            _log_once(f"could not set up a cgroup ({exc}): process count and memory are capped per uid and per "
                      "process only")
            return None
        return cls(folders, version)

    def remove(self) -> None:
        """Kill whatever is still inside (nothing normally: the PID namespace took it) and remove the folders."""
        for folder in self.folders:
            _remove_cgroup(folder)


def _remove_cgroup(folder: str) -> None:
    for _ in range(50):
        try:
            with open(os.path.join(folder, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.rmdir(folder)
            return
        except OSError:
            time.sleep(0.02)
    logger.warning("could not remove the cgroup %s", folder)


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning("%s", message)


# ----- sweep -------------------------------------------------------------------------------------------
def _owner_dead(name: str) -> bool:
    pid = name[len(PREFIX):].split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


@functools.lru_cache(maxsize=None)
def sweep(folder: str, min_age_s: float = 60.0) -> int:
    """Remove what dead owners left (point 3): workspace tmpfs mounts and folders under ``folder``, and cgroups.

    Once per process and folder; a folder younger than ``min_age_s`` is kept. Returns how many went.
    """
    removed, now = 0, time.time()
    try:
        names = [n for n in os.listdir(folder) if n.startswith(PREFIX)]
    except OSError:
        names = []
    for name in names:
        path = os.path.join(folder, name)
        try:
            if not _owner_dead(name) or now - os.stat(path).st_mtime < min_age_s:
                continue
            if os.path.ismount(path):
                unmount(path)
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        except OSError:
            continue
    _, parents = cgroup_parents()
    for parent in set(parents.values()):
        try:
            stale = [n for n in os.listdir(parent) if n.startswith(PREFIX) and _owner_dead(n)]
        except OSError:
            continue
        for name in stale:
            _remove_cgroup(os.path.join(parent, name))
            removed += 1
    return removed
