"""The escape suite from inside the SWE shell (bash), against the local kernel sandbox; a control against the weaker one.

GPUs needed: 0 (CPU only). The suite runs once per module (~10 s: the fork bomb and the memory fill take
most of it) and each escape is one test. Skipped, with the probe's reason, where the kernel refuses
namespaces. The docker backend's run is ``benchmarks/sandbox_escape.py`` (it needs a daemon and an image).
"""

from __future__ import annotations

import asyncio

import pytest

from thundersync_verl.envs import jail
from thundersync_verl.envs.swe import escapes
from thundersync_verl.envs.swe.swe_sandbox import LocalWorkspace, WorkspaceError

SUPPORT = jail.support()
pytestmark = pytest.mark.skipif(not SUPPORT.ok, reason=f"the kernel sandbox cannot run here: {SUPPORT.reason}")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return escapes.demo_instance(tmp_path_factory.mktemp("escape"))


@pytest.fixture(scope="module")
def suite(demo):
    inst, repos = demo
    return asyncio.run(escapes.run_suite(lambda: LocalWorkspace(inst, repos, isolation="kernel", **escapes.SUITE_LIMITS)))


@pytest.mark.parametrize("escape", escapes.ESCAPES, ids=[e.name for e in escapes.ESCAPES])
def test_escape_is_contained(suite, escape):
    result = next(r for r in suite["escapes"] if r["name"] == escape.name)
    assert result["contained"], result
    assert result["reported"] == escape.fails_command, result  # a failed attempt reaches the model as a tool error


def test_the_boundary_is_the_kernel_s_and_nothing_is_left(suite):
    assert suite["escapes_tried"] == len(escapes.ESCAPES) >= 15
    assert suite["kernel_boundary"] and suite["namespaces_fresh"] and suite["capabilities_dropped"], suite
    assert suite["uid"] >= jail.ID_BASE
    assert suite["leftover_processes"] == 0 and suite["leftover_files"] == 0, suite["leftover_paths"]


def test_control_the_weaker_sandbox_lets_the_reads_through(demo):
    # Proves the checks can fail: the same reading escapes, run in the weaker sandbox (trainer's user and files).
    inst, repos = demo
    weak = asyncio.run(escapes.run_suite(lambda: LocalWorkspace(inst, repos, isolation="weak"), only=escapes.SAFE_IN_WEAK))
    escaped = {r["name"] for r in weak["escapes"] if not r["contained"]}
    assert {"read_root_home", "read_home", "read_project", "read_model_cache", "read_other_workspace"} <= escaped, weak
    with pytest.raises(RuntimeError, match="only the reading escapes"):
        asyncio.run(escapes.run_suite(lambda: LocalWorkspace(inst, repos, isolation="weak")))


def test_file_tools_refuse_links_out_of_the_repository(demo, tmp_path):
    inst, repos = demo
    outside = tmp_path / "host.txt"
    outside.write_text("host secret")

    async def body():
        ws = LocalWorkspace(inst, repos, isolation="kernel", **escapes.SUITE_LIMITS)
        await ws.start()
        try:
            ws.repo_dir.joinpath("inside.txt").write_text("fine")
            for name, target in (("out.txt", outside), ("in.txt", "inside.txt"), ("outdir", tmp_path)):
                ws.repo_dir.joinpath(name).symlink_to(target)
            assert await ws.read_file("in.txt") == "fine"  # a link that stays inside is followed
            for call in (ws.read_file("out.txt"), ws.write_file("out.txt", "x"), ws.write_file("outdir/new.txt", "x")):
                with pytest.raises(WorkspaceError, match="outside the repository"):
                    await call
            await ws.write_file("sub/dir/new.py", "x = 1\n")
            made = await ws.run("stat -c %u sub sub/dir sub/dir/new.py && echo y >> sub/dir/new.py", timeout_s=30)
            return made
        finally:
            await ws.close()

    made = asyncio.run(body())
    assert outside.read_text() == "host secret" and not (tmp_path / "new.txt").exists()
    assert made.ok and len(set(made.stdout.split())) == 1 and int(made.stdout.split()[0]) >= jail.ID_BASE, made
