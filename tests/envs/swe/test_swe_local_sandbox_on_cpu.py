"""The local SWE workspace: the instance's starting state, isolation, limits, cleanup, backend choice.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from thundersync_verl.envs.sandbox import netns_prefix
from thundersync_verl.envs.swe.backends import open_workspace
from thundersync_verl.envs.swe.swe_config import SWEConfig
from thundersync_verl.envs.swe.docker import DockerWorkspace
from thundersync_verl.envs.swe.swe_sandbox import LocalWorkspace, WorkspaceError


def _run(coro):
    return asyncio.run(coro)


def test_start_applies_the_bug_and_commits_it(synthetic_set):
    inst, repos = synthetic_set["instances"][1], synthetic_set["repos_dir"]  # mathkit: clamp's upper bound

    async def body():
        ws = LocalWorkspace(inst, repos)
        await ws.start()
        try:
            source = await ws.read_file("mathkit/core.py")
            status = await ws.run("git status --porcelain && git log --format=%s", timeout_s=20)
            return ws.repo_dir, source, status, ws.start_s
        finally:
            await ws.close()

    repo_dir, source, status, start_s = _run(body())
    clean = (repos / inst.repo / "mathkit/core.py").read_text()
    assert "    if value > high:\n        return low\n" in source and source != clean  # the bug, not the clean file
    assert status.ok and status.stdout == f"{inst.instance_id}\n"  # nothing uncommitted: git diff shows only edits
    assert start_s is not None and start_s > 0
    assert not repo_dir.exists()  # close() removed the copy
    assert (repos / inst.repo / "mathkit/core.py").read_text() == clean  # the clean repository is untouched


def test_base_commit_is_checked_out_instead_of_applying_the_patch(synthetic_set, tmp_path):
    inst = synthetic_set["instances"][0]
    repo = tmp_path / inst.repo
    shutil.copytree(synthetic_set["repos_dir"] / inst.repo, repo)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "clean"], check=True)
    subprocess.run([*git, "apply"], input=inst.patch, text=True, check=True)
    subprocess.run([*git, "commit", "-qam", "bug"], check=True)
    bug_commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([*git, "checkout", "-q", "HEAD~1"], check=True)  # the folder holds the clean state again
    with_commit = dataclasses.replace(inst, base_commit=bug_commit, patch="this is not a diff")

    async def body():
        ws = LocalWorkspace(with_commit, tmp_path)
        await ws.start()
        try:
            return await ws.read_file("textkit/core.py")
        finally:
            await ws.close()

    assert '"_".join(words)' in _run(body())


@pytest.mark.skipif(not netns_prefix(), reason="this kernel gives no network namespace (unshare --net fails)")
def test_commands_have_no_network_and_die_at_the_timeout(synthetic_set):
    inst, repos = synthetic_set["instances"][0], synthetic_set["repos_dir"]

    async def body():
        ws = LocalWorkspace(inst, repos)
        await ws.start()
        try:
            net = await ws.run("python -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\"", timeout_s=20)
            hung = await ws.run("sleep 60 & sleep 60; echo never", timeout_s=1.0)
            env = await ws.run("echo $HOME; command -v python", timeout_s=10)
            return net, hung, env, ws.root
        finally:
            await ws.close()

    net, hung, env, root = _run(body())
    assert not net.ok and ("unreachable" in net.stderr or "Errno" in net.stderr)
    assert hung.timed_out and hung.duration_s < 10 and "never" not in hung.stdout
    home, python = env.stdout.split()
    assert home.startswith("/") and Path(python).name.startswith("python")


def test_missing_repository_and_bad_patch_are_reported(synthetic_set, tmp_path):
    inst = synthetic_set["instances"][0]
    with pytest.raises(WorkspaceError, match="no repository for instance"):
        _run(LocalWorkspace(inst, tmp_path).start())
    broken = dataclasses.replace(inst, patch=inst.patch.replace('"_".join', '"+".join').replace('"-".join', '"*".join'))

    async def body():
        ws = LocalWorkspace(broken, synthetic_set["repos_dir"])
        try:
            await ws.start()
        finally:
            await ws.close()

    with pytest.raises(WorkspaceError, match="patch did not apply"):
        _run(body())


def test_the_config_key_picks_the_backend(synthetic_set):
    inst, repos = synthetic_set["instances"][0], synthetic_set["repos_dir"]
    assert isinstance(open_workspace(SWEConfig(), inst, repos_dir=repos), LocalWorkspace)
    docker = open_workspace(SWEConfig.from_verl({"swe": {"sandbox": "docker"}}), inst, repos_dir=repos)
    assert isinstance(docker, DockerWorkspace) and docker.image == inst.image_name and docker.seed_dir is None
    generic = open_workspace(SWEConfig.from_verl({"swe": {"sandbox": "docker", "docker": {"image": "python:3.11"}}}),
                             inst, repos_dir=repos)
    assert generic.image == "python:3.11" and generic.seed_dir == repos
    with pytest.raises(WorkspaceError, match="needs swe.repos_dir"):
        open_workspace(SWEConfig(), inst, repos_dir=None)
