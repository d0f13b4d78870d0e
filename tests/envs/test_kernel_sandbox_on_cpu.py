"""The kernel sandbox itself: the opt-in rule, the python tool's boundary with the guard off, the host sweep.

GPUs needed: 0 (CPU only). The boundary tests skip, with the probe's reason, where the kernel refuses
namespaces (not root, or a container without the rights).
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest

from thundersync_verl.envs import jail, jail_host
from thundersync_verl.envs.sandbox import run_python
from thundersync_verl.envs.swe.backends import open_workspace
from thundersync_verl.envs.swe.instance import SWEInstance
from thundersync_verl.envs.swe.swe_config import SWEConfig
from thundersync_verl.envs.swe.swe_sandbox import LocalWorkspace

PROJECT = Path(__file__).resolve().parents[2]
SUPPORT = jail.support()
needs_kernel = pytest.mark.skipif(not SUPPORT.ok, reason=f"the kernel sandbox cannot run here: {SUPPORT.reason}")


@pytest.fixture()
def refused(monkeypatch):
    """A machine whose kernel refuses the sandbox."""
    monkeypatch.setattr(jail, "support", lambda: jail.Support(False, "namespaces forbidden (test)"))
    monkeypatch.delenv(jail.ALLOW_WEAK_ENV, raising=False)
    monkeypatch.setattr(jail, "_weak_logged", set())


def test_without_the_kernel_sandbox_a_run_must_opt_in(refused, monkeypatch, caplog):
    with pytest.raises(jail.KernelSandboxUnavailable) as info:
        jail.resolve(None, None, "the SWE shell")
    text = str(info.value)
    assert "namespaces forbidden (test)" in text and "\n  why: " in text and "\n  fix: " in text
    assert "swe.allow_weak_sandbox=true" in text and jail.ALLOW_WEAK_ENV in text
    with pytest.raises(jail.KernelSandboxUnavailable):
        jail.resolve("kernel", True, "the SWE shell")  # required: the opt-in does not loosen it
    with caplog.at_level(logging.WARNING, logger="thundersync_verl.envs.jail"):
        assert jail.resolve(None, True, "the SWE shell") == "weak"
    assert "WEAKER sandbox" in caplog.text  # loudly
    monkeypatch.setenv(jail.ALLOW_WEAK_ENV, "1")
    assert jail.resolve(None, None, "the python tool") == "weak"
    assert jail.resolve("weak", False, "a benchmark") == "weak"  # asked for by name
    with pytest.raises(ValueError, match="'kernel', 'weak' or None"):
        jail.resolve("strong", None, "x")


def test_the_swe_config_key_is_the_opt_in(refused, tmp_path):
    inst = SWEInstance(instance_id="k-1", repo="k", patch="", FAIL_TO_PASS=(), PASS_TO_PASS=(), image_name="k",
                       problem_statement="")
    with pytest.raises(jail.KernelSandboxUnavailable):
        open_workspace(SWEConfig(), inst, repos_dir=tmp_path)  # fails loudly before any trajectory runs
    weak = open_workspace(SWEConfig.from_verl({"swe": {"allow_weak_sandbox": True}}), inst, repos_dir=tmp_path)
    assert isinstance(weak, LocalWorkspace) and weak.isolation == "weak"


def test_where_the_kernel_allows_it_the_default_is_the_kernel_sandbox():
    if not SUPPORT.ok:
        pytest.skip(f"the kernel sandbox cannot run here: {SUPPORT.reason}")
    assert jail.resolve(None, False, "x") == "kernel"


IDENTITY = ("import os\nns = [os.readlink('/proc/self/ns/' + n) for n in ('mnt', 'pid', 'net', 'ipc', 'uts')]\n"
            "status = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)\n"
            "print(os.getuid(), os.getgid(), len(os.getgroups()), os.getpid())\nprint(*ns)\n"
            "print(*(status[k].strip() for k in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb', 'NoNewPrivs')))")


@needs_kernel
@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_python_calls_run_unprivileged_in_fresh_namespaces(spawn):
    result = run_python(IDENTITY, spawn=spawn, guard_network=False, timeout_s=30)
    assert result.ok, result
    ids, ns, caps = result.stdout.splitlines()
    uid, gid, groups, pid = map(int, ids.split())
    assert uid >= jail.ID_BASE and gid >= jail.ID_BASE and groups <= 1  # getgroups may list the gid
    assert pid == 2  # below the namespace's init (PID 1), so its own signals behave as anywhere else
    ns = ns.split()
    host = [os.readlink(f"/proc/self/ns/{n}") for n in ("mnt", "pid", "net", "ipc", "uts")]
    assert all(a != b for a, b in zip(ns, host)), (ns, host)
    assert caps.split() == ["0" * 16] * 5 + ["1"]


@needs_kernel
@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_with_the_guard_off_the_kernel_alone_holds(spawn, tmp_path):
    # The guard is off: every refusal below comes from the kernel boundary.
    sentinel = tmp_path / "secret.txt"
    sentinel.write_text("secret")
    code = f"""
import os, socket
def attempt(what, fn):
    try:
        fn()
        print(what, "DONE")
    except OSError as exc:
        print(what, type(exc).__name__)
attempt("read_project", lambda: open({str(PROJECT / 'setup.py')!r}).read())
attempt("read_host_tmp", lambda: open({str(sentinel)!r}).read())
attempt("list_home", lambda: os.listdir({os.path.expanduser('~')!r}) == ['.pyenv'] or 1 / 0)
attempt("write_etc", lambda: open('/etc/tsv-pwned', 'w'))
attempt("write_workspace", lambda: open('ok.txt', 'w').write('x'))
attempt("kill_trainer", lambda: os.kill({os.getpid()}, 0))
attempt("connect", lambda: socket.create_connection(('1.1.1.1', 80), timeout=2))
kids = []
try:
    for _ in range(100):
        pid = os.fork()
        if pid == 0:
            import time
            time.sleep(30)
            os._exit(0)
        kids.append(pid)
except OSError as exc:
    print("fork_stopped_after", len(kids), type(exc).__name__)
"""
    result = run_python(code, spawn=spawn, guard_network=False, timeout_s=30)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["read_project"] == "FileNotFoundError" and lines["read_host_tmp"] == "FileNotFoundError"
    assert lines["write_etc"] == "OSError" and lines["write_workspace"] == "DONE"  # read-only file system
    assert lines["kill_trainer"] == "ProcessLookupError" and lines["connect"] == "OSError"
    assert lines["list_home"] in ("DONE", "FileNotFoundError")  # only the interpreter's own folder, if any
    stopped, error = lines["fork_stopped_after"].split()
    assert int(stopped) < 32 and error == "BlockingIOError"  # RLIMIT_NPROC of the call's own uid
    assert not Path("/etc/tsv-pwned").exists()


@needs_kernel
def test_a_dead_owner_s_workspace_mount_folder_and_cgroup_are_swept(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names what it "left"
    folder = tmp_path / f"{jail_host.PREFIX}{dead.pid}-x"
    folder.mkdir()
    jail_host.mount_tmpfs(str(folder), 4)
    (folder / "f").write_text("x")
    cgroup = jail_host.Cgroup.create(folder.name, pids_max=8, memory_bytes=64 << 20)
    alive = tmp_path / f"{jail_host.PREFIX}{os.getpid()}-y"
    alive.mkdir()
    try:
        assert jail_host.sweep(str(tmp_path), min_age_s=0.0) >= 1
        assert not folder.exists() and alive.exists()  # a live owner's folder stays
        assert all(not os.path.exists(f) for f in (cgroup.folders if cgroup else []))
    finally:
        jail_host.sweep.cache_clear()
        if os.path.ismount(folder):
            jail_host.unmount(str(folder))
        if cgroup is not None:
            cgroup.remove()
