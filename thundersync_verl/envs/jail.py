"""The kernel sandbox around model-driven commands: fresh namespaces, a read-only root, an unprivileged uid.

Why:
1. A policy's bash or python runs with whatever the kernel lets its process do. An in-interpreter guard
   and a network namespace do not stop a shell from reading checkpoints, the model cache, ``$HOME`` or
   the project, deleting them, or signalling the trainer. The boundary therefore lives in the kernel:
   each command starts in fresh mount, PID, network, IPC and UTS namespaces and sees a root built for
   it (the system and the interpreter bind-mounted read-only, its own workspace read-write, a private
   size-capped ``/tmp``, its own ``/proc``, a handful of device nodes); everything else on the host is
   absent, not merely unreadable.
2. It then runs as an unprivileged uid and gid of its own (allocated per workspace or per call, so
   ``RLIMIT_NPROC`` counts only its processes), with no supplementary groups, every capability dropped
   (bounding, inheritable and ambient sets included) and no-new-privileges, so setuid binaries, file
   capabilities, ``mount``, ``unshare``, ``chroot`` and ``ptrace`` of anything outside are refused.
3. One piece of Python source, :data:`JAIL_SOURCE`, does it for every path (the spawned shell, the
   python tool's fresh interpreter, the fork server's child) with the kernel's own calls: ``unshare(2)``,
   ``mount(2)``, ``pivot_root(2)``, ``setresuid(2)``, ``capset(2)``, ``prctl(2)``. The process that made
   the namespaces stays outside as a relay and ends as the jailed command ends; inside, an unprivileged
   init is PID 1 (when the command exits, so does the init, and the kernel kills everything left in the
   namespace) and dies with the relay (the parent-death signal is set after the uid change that clears
   it). ``pivot_root`` into a sub-folder leaves no host mount in the namespace and makes the process count
   as chrooted, so the kernel also refuses it new user namespaces. Nothing to install: the maintained tools were tried and
   do not serve here (util-linux 2.38 ``unshare`` misreports a child killed by SIGKILL, ``setpriv``'s uid
   change drops the parent-death signal, bubblewrap run by root leaves the command host uid 0 inside a
   user namespace, and a binary would cost the python tool its forked interpreter); docs/sandbox.md.
4. Where the kernel refuses (no root, namespaces forbidden), :func:`resolve` raises a rule/why/fix
   error unless the run opted in to the weaker sandbox (``swe.allow_weak_sandbox``, or
   ``THUNDERSYNC_SANDBOX_ALLOW_WEAK=1`` for the python tool); the opt-in is logged as a warning.
5. Host-side pieces a workspace holds between commands (a size-capped tmpfs for its files, a cgroup
   for its process count and memory) are in :mod:`jail_host`.
"""

from __future__ import annotations

import functools
import logging
import marshal
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from thundersync_verl.core.errors import rule_message

logger = logging.getLogger(__name__)

# Sandbox uids and gids are drawn from here: far above any login account (Debian stops at 59999 and 65534),
# and away from the 100000.. ranges /etc/subuid hands to rootless containers.
ID_BASE, ID_SPAN = 0x60000000, 1 << 24
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
ALLOW_WEAK_ENV = "THUNDERSYNC_SANDBOX_ALLOW_WEAK"
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

# Run by a root process before any model-written code: ``_jail_start`` makes the namespaces and the processes,
# ``_jail_enter`` the root, ``_jail_drop`` the identity and limits.
JAIL_SOURCE = r"""
def _jail_libc():
    import ctypes
    return ctypes, ctypes.CDLL(None, use_errno=True)

def _jail_prctl(*args):
    ctypes, libc = _jail_libc()
    return libc.prctl(*[ctypes.c_ulong(a) for a in args])  # full-width arguments: prctl checks unused ones are 0

def _jail_unshare(flags):
    ctypes, libc = _jail_libc()
    if libc.unshare(flags) != 0:
        import os
        err = ctypes.get_errno()
        raise OSError(err, "sandbox setup: unshare: " + os.strerror(err))

def _jail_enter(spec):
    import os
    ctypes, libc = _jail_libc()
    RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, MOVE, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 8192, 16384, 1 << 18
    enc = lambda s: None if s is None else s.encode()

    def fail(what):
        err = ctypes.get_errno()
        raise OSError(err, "sandbox setup: %s: %s" % (what, os.strerror(err)))

    def mount(src, dst, fstype=None, flags=0, data=None):
        if libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
            fail("mount %s on %s" % (src or fstype, dst))

    def target(path, is_dir):
        full = jail + path
        if is_dir:
            os.makedirs(full, 0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(full), 0o755, exist_ok=True)
            if not os.path.lexists(full):
                open(full, "w").close()
        return full

    def bind(src, dst, flags):
        full = target(dst, os.path.isdir(src))
        mount(src, full, None, BIND)
        mount(None, full, None, BIND | REMOUNT | flags)

    os.umask(0o022)
    mount(None, "/", None, REC | PRIVATE)  # nothing below propagates back to the host
    for procs in spec["cgroups"]:  # joined while the cgroup files are still in view
        with open(procs, "w") as f:
            f.write("0")
    stage = spec["stage"]
    mount("tsv-sandbox", stage, "tmpfs", NOSUID | NODEV, "size=4m,mode=0755")
    jail = stage + "/root"
    os.mkdir(jail, 0o755)
    size = "size=%dm,mode=1777" % spec["tmp_mb"]
    # the private /tmp first: an interpreter or venv bound from under the host's /tmp stays visible on top of it
    mount("tsv-tmp", target("/tmp", True), "tmpfs", NOSUID | NODEV, size)
    for src in spec["ro"]:
        bind(src, src, RDONLY | NOSUID | NODEV)
    for path, link in spec["links"].items():
        os.symlink(link, jail + path)
    for src, dst in spec["rw"]:
        bind(src, dst, NOSUID | NODEV)
    dev = target("/dev", True)
    mount("tsv-dev", dev, "tmpfs", NOSUID | NOEXEC, "size=64k,mode=0755")
    for name in spec["devices"]:
        if os.path.exists("/dev/" + name):
            bind("/dev/" + name, "/dev/" + name, NOSUID | NOEXEC)
    for name, link in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                       ("stderr", "/proc/self/fd/2")):
        os.symlink(link, dev + "/" + name)
    os.mkdir(dev + "/shm")
    mount("tsv-shm", dev + "/shm", "tmpfs", NOSUID | NODEV | NOEXEC, size)
    mount(None, dev, None, REMOUNT | RDONLY | NOSUID | NOEXEC)
    mount("proc", target("/proc", True), "proc", NOSUID | NODEV | NOEXEC)
    mount(None, stage, None, REMOUNT | RDONLY | NOSUID | NODEV)
    os.chdir(stage)
    number = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}.get(os.uname().machine)
    if number is not None and libc.syscall(ctypes.c_long(number), b".", b".") == 0:  # pivot_root: the old root stacks on ours
        if libc.umount2(b".", 2) != 0:  # MNT_DETACH: no host mount is left in this namespace
            fail("umount of the old root")
    else:
        mount(stage, "/", None, MOVE)
    os.chroot("root")  # a sub-folder: the kernel then also refuses this process new user namespaces
    os.chdir(spec["cwd"])
    if libc.sethostname(b"sandbox", 7) != 0:
        fail("sethostname")

def _jail_limits(spec):
    import resource
    for name, (soft, hard) in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))

def _jail_drop(spec):
    import os
    ctypes, libc = _jail_libc()
    _jail_limits(spec)
    os.setgroups([])
    os.setresgid(spec["gid"], spec["gid"], spec["gid"])
    cap = 0
    while _jail_prctl(24, cap, 0, 0, 0) == 0:  # PR_CAPBSET_DROP until past the last capability
        cap += 1
    _jail_prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    os.setresuid(spec["uid"], spec["uid"], spec["uid"])
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:  # inheritable too (setuid cleared the rest)
        raise OSError(ctypes.get_errno(), "sandbox setup: capset")
    if _jail_prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "sandbox setup: no_new_privs")
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    caps = [int(status[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")]
    if any(caps) or status["NoNewPrivs"].strip() != "1" or os.getuid() == 0:
        raise OSError(1, "sandbox setup: privileges still held after the drop")

def _jail_wait(pid):
    import os
    while True:
        try:
            return os.waitpid(pid, 0)[1]
        except InterruptedError:
            continue

def _jail_relay(pid, status_r):
    # Outside: wait for the namespace's init, then end the way the jailed command ended (its init passes the
    # command's wait status on), so the caller classifies it alike; no status: the init itself was killed.
    import os, resource, signal
    status = _jail_wait(pid)
    reported = os.read(status_r, 32)
    if reported:
        status = int(reported)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)

def _jail_start(spec, parent=None):
    # From a root process: fresh namespaces and three processes. This one stays outside as the relay (it never
    # returns); its child is PID 1 there, an unprivileged init that waits for the command and passes its status
    # on (PID 1 ignores signals it sent itself, so the command must not be PID 1); the grandchild returns, in
    # the jail, unprivileged, to run the command.
    import os
    if parent is not None:  # a spawned relay dies with the process that spawned it
        _jail_prctl(1, 9)
        if os.getppid() != parent:
            os._exit(137)
    import resource, signal  # the relay's imports, while the host's files are still in view
    _jail_unshare(0x20000000)  # CLONE_NEWPID: for the child only; the relay stays in the host's namespaces
    alive_r, alive_w = os.pipe()
    status_r, status_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(alive_r)
        os.close(status_w)
        _jail_relay(pid, status_r)
    os.close(alive_w)
    os.close(status_r)
    _jail_unshare(0x00020000 | 0x04000000 | 0x08000000 | 0x40000000)  # mount, UTS, IPC, network
    _jail_enter(spec)
    _jail_drop(spec)
    _jail_prctl(1, 9)  # PR_SET_PDEATHSIG, after the uid change that cleared it: dies with the relay
    os.set_blocking(alive_r, False)
    try:
        gone = os.read(alive_r, 1) == b""  # end of file: the relay died before the line above
    except BlockingIOError:
        gone = False
    if gone:
        os._exit(137)
    os.close(alive_r)
    command = os.fork()
    if command == 0:
        os.close(status_w)
        return
    for fd in (0, 1, 2):  # the init holds none of the command's streams
        os.close(fd)
    os.write(status_w, str(_jail_wait(command)).encode())
    os._exit(0)  # and the kernel ends whatever the command left in the namespace
"""

# The spawned path: ``python /dev/fd/N <argv...>``, N an in-memory file holding JAIL_SOURCE, the spec and this.
SHELL_MAIN = r"""
import marshal, os, sys
os.closerange(3, 1 << 16)  # this program's own file among them: the command inherits only its three streams
_spec = marshal.loads(bytes.fromhex(_SPEC))
try:
    _jail_start(_spec, _spec["parent"])
except OSError as exc:
    sys.stderr.write("sandbox: %s\n" % exc)
    os._exit(125)
try:
    os.execvpe(sys.argv[1], sys.argv[1:], _spec["env"])
except OSError as exc:
    sys.stderr.write("sandbox: %s: %s\n" % (sys.argv[1], exc.strerror))
    os._exit(127)
"""


def program_file(source: str) -> int:
    """An in-memory file holding ``source``, for ``python /dev/fd/N``: neither the program nor its spec appears
    on the command line, which ``ps`` inside the sandbox shows. The caller passes it on and closes it."""
    fd = os.memfd_create("tsv-sandbox")
    os.write(fd, source.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class KernelSandboxUnavailable(RuntimeError):
    """The kernel sandbox cannot run here and the run did not opt in to the weaker one."""


@dataclass(frozen=True)
class Support:
    """What the probe found: ``ok`` when a jailed command ran as an unprivileged uid without capabilities."""

    ok: bool
    reason: str


@functools.lru_cache(maxsize=1)
def host_view() -> tuple[tuple[str, ...], dict[str, str]]:
    """The read-only paths every jail sees and the top-level symlinks it recreates (``/bin -> usr/bin``).

    The system folders, the interpreter's installation and its virtual environment (their real paths, so
    ``sys.executable`` resolves inside), and every mount below them (a container's ``/etc/hosts``).
    Nothing else: not ``$HOME`` (only the interpreter's folder when it lives there), not the project.
    """
    paths, links = [], {}
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            links[path] = os.readlink(path)
        elif os.path.isdir(path):
            paths.append(path)
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                   os.path.dirname(os.path.realpath(sys.executable))}:
        real = os.path.realpath(prefix)
        if real != "/" and os.path.isdir(real):
            paths.append(real)
    paths = _outermost(paths)
    mounts = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                point = line.split()[4].replace("\\040", " ")
                if any(point.startswith(p + "/") for p in paths):
                    mounts.append(point)
    except OSError:
        pass
    return tuple(paths + sorted(mounts, key=lambda p: p.count("/"))), links


def _outermost(paths: list[str]) -> list[str]:
    kept: list[str] = []
    for path in sorted(set(paths), key=len):
        if not any(path == k or path.startswith(k + "/") for k in kept):
            kept.append(path)
    return kept


def allocate_ids() -> tuple[int, int]:
    """A fresh uid and gid for one workspace or call (point 2); nothing on the host owns them."""
    n = ID_BASE + random.SystemRandom().randrange(ID_SPAN)
    return n, n


@dataclass
class Spec:
    """One jail: the host folder its root is built on, its bind mounts, limits, identity and environment."""

    stage: str
    cwd: str
    rw: list[tuple[str, str]]
    uid: int
    gid: int
    env: dict[str, str]
    rlimits: dict[str, tuple[int, int]]
    tmp_mb: int = 64
    cgroups: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """What :data:`JAIL_SOURCE` reads (plain types: it crosses a process boundary)."""
        ro, links = host_view()
        for _, dst in self.rw:
            if any(dst == p or dst.startswith(p + "/") or p.startswith(dst + "/") for p in (*ro, *links)):
                raise ValueError(f"the sandbox path {dst} overlaps the read-only system path it would hide")
        return {"stage": self.stage, "cwd": self.cwd, "rw": [list(p) for p in self.rw], "ro": list(ro),
                "links": links, "devices": list(DEVICES), "tmp_mb": int(self.tmp_mb), "uid": self.uid,
                "gid": self.gid, "env": self.env, "rlimits": {k: list(v) for k, v in self.rlimits.items()},
                "cgroups": list(self.cgroups), "parent": os.getpid()}

    def encode(self) -> str:
        """The spec as a spawned jail's argument: marshal (builtin: no import cost in the jail), in hex."""
        return marshal.dumps(self.as_dict()).hex()


def shell_command(spec: Spec, argv: list[str]) -> tuple[list[str], int]:
    """The spawned path: a root interpreter that makes the jail (:data:`JAIL_SOURCE`) and execs ``argv`` in it.

    Returns the command line and the program's file descriptor: pass it (``pass_fds``), then close it.
    """
    found = support()
    if not found.ok:
        raise KernelSandboxUnavailable(found.reason)
    return _spawn(spec, argv)


def _spawn(spec: Spec, argv: list[str]) -> tuple[list[str], int]:
    fd = program_file(JAIL_SOURCE + f"_SPEC = {spec.encode()!r}\n" + SHELL_MAIN)
    return [sys.executable, "-I", "-S", "-B", f"/dev/fd/{fd}", *argv], fd


@functools.lru_cache(maxsize=1)
def support() -> Support:
    """Probe once per process: run ``id`` and read its status in a real jail (namespaces, mounts, the drop)."""
    if os.geteuid() != 0:
        return Support(False, f"the trainer runs as uid {os.geteuid()}, not root: creating the namespaces "
                       "and switching to a sandbox uid needs root")
    uid, gid = allocate_ids()
    script = "id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status"
    with tempfile.TemporaryDirectory(prefix="tsv-probe-") as stage:
        spec = Spec(stage=stage, cwd="/", rw=[], uid=uid, gid=gid, env={"PATH": "/usr/bin:/bin"}, rlimits={}, tmp_mb=1)
        argv, fd = _spawn(spec, ["sh", "-c", script])
        try:
            probe = subprocess.run(argv, capture_output=True, text=True, timeout=30, pass_fds=(fd,))
        except (OSError, subprocess.SubprocessError) as exc:
            return Support(False, f"the probe could not run: {exc}")
        finally:
            os.close(fd)
    expected = [str(uid), "CapEff:", "0" * 16, "CapBnd:", "0" * 16, "NoNewPrivs:", "1"]
    if probe.returncode != 0 or probe.stdout.split() != expected:
        detail = (probe.stderr.strip() or probe.stdout.strip() or f"exit code {probe.returncode}")[-300:]
        return Support(False, f"the kernel refused the sandbox: {detail}")
    return Support(True, "")


_weak_logged: set[str] = set()


def resolve(isolation: str | None, allow_weak: bool | None, what: str) -> str:
    """``kernel`` or ``weak`` for one sandbox user (``what`` names it in messages).

    ``isolation``: ``kernel`` requires the kernel sandbox; ``weak`` asks for the older sandbox (network and
    PID namespaces and rlimits where available; benchmarks compare the two); None picks ``kernel`` where
    :func:`support` says it runs and ``weak`` only where the run opted in (``allow_weak``, or the
    ``THUNDERSYNC_SANDBOX_ALLOW_WEAK=1`` environment variable when ``allow_weak`` is None).
    """
    if isolation not in (None, "kernel", "weak"):
        raise ValueError(f"sandbox isolation must be 'kernel', 'weak' or None, got {isolation!r}")
    if isolation == "weak":
        return "weak"
    found = support()
    if found.ok:
        return "kernel"
    if allow_weak is None:
        allow_weak = os.environ.get(ALLOW_WEAK_ENV, "") not in ("", "0", "false", "no")
    if isolation is None and allow_weak:
        if what not in _weak_logged:
            _weak_logged.add(what)
            logger.warning("%s: the kernel sandbox is unavailable (%s); running with the WEAKER sandbox the run "
                           "opted in to: the command shares the trainer's filesystem and user", what, found.reason)
        return "weak"
    raise KernelSandboxUnavailable(rule_message(
        f"{what} runs model-written commands only inside the kernel sandbox (namespaces, read-only root, "
        "unprivileged uid)",
        f"it cannot start here: {found.reason}; the weaker sandbox would let a policy read and delete the "
        "trainer's files (checkpoints, model cache, $HOME) and signal its processes",
        "run the trainer as root on a kernel that allows mount, PID, network, IPC and UTS namespaces, "
        f"or accept the weaker sandbox explicitly: swe.allow_weak_sandbox=true for the SWE shell, "
        f"{ALLOW_WEAK_ENV}=1 for the python tool"))
