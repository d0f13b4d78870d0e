"""The SWE path on this CPU: the verifier on every synthetic instance, then stock main_ppo through the SWE agent loop.

1. Builds the synthetic SWE-smith-format set (``python -m thundersync_verl.data.swe_synthetic``: tiny
   repositories with planted bugs, FAIL_TO_PASS / PASS_TO_PASS validated by running the tests).
2. Through the real verifier in the local sandbox, on every instance: the gold fix (the SWE-smith
   ``patch`` reversed) must score 1.0 and doing nothing 0.0 (``gold_pass_rate``, ``noop_pass_rate``).
3. Runs stock ``python -m verl.trainer.main_ppo`` with ``recipes/swe_smith/cpu_synthetic.yaml`` in
   ``mode=thundersync`` (the SWE agent loop, the local sandbox, the project's tiny student) for a few
   steps. The tiny model does not solve SWE tasks; what is measured is that the path runs:
   ``staleness_max`` (verl's ``training/off_policy/trajectory_staleness/max``, must be 0) and
   ``trajectories_lost`` (trajectories the steps expected minus those that reached the learner,
   counted in ThunderSync's step trace; must be 0; other modes write no step trace: null).
4. The local sandbox is the kernel one (``envs/jail.py``) wherever it runs; its start and per-command cost are
   measured beside the older, weaker sandbox's (``sandbox_spawn.shell_costs``), and the agent loop's
   ``sandbox_start_wait_s`` (how long the first tool call or the verifier waited for the start) shows whether
   the start still hides behind the first generation.
5. Ends with ONE line of JSON, also written to ``swe_synthetic.json`` in the results folder
   (``--results-dir``, else ``benchmarks/results/`` of the checkout; ``thundersync_verl/run/results.py``).

    python benchmarks/swe_synthetic.py --quick        # 24 instances checked, 2 training steps
    python benchmarks/swe_synthetic.py --steps 6 --n 12
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from thundersync_verl.data.swe_synthetic import catalog_bugs, generate
from thundersync_verl.demo import run_env, run_verl
from thundersync_verl.envs import jail
from thundersync_verl.envs.swe import swe_verifier as verifier
from thundersync_verl.envs.swe.swe_config import DEFAULT_TEST_COMMAND
from thundersync_verl.envs.swe.instance import SWEInstance
from thundersync_verl.envs.swe.swe_sandbox import LocalWorkspace
from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script: shell_costs
from sandbox_spawn import shell_costs  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE_DIR = REPO_ROOT / "recipes" / "swe_smith"
VERIFIER_TIMEOUT_S = 120.0
CONCURRENCY = 2


async def _score(instance: SWEInstance, repos_dir: Path, *, gold: bool) -> verifier.TestVerdict:
    """One instance through the verifier: the gold fix applied, or nothing done."""
    ws = LocalWorkspace(instance, repos_dir)
    try:
        await ws.start()
        snapshot = await verifier.snapshot_tests(ws, instance)
        if gold:
            await ws.apply_patch(instance.patch, reverse=True)
        return await verifier.verify(ws, instance, snapshot, command=DEFAULT_TEST_COMMAND, timeout_s=VERIFIER_TIMEOUT_S)
    finally:
        await ws.close()


async def check_gold_and_noop(instances: list[SWEInstance], repos_dir: Path) -> dict:
    """Point 2: every instance scored with the gold fix and with no change."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(inst: SWEInstance, gold: bool) -> verifier.TestVerdict:
        async with gate:
            return await _score(inst, repos_dir, gold=gold)

    gold = await asyncio.gather(*(one(i, True) for i in instances))
    noop = await asyncio.gather(*(one(i, False) for i in instances))
    failures = [f"{i.instance_id}: gold {g.reason} / no-op {n.reason}" for i, g, n in zip(instances, gold, noop)
                if g.score != 1.0 or n.score != 0.0]
    return {"gold_pass_rate": sum(v.score for v in gold) / len(instances),
            "noop_pass_rate": sum(v.score for v in noop) / len(instances),
            "verifier_s_mean": round(sum(v.test_s for v in gold + noop) / (2 * len(instances)), 3),
            "failures": failures}


def train_command(data_dir: Path, model: Path, run_dir: Path, steps: int, mode: str) -> list[str]:
    """Stock main_ppo with the cpu_synthetic recipe (point 3)."""
    import sys

    train = data_dir / "train.parquet"
    return [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={RECIPE_DIR}", "--config-name=cpu_synthetic",
            f"data.train_files={train}", f"data.val_files={train}", f"actor_rollout_ref.model.path={model}",
            f"trainer.total_training_steps={steps}", f"mode={mode}", f"trainer.experiment_name=swe_synthetic_{mode}",
            f"swe.repos_dir={data_dir / 'repos'}", f"swe.trace_path={run_dir / 'swe_trajectories.jsonl'}",
            f"thundersync.run_dir={run_dir}"]


def training_summary(per_step: dict, run_dir: Path, *, steps: int, expected_per_step: int, mode: str) -> dict:
    """Staleness, trajectories accounted for, and what the agent loop recorded (point 3)."""
    step_trace = run_dir / f"grpo_{mode}.jsonl"  # ThunderSync's step recorder: the trajectories each step learned from
    records = [json.loads(x) for x in step_trace.read_text().splitlines()] if step_trace.exists() else []
    swe_path = run_dir / "swe_trajectories.jsonl"
    loop_rows = [json.loads(x) for x in swe_path.read_text().splitlines()] if swe_path.exists() else []
    learned = [r for r in records if r.get("kind") == "trajectory"] if step_trace.exists() else None
    staleness = [m.get("training/off_policy/trajectory_staleness/max") for m in per_step.values()]
    mean = lambda xs: round(sum(xs) / len(xs), 3) if xs else None  # noqa: E731
    return {
        "steps": len(per_step),
        "staleness_max": max((s for s in staleness if s is not None), default=None),
        "trajectories_expected": steps * expected_per_step,
        "trajectories_learned": None if learned is None else len(learned),  # other modes write no step trace
        "trajectories_lost": None if learned is None else steps * expected_per_step - len(learned),
        "agent_loop_trajectories": len(loop_rows),
        "reward_mean": mean([float(m.get("critic/score/mean", 0.0)) for m in per_step.values()]),
        "step_time_s": mean([m["timing_s/step"] for m in per_step.values() if "timing_s/step" in m]),
        "tool_calls_per_trajectory": mean([sum(1 for t in r["turns"] if "tool" in t) for r in loop_rows]),
        "sandbox_start_s_mean": mean([r["sandbox_start_s"] for r in loop_rows if r.get("sandbox_start_s")]),
        "sandbox_start_wait_s_mean": mean(waits := [r["sandbox_start_wait_s"] for r in loop_rows
                                                    if r.get("sandbox_start_wait_s") is not None]),
        "sandbox_start_wait_s_max": round(max(waits), 6) if waits else None,
        "first_generation_s_mean": mean([r["turns"][0]["gen_s"] for r in loop_rows if r.get("turns")]),
        "test_s_mean": mean([r["test_s"] for r in loop_rows]),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="every instance checked, 2 training steps")
    ap.add_argument("--steps", type=int, default=4, help="training steps (--quick: 2)")
    ap.add_argument("--n", type=int, default=len(catalog_bugs()), help="synthetic instances to build and check")
    ap.add_argument("--mode", default="thundersync", choices=["sync", "async", "fully_async", "thundersync"])
    ap.add_argument("--work-dir", default="runs/swe_synthetic")
    ap.add_argument("--model", default=None, help="an HF model folder instead of the tiny student")
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    if not 1 <= args.n <= len(catalog_bugs()):
        ap.error(f"--n must be between 1 and {len(catalog_bugs())} (the synthetic catalog's planted bugs), got {args.n}")
    results_dir = find_results_dir(args.results_dir)  # refuse before the run, not after
    steps = 2 if args.quick else args.steps
    work = Path(args.work_dir).resolve()
    t0 = time.time()
    print(f"[swe] building {args.n} synthetic instances under {work / 'data'}", flush=True)
    generate(work / "data", args.n)
    rows = [json.loads(x) for x in (work / "data" / "instances.jsonl").read_text().splitlines()]
    checks = asyncio.run(check_gold_and_noop([SWEInstance.from_row(r) for r in rows], work / "data" / "repos"))
    print(f"[swe] verifier: gold {checks['gold_pass_rate']:.3f}, no-op {checks['noop_pass_rate']:.3f} "
          f"over {len(rows)} instances ({checks['verifier_s_mean']} s a run)", flush=True)
    for line in checks["failures"]:
        print(f"[swe]   {line}", flush=True)
    costs = shell_costs(*((3, 10) if args.quick else (5, 20)))
    print(f"[swe] sandbox start {costs.get('swe_start_s_kernel')} s (kernel) vs {costs['swe_start_s_weak']} s (older); "
          f"per command {costs.get('swe_command_ms_kernel')} ms vs {costs['swe_command_ms_weak']} ms wall, "
          f"{costs.get('swe_command_cpu_ms_kernel')} ms vs {costs['swe_command_cpu_ms_weak']} ms CPU", flush=True)
    result = _train(args, work, steps)
    print(f"[swe] the first tool call or verifier waited {result['sandbox_start_wait_s_mean']} s on average (at most "
          f"{result['sandbox_start_wait_s_max']} s) for a {result['sandbox_start_s_mean']} s start (first generation "
          f"{result['first_generation_s_mean']} s)", flush=True)
    result = {"gold_pass_rate": round(checks["gold_pass_rate"], 4), "noop_pass_rate": round(checks["noop_pass_rate"], 4),
              "instances": len(rows), "mode": args.mode, "sandbox_isolation": "kernel" if jail.support().ok else "weak",
              **result, **costs, "verifier_s_mean": checks["verifier_s_mean"], "seconds": round(time.time() - t0, 1)}
    write_result("swe_synthetic", result, results_dir)
    return result


def _train(args, work: Path, steps: int) -> dict:
    from omegaconf import OmegaConf

    model = Path(args.model) if args.model else _student()
    run_dir = work / f"train_{args.mode}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("*.jsonl"):  # the recorders append
        stale.unlink()
    cmd = train_command(work / "data", model, run_dir, steps, args.mode)
    env = run_env(run_dir, run_dir / "metrics.jsonl")
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ts_ray_")  # a private Ray session
    print(f"[swe] main_ppo mode={args.mode}, {steps} steps (log: {run_dir / 'verl.log'})", flush=True)
    per_step = run_verl(cmd, env, run_dir / "verl.log", steps)
    # the recipe's data and rollout keys over the CPU base it composes (``cpu_base: tiny`` in its defaults)
    recipe = OmegaConf.merge(OmegaConf.load(RECIPE_DIR / "cpu_base" / "tiny.yaml"),
                             OmegaConf.load(RECIPE_DIR / "cpu_synthetic.yaml"))
    per_step_rows = int(recipe.data.train_batch_size) * int(recipe.actor_rollout_ref.rollout.n)
    return training_summary(per_step, run_dir, steps=steps, expected_per_step=per_step_rows, mode=args.mode)


def _student() -> Path:
    from thundersync_verl.models import ensure_tiny_models

    return ensure_tiny_models(variants=("student",))["student"]


if __name__ == "__main__":
    main()
