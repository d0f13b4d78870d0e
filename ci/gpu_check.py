"""The GPU check's driver (``ci/gpu_check.sh`` runs it): a table of checks, one JSON line per check.

Why:
1. Every GPU path of the project is marked unverified until one command has run it on a GPU machine; this
   table is that command's content: FSDP2 and Megatron equivalence on CUDA, a ThunderSync vs Sync ``main_ppo``
   run with a vLLM rollout, sparse_sync's CUDA codec and NCCL push, the streaming worker's host buckets under a
   budget, and the exactness core's buffer tests. In at most ``DEADLINE_S`` on one H200; a check that needs a
   second GPU runs only where one is visible.
2. The platform is the caller's (``VERL_PLATFORM``, ``nvidia`` when unset) and is never overridden below it:
   each check's platform is what ``thundersync_harness.engine_setup.harness_platform`` (the function the harness
   applies) returns for the environment the check runs with, and the run refuses a check whose platform is
   ``cpu``, or a Python whose torch has no CUDA (the CPU ``.venv`` of ``make``).
3. ``--dry-run`` (any machine, no GPU): every command resolved (the script or module exists, its own
   ``build_parser()`` accepts the arguments), every module the run imports imported (a missing GPU-only
   package such as vllm is reported by name, not raised), the platform of each check printed; exit 0 when
   all resolve, ending with ONE line ``{"dry_run": true, "checks": K, "platform": {...}}``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 570  # the whole check, under 10 minutes with the start-up; one GPU's checks' timeouts sum to it
WORK = "runs/gpu_check"
DEFAULT_PLATFORM = "nvidia"
# Imported lazily by the paths under check and absent from a CPU venv: reported by name, never raised.
GPU_ONLY = ("vllm", "transformer_engine", "cupy", "flash_attn")
HARNESS = ("thundersync_harness.engine_setup", "thundersync_harness.engine_steps",
           "thundersync_verl.learner.streaming_worker", "ray", "transformers", "verl.workers.engine")
MEGATRON = ("thundersync_harness.megatron_engine", "megatron.core", "mbridge", "transformer_engine")


@dataclass(frozen=True)
class Check:
    """One row: ``target`` is a script under the checkout or ``-m module``; ``args`` its arguments."""

    name: str
    what: str
    target: str
    args: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()  # what the run imports beyond the target itself
    env: dict = field(default_factory=dict)
    gpus: int = 1  # GPUs the check needs; skipped (not failed) where fewer are visible
    timeout_s: int = 120


CHECKS = (
    Check("fsdp2_equivalence", "streamed vs verl's update_actor on the FSDP2 engine, CUDA + NCCL, DP 1",
          "benchmarks/equivalence.py", ("--quick", "--dp", "1"), HARNESS, timeout_s=60),
    Check("megatron_equivalence", "the same on verl's Megatron engine, TP 1, bf16 (the harness dtype on a GPU)",
          "benchmarks/equivalence.py", ("--quick", "--engine", "megatron", "--tp", "1"), HARNESS + MEGATRON,
          timeout_s=75),
    Check("megatron_per_token", "Megatron's calculate_per_token_loss regime: streamed vs verl, TP 1, bf16",
          "benchmarks/equivalence.py", ("--quick", "--engine", "megatron", "--tp", "1", "--per-token-loss"),
          HARNESS + MEGATRON + ("thundersync_harness.megatron_per_token",), timeout_s=75),
    Check("sparse_sync", "sparse_sync's codec on CUDA (bit-exact pushes, GB/s) and, with 2 GPUs, the NCCL push",
          "-m thundersync_verl.backends.sparse_sync.gpu_check", (), ("ray", "ray.util.collective", "cupy",
          "thundersync_verl.backends.sparse_sync.sparse_engine", "thundersync_verl.backends.sparse_sync.wire"),
          timeout_s=60),
    Check("host_buckets", "the streaming worker's buckets in host memory under a budget of 2, FSDP2 on CUDA",
          "benchmarks/accumulator_memory.py", ("--quick", "--bucket-device", "host", "--budget-buckets", "2"),
          HARNESS + ("accumulator_memory_engine", "thundersync_verl.core.bucket_memory"), timeout_s=60),
    Check("core_buffers", "the exactness core's buffer and memory tests with CUDA present (pinned host copies)",
          "-m pytest", ("-q", "-p", "no:cacheprovider", "tests/core", "-k", "buffers or memory"),
          ("pytest", "hypothesis", "thundersync_verl.core.buffers"), timeout_s=30),
    Check("main_ppo_vllm", "stock main_ppo, Sync then ThunderSync, 4 steps each: FSDP2 learner + vLLM rollout on "
          "one GPU (Ray's logical slots, CUDA_VISIBLE_DEVICES left alone, weights by cpu_channel)",
          "benchmarks/modes.py",
          ("--modes", "sync,thundersync", "--steps", "4", "--work-dir", WORK, "--results-dir", f"{WORK}/results",
           "--override", "trainer.device=cuda", "--override", "actor_rollout_ref.rollout.name=vllm",
           "--override", "actor_rollout_ref.rollout.gpu_memory_utilization=0.25",
           "--override", "actor_rollout_ref.rollout.enforce_eager=true",
           "--override", "actor_rollout_ref.rollout.free_cache_engine=true",
           "--override", "ray_kwargs.ray_init.num_gpus=3"),
          ("vllm", "verl.trainer.main_ppo", "thundersync_verl.demo", "transfer_queue"),
          env={"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}, timeout_s=210),
    Check("fsdp2_equivalence_dp2", "FSDP2 equivalence across two GPUs (DP 2, NCCL all-reduce)",
          "benchmarks/equivalence.py", ("--quick", "--dp", "2"), HARNESS, gpus=2, timeout_s=60),
)


def check_env(check: Check, base: dict | None = None) -> dict[str, str]:
    """The environment ``check`` runs with: the caller's, the platform defaulted (never replaced) to nvidia."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VERL_PLATFORM", DEFAULT_PLATFORM)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("THUNDERSYNC_RESULTS_DIR", str(ROOT / WORK / "results"))
    benchmarks = str(ROOT / "benchmarks")  # the scripts import their siblings (equivalence, emulated_rollout)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (benchmarks, env.get("PYTHONPATH", "")) if p)
    env.update(check.env)
    return env


def platform_of(env: dict[str, str]) -> str:
    """The platform a check gets: the harness's own rule (``engine_setup.harness_platform``) on its environment."""
    from thundersync_harness.engine_setup import harness_platform

    return harness_platform(env)


def command(check: Check) -> list[str]:
    head = check.target.split() if check.target.startswith("-m ") else [str(ROOT / check.target)]
    return [sys.executable, *head, *check.args]


# ----- dry run -------------------------------------------------------------------------------
def _target_module(check: Check):
    """The target's module, imported as its run would (scripts by path, with benchmarks/ on sys.path)."""
    if check.target.startswith("-m "):
        name = check.target.split()[1]
        return importlib.import_module(name)
    path = ROOT / check.target
    if not path.is_file():
        raise FileNotFoundError(f"no script {check.target}")
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_gpu_check_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _parse(check: Check, module) -> str:
    """``ok`` when the target's own parser accepts ``check.args``; pytest's arguments are checked by pytest."""
    if check.target == "-m pytest":
        missing = [a for a in check.args if a.startswith("tests/") and not (ROOT / a).exists()]
        return f"missing {missing}" if missing else "ok"
    build = getattr(module, "build_parser", None)
    if build is None:
        return f"{check.target} has no build_parser()"
    try:
        build().parse_args(list(check.args))
    except SystemExit as exc:
        return f"its parser refused {list(check.args)} (exit {exc.code})"
    return "ok"


def _imports(names) -> tuple[list[str], list[str], list[str]]:
    """(imported, missing GPU-only packages, other failures as 'name: error')."""
    ok, gpu_missing, errors = [], [], []
    for name in names:
        try:
            importlib.import_module(name)
            ok.append(name)
        except Exception as exc:  # noqa: BLE001 - reported per module
            if name.split(".")[0] in GPU_ONLY and isinstance(exc, ImportError):
                gpu_missing.append(name)
            else:
                errors.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
    return ok, gpu_missing, errors


def dry_run_row(check: Check) -> dict:
    env = check_env(check)
    row = {"check": check.name, "dry_run": True, "platform": platform_of(env), "gpus": check.gpus,
           "timeout_s": check.timeout_s, "cmd": command(check)[1:]}
    try:
        module = _target_module(check)
        row["parser"] = _parse(check, module)
    except Exception as exc:  # noqa: BLE001 - a target that does not resolve is this row's failure
        row["parser"] = f"{type(exc).__name__}: {exc}"[:300]
    row["imported"], row["missing_gpu_only"], row["import_errors"] = _imports(check.modules)
    row["resolved"] = row["parser"] == "ok" and not row["import_errors"] and row["platform"] != "cpu"
    return row


def dry_run(checks=CHECKS) -> int:
    """Print one line per check and the summary line; 0 when every check resolves on a GPU platform."""
    os.environ.update({k: v for k, v in check_env(Check("base", "", "")).items() if k != "PYTHONPATH"})
    rows = []
    for check in checks:
        rows.append(dry_run_row(check))
        print(json.dumps(rows[-1]), flush=True)
    failed = [r["check"] for r in rows if not r["resolved"]]
    summary = {"dry_run": True, "checks": len(rows), "platform": {r["check"]: r["platform"] for r in rows},
               "missing_gpu_only": sorted({m for r in rows for m in r["missing_gpu_only"]}),
               "unresolved": failed, "deadline_s": DEADLINE_S,
               "timeouts_total_s": sum(c.timeout_s for c in checks)}
    print(json.dumps(summary), flush=True)
    return 1 if failed else 0


# ----- the run -------------------------------------------------------------------------------
def _last_json(text: str):
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_check(check: Check, gpus: int, left_s: float) -> dict:
    """Run one check in a subprocess, its output in ``runs/gpu_check/<name>.log``; its JSON row."""
    env = check_env(check)
    row = {"check": check.name, "platform": platform_of(env), "gpus": check.gpus}
    if row["platform"] == "cpu":
        return {**row, "status": "refused", "reason": "VERL_PLATFORM=cpu: this is the GPU check"}
    if gpus < check.gpus:
        return {**row, "status": "skipped", "reason": f"needs {check.gpus} GPUs, {gpus} visible"}
    timeout = min(check.timeout_s, int(left_s))
    if timeout < 30:
        return {**row, "status": "skipped", "reason": f"the {DEADLINE_S}s deadline leaves {int(left_s)}s"}
    log = ROOT / WORK / f"{check.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(command(check), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    text = log.read_text(errors="replace")
    status = "timeout" if rc is None else ("ok" if rc == 0 else "failed")
    row.update({"status": status, "rc": rc, "wall_s": round(time.time() - t0, 1), "log": str(log.relative_to(ROOT)),
                "result": _last_json(text)})
    if status != "ok":
        row["tail"] = text[-1500:]
    return row


def cuda_environment() -> dict:
    """torch's CUDA build and the visible GPUs; ``ok`` False for a CPU torch (the ``.venv`` that make builds)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    return {"check": "environment", "python": sys.executable, "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "gpus": gpus, "names": names,
            "ok": bool(torch.version.cuda) and gpus >= 1}


def run(checks=CHECKS, only: set[str] | None = None) -> int:
    head = cuda_environment()
    print(json.dumps(head), flush=True)
    if not head["ok"]:
        print(json.dumps({"gpu_check": "refused", "reason": "no CUDA torch or no GPU in this Python "
                          "(bash ci/gpu_check.sh creates and uses .venv-gpu)"}), flush=True)
        return 1
    t0, rows = time.time(), []
    for check in checks:
        if only and check.name not in only:
            continue
        rows.append(run_check(check, head["gpus"], DEADLINE_S - (time.time() - t0)))
        print(json.dumps(rows[-1]), flush=True)
    status = {r["check"]: r["status"] for r in rows}
    print(json.dumps({"gpu_check": "done", "wall_s": round(time.time() - t0, 1), "status": status,
                      "platform": {r["check"]: r["platform"] for r in rows}}), flush=True)
    return 0 if all(s in ("ok", "skipped") for s in status.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="resolve every check on any machine; run nothing")
    parser.add_argument("--only", default=None, metavar="NAME,...", help="run these checks only")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    if args.dry_run:
        return dry_run()
    return run(only=set(args.only.split(",")) if args.only else None)


if __name__ == "__main__":
    sys.exit(main())
