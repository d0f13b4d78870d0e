"""The escape suite against each SWE sandbox backend: every escape contained, reported, nothing left behind.

Why:
1. The kernel sandbox (``thundersync_verl/envs/jail.py``) is a claim about what a policy's bash cannot do;
   this runs the attempts (``thundersync_verl/envs/swe/escapes.py``: read root's home, ``$HOME``, the
   project, the model cache, another workspace, process 1's environment; write outside; delete a
   checkpoint; signal or ptrace a trainer process; a fork bomb; fill memory; fill the disk; a socket; a
   name lookup; mount, unshare, chroot, a setuid binary; plant links for the file tools; leave a daemon)
   through the agent's tools and judges each on the host.
2. Per backend: ``local`` (the kernel sandbox) always; ``docker`` where a daemon answers ``docker info``
   (image ``$THUNDERSYNC_DOCKER_TEST_IMAGE``, default ``python:3.11``), otherwise skipped with the reason.
3. ``kernel_boundary`` is read inside the workspace: every namespace differs from the host's, the uid is
   not 0, no capability is left and no-new-privileges is set. ``ok`` is the acceptance: at least 15
   escapes tried, all contained, the boundary true, no leftover process or file, on every backend run.
4. Ends with ONE line of JSON, also written to ``sandbox_escape.json`` in the results folder.

    python benchmarks/sandbox_escape.py [--quick] [--backend local]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from thundersync_verl.envs import jail
from thundersync_verl.envs.swe import escapes
from thundersync_verl.envs.swe.docker import DockerWorkspace, docker_available
from thundersync_verl.envs.swe.swe_config import DockerConfig
from thundersync_verl.envs.swe.swe_sandbox import LocalWorkspace
from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result

MIN_ESCAPES = 15


def _summary(result: dict, seconds: float) -> dict:
    ok = (result["escapes_tried"] >= MIN_ESCAPES and result["escapes_contained"] == result["escapes_tried"]
          and result.get("kernel_boundary") is True and result["leftover_processes"] == 0
          and result["leftover_files"] == 0)
    escaped = {r["name"]: r["why"] for r in result["escapes"] if not r["contained"]}
    return {"ok": ok, **{k: v for k, v in result.items() if k != "escapes"}, "escaped": escaped,
            "escapes": {r["name"]: "contained" if r["contained"] else "ESCAPED" for r in result["escapes"]},
            "seconds": round(seconds, 1)}


async def _local(inst, repos) -> dict:
    support = jail.support()
    if not support.ok:
        return {"skipped": f"the kernel sandbox cannot run here: {support.reason}"}
    t0 = time.perf_counter()
    result = await escapes.run_suite(lambda: LocalWorkspace(inst, repos, isolation="kernel", **escapes.SUITE_LIMITS))
    return _summary(result, time.perf_counter() - t0)


async def _docker(inst, repos) -> dict:
    up, why = docker_available()
    if not up:
        return {"skipped": why}
    image = os.environ.get("THUNDERSYNC_DOCKER_TEST_IMAGE", "python:3.11")
    cfg = DockerConfig.from_mapping({"image": image, "memory": f"{escapes.SUITE_LIMITS['mem_mb']}m",
                                     "pids_limit": escapes.SUITE_LIMITS["max_procs"], "env_setup": ""})
    t0 = time.perf_counter()
    result = await escapes.run_suite(lambda: DockerWorkspace(inst, cfg, seed_dir=repos), docker_binary=cfg.binary)
    return {"image": image, **_summary(result, time.perf_counter() - t0)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the same suite (it takes seconds); kept for the common flags")
    ap.add_argument("--backend", action="append", choices=["local", "docker"], help="default: both")
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    results_dir = find_results_dir(args.results_dir)  # refuse before the run, not after
    backends = args.backend or ["local", "docker"]
    out: dict = {"backends": {}}
    with tempfile.TemporaryDirectory(prefix="escape-fixture-") as root:
        inst, repos = escapes.demo_instance(Path(root))
        for name in backends:
            print(f"[escape] backend {name}", flush=True)
            out["backends"][name] = asyncio.run(_local(inst, repos) if name == "local" else _docker(inst, repos))
            for escape, verdict in out["backends"][name].get("escapes", {}).items():
                print(f"[escape]   {escape:28s} {verdict}", flush=True)
    ran = [b for b in out["backends"].values() if "skipped" not in b]
    out["ok"] = bool(ran) and all(b["ok"] for b in ran)
    out["skipped"] = {k: v["skipped"] for k, v in out["backends"].items() if "skipped" in v}
    write_result(Path(__file__).stem, out, results_dir)
    return out


if __name__ == "__main__":
    main()
