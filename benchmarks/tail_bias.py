"""What tail batching does to the batch it trains: lengths, turns, deferrals and the reward curve, beside Sync.

Why:
1. Tail batching (``thundersync.tail.eta`` > 1) trains the first P prompt groups of ceil(eta x P) to complete, so
   a step's batch leans toward groups that finish early: fewer turns, shorter responses. Deferred prompts come back
   in later rounds (pinned after ``max_deferrals`` aborts), which is meant to pay that back over the run. This
   measures it instead of assuming it: each mode trains from the same start (model, data order, seeds, settings) for
   the same steps on real rollouts (the ``hf_cpu`` engine), Sync, plain ThunderSync and ThunderSync with tail
   batching, and compares the trajectories each step TRAINED.
2. Tasks: ``embedded`` (the CPU recipe's arithmetic task with its python tool, as ``benchmarks/modes.py`` runs it:
   16 prompts x 4 per step) and ``swe`` (the synthetic SWE-smith set through the SWE agent loop and the kernel
   sandbox, ``recipes/swe_smith/cpu_synthetic.yaml``: 8 instances x 2). The tiny model solves no SWE task (reward 0):
   there the lengths and turns are what can move.
3. Trained trajectories: the ThunderSync modes' step trace (one record per trajectory a step trained); Sync trains
   every trajectory its agent loop finished (its trace). For the tail mode, the agent loop's trace also holds the
   trajectories of aborted groups that finished before their abort: ``launched_*`` describes all of them.
4. Figures per mode: response tokens (mean, p50, p90), turns (mean, histogram), reward per step (``critic/score/mean``)
   and its mean over the last 10 steps; for the tail: the share of trained prompts that had been deferred, their
   delay in rounds, aborted groups per step; and the tail's shift against Sync and plain ThunderSync (ratio of
   means, two-sample Kolmogorov-Smirnov distance of trained response lengths). PNG: the reward curves and the
   distribution of trained response lengths (``tail_bias_<task>.png``).
Run: python benchmarks/tail_bias.py [--task embedded|swe] [--steps 30] [--eta 1.25] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts: modes, swe_synthetic
import modes  # noqa: E402
from emulated_tail import tail_figures  # noqa: E402
from thundersync_verl.demo import prepare_inputs, run_env, run_verl  # noqa: E402
from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result  # noqa: E402

MODES = ("sync", "thundersync", "thundersync_tail")


def run_embedded(mode: str, steps: int, work: Path, eta: float) -> dict:
    """One mode on the embedded task (``modes.run_mode``: the CPU recipe at the calibrated latency scale)."""
    inputs = prepare_inputs(work)
    base, extra, tag = (("thundersync", [f"thundersync.tail.eta={eta}"], "_tail") if mode == "thundersync_tail"
                        else (mode, [], ""))
    run = modes.run_mode(base, steps, inputs, work, tag=tag, extra=extra + ["thundersync.timeline_every=0"])
    return {**run, "loop_trace": run["traj_path"], "step_trace": run["run_dir"] / "grpo_thundersync.jsonl"}


def run_swe(mode: str, steps: int, work: Path, eta: float) -> dict:
    """One mode on the synthetic SWE set (``swe_synthetic.train_command``), the data built once."""
    from swe_synthetic import train_command
    from thundersync_verl.data.swe_synthetic import generate
    from thundersync_verl.models import ensure_tiny_models

    if not (work / "data" / "instances.jsonl").is_file():
        generate(work / "data", 24)
    base, extra = (("thundersync", [f"thundersync.tail.eta={eta}"]) if mode == "thundersync_tail" else (mode, []))
    run_dir = work / mode
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("*.jsonl"):  # the recorders append
        stale.unlink()
    cmd = train_command(work / "data", ensure_tiny_models(variants=("student",))["student"], run_dir, steps, base) + extra + ["thundersync.timeline_every=0"]
    env = run_env(run_dir, run_dir / "metrics.jsonl")
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ts_ray_")
    print(f"[tail_bias] swe {mode}: {steps} steps (log: {run_dir / 'verl.log'})", flush=True)
    per_step = run_verl(cmd, env, run_dir / "verl.log", steps)
    return {"per_step": per_step, "run_dir": run_dir, "loop_trace": run_dir / "swe_trajectories.jsonl",
            "step_trace": run_dir / "grpo_thundersync.jsonl"}


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def trained(mode: str, run: dict) -> list[dict]:
    """The trajectories the run trained (point 3): ``response_tokens`` and ``turns`` of each."""
    if mode == "sync":
        return _lines(run["loop_trace"])
    return [r for r in _lines(run["step_trace"]) if r.get("kind") == "trajectory"]


def lengths(rows: list[dict]) -> dict:
    tokens = np.asarray([r["response_tokens"] for r in rows], dtype=np.float64)
    turns = np.asarray([len(r["turns"]) for r in rows], dtype=np.int64)
    if not len(tokens):
        return {"n": 0}
    hist = {int(k): int(v) for k, v in zip(*np.unique(turns, return_counts=True))}
    return {"n": int(len(tokens)), "response_tokens_mean": round(float(tokens.mean()), 2),
            "response_tokens_p50": float(np.percentile(tokens, 50)), "response_tokens_p90": float(np.percentile(tokens, 90)),
            "turns_mean": round(float(turns.mean()), 3), "turns_hist": hist}


def ks_distance(a: list[float], b: list[float]) -> float:
    """Two-sample Kolmogorov-Smirnov distance: the largest gap between the two empirical CDFs."""
    a, b = np.sort(np.asarray(a, dtype=np.float64)), np.sort(np.asarray(b, dtype=np.float64))
    grid = np.concatenate([a, b])
    return float(np.abs(np.searchsorted(a, grid, "right") / len(a) - np.searchsorted(b, grid, "right") / len(b)).max())


def summary(mode: str, run: dict) -> dict:
    steps = [run["per_step"][s] for s in sorted(run["per_step"])]
    rewards = [round(float(m.get("critic/score/mean", 0.0)), 4) for m in steps]
    out = {"trained": lengths(trained(mode, run)), "reward_curve": rewards,
           "reward_last10_mean": round(statistics.mean(rewards[-10:]), 4) if rewards else None,
           "step_time_s": round(statistics.median(m["timing_s/step"] for m in steps[1:] or steps), 3),
           "staleness_max": max(float(m.get("training/off_policy/trajectory_staleness/max", 0.0)) for m in steps)}
    if mode == "thundersync_tail":
        out["launched"] = lengths(_lines(run["loop_trace"]))
        out.update({k: v for k, v in tail_figures(run).items() if k != "per_step"})
    return out


def shifts(rows: dict, runs: dict) -> dict:
    """The tail's trained batch against each other mode's: ratios of means and the KS distance of response lengths."""
    if "thundersync_tail" not in rows:
        return {}
    tail = rows["thundersync_tail"]["trained"]
    tail_tokens = [r["response_tokens"] for r in trained("thundersync_tail", runs["thundersync_tail"])]
    out = {}
    for other in (m for m in rows if m != "thundersync_tail" and rows[m]["trained"]["n"]):
        ref = rows[other]["trained"]
        out[f"vs_{other}"] = {
            "response_tokens_mean_ratio": round(tail["response_tokens_mean"] / ref["response_tokens_mean"], 4),
            "turns_mean_ratio": round(tail["turns_mean"] / ref["turns_mean"], 4),
            "response_tokens_ks": round(ks_distance(tail_tokens, [r["response_tokens"] for r in trained(other, runs[other])]), 4),
            "reward_last10_diff": round(rows["thundersync_tail"]["reward_last10_mean"] - rows[other]["reward_last10_mean"], 4)}
    return out


def plot(rows: dict, runs: dict, path: Path, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, row in rows.items():
        left.plot(range(1, len(row["reward_curve"]) + 1), row["reward_curve"], label=mode)
        tokens = np.sort([r["response_tokens"] for r in trained(mode, runs[mode])])
        if len(tokens):
            right.step(tokens, np.arange(1, len(tokens) + 1) / len(tokens), where="post", label=mode)
    left.set(xlabel="step", ylabel="reward (critic/score/mean)", title=f"{task}: reward per step")
    right.set(xlabel="response tokens", ylabel="share of trained trajectories", title="trained response lengths (CDF)")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="embedded", choices=["embedded", "swe"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="6 steps per mode")
    ap.add_argument("--eta", type=float, default=1.25, help="thundersync.tail.eta of the tail mode (> 1)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--work-dir", default="runs/tail_bias")
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    chosen = [m for m in args.modes.split(",") if m]
    if not chosen or any(m not in MODES for m in chosen):
        ap.error(f"--modes {args.modes!r}: each must be one of {','.join(MODES)}")
    if not args.eta > 1.0:
        ap.error(f"--eta {args.eta}: tail batching launches more groups than the batch needs, so eta must be > 1")
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: at least 2 (the step times skip the first)")
    results_dir = find_results_dir(args.results_dir)  # refuse before the runs, not after
    steps = 6 if args.quick else args.steps
    work = Path(args.work_dir).resolve() / args.task
    t0 = time.time()
    runner = run_embedded if args.task == "embedded" else run_swe
    runs = {m: runner(m, steps, work, args.eta) for m in chosen}
    rows = {m: summary(m, runs[m]) for m in chosen}
    name = f"tail_bias_{args.task}" + ("_quick" if args.quick else "")
    png = results_dir / f"{name}.png"
    plot(rows, runs, png, args.task)
    result = {"task": args.task, "steps": steps, "eta": args.eta, "modes": rows, "tail_shift": shifts(rows, runs),
              "png": png.name, "seconds": round(time.time() - t0, 1)}
    write_result(name, result, results_dir)
    return result


if __name__ == "__main__":
    main()
