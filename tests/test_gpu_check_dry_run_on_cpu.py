"""``bash ci/gpu_check.sh --dry-run`` on this CPU machine: every check resolves, and on a GPU platform.

Why:
1. The GPU check has not run on a GPU yet; what can be checked here is that it would start: each command's
   script exists and its own parser takes the flags, every import the run needs resolves (GPU-only packages
   such as vllm are reported by name), and no check would run on platform ``cpu``, the bug this replaced
   (the harness forced ``VERL_PLATFORM=cpu`` under the script's ``nvidia``).
2. The platform comes from the caller: unset it is ``nvidia`` for every check; a caller's ``cpu`` is kept,
   not replaced, and the check refuses it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _driver():
    spec = importlib.util.spec_from_file_location("ci_gpu_check", ROOT / "ci" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_dry_run_resolves_every_check_on_a_gpu_platform():
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}  # conftest sets cpu for the CPU tests
    env["PY"] = sys.executable
    proc = subprocess.run(["bash", "ci/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    summary, rows = lines[-1], lines[:-1]
    assert proc.stdout.strip().splitlines()[-1].startswith('{"dry_run": true')
    assert summary["dry_run"] is True and summary["checks"] == len(rows) == len(_driver().CHECKS)
    assert summary["platform"] and "cpu" not in summary["platform"].values(), summary
    assert summary["unresolved"] == []
    for row in rows:
        assert row["parser"] == "ok" and row["import_errors"] == [], row
    names = {r["check"] for r in rows}
    assert {"fsdp2_equivalence", "megatron_equivalence", "megatron_per_token", "main_ppo_vllm", "sparse_sync",
            "host_buckets"} <= names
    per_token = next(r for r in rows if r["check"] == "megatron_per_token")
    assert "--per-token-loss" in per_token["cmd"] and per_token["cmd"][per_token["cmd"].index("--tp") + 1] == "1"


def test_the_callers_platform_is_kept_and_cpu_is_refused(monkeypatch):
    gpu_check = _driver()
    check = next(c for c in gpu_check.CHECKS if c.name == "core_buffers")  # the cheapest imports
    assert gpu_check.platform_of(gpu_check.check_env(check, {})) == "nvidia"
    assert gpu_check.platform_of(gpu_check.check_env(check, {"VERL_PLATFORM": "rocm"})) == "rocm"
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    row = gpu_check.dry_run_row(check)
    assert row["platform"] == "cpu" and row["resolved"] is False
    assert gpu_check.run_check(check, gpus=1, left_s=600)["status"] == "refused"  # before starting anything
