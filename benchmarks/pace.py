"""PACE vs unfiltered fully-async vs verl's drop threshold vs Sync, at equal wall-clock, on verl's real main_ppo.

Why this benchmark exists:
1. PACE (``thundersync_verl/algos/pace/pace_sampler.py``, formulas in ``core/pace.py``) claims lower effective
   staleness for a bounded share of regenerated groups. That is measured here on the stack users
   run: stock ``python -m verl.trainer.main_ppo`` with the ``recipes/cpu_tiny`` overlay, started by
   ``benchmarks/modes.py``'s ``run_mode`` (imported, not copied), one run per policy:
     sync              mode=sync (on-policy; verl's sync buffer)
     fully_async       mode=fully_async, the PACE buffer with gain 0 (observes only), no threshold
     fully_async_drop  as above with verl's max_off_policy_threshold=DROP_THRESHOLD, strategy drop
     pace              mode=fully_async, the PACE buffer with PACE_OPTIONS, no threshold
     pace_measured     as pace, with the measured drift: each trajectory re-scored once by the rollout
                       server holding the newest weights (pace.scorer=rollout_server; ``algos/pace/pace_scorer.py``)
                       instead of the version-count proxy; its cost is in the JSON (``scorer_s``)
     pace_rescored     as pace_measured, re-scored at every new learner version (pace.rescore=decision),
                       so the measured drift also covers the wait, which then has weight 0
   Every async policy runs the same buffer class, so the staleness histograms come from one
   instrument (its decision log); all share ``ASYNC_SHARED`` (a two-batch prefetch window, so
   a pool of finished groups forms on this CPU).
2. Equal wall-clock budget: the training clock of a run is the sum of verl's ``timing_s/step``
   from step 2 on (start-up and the warm-up step excluded); the budget is the shortest run's
   clock, and every figure (final reward = mean reward of the last 3 steps inside the budget,
   staleness, rejected share) counts only the steps that ended inside it. The budget in
   seconds is in the JSON (``wall_clock_budget_s``).
3. The simulator's prediction for the same runs: the unfiltered fully-async run's trace replayed
   (``sim.trace.replay``) under each async policy (``sim/sim_pace.py``), with the trainer's 2-prompt
   mini-batches (the trace's one learner record per step spread over them), the Sync run's under
   Sync. The simulator's staleness is v - (start version); verl's, v - (last version used). The
   simulator has no token log-probs, so ``pace_measured`` has no prediction.
   Landing latency (done -> sampleable): verl's trainer records no reward timing, and the replay's
   fit from the learner's first op (``sim/calibrate.py``) is not pinned down by a run whose learner
   never waited for data: it explained step 2's 0.55 s of untimed start by a 4.7 s landing, so the
   batch started at a push was still landing at the next step and PACE's pool held 16 groups where
   the sampler saw 32 (budget 3, not 11). The latency is measured instead from what the sampler
   saw: the unfiltered run's decision log counts the pool at every sample, and the h whose
   prediction (groups whose last trajectory ended h before the sample, less those already taken)
   fits those counts best (least squares, ``pool_landing_s``) is written into the trace as each
   trajectory's t_reward. The prediction is also read over the steps the measured run counted
   (``*_in_budget``, from ``sim/sim_pace.py``'s ``per_step``); the whole simulated run has more steps.
4. Output: a table, ``benchmarks/results/pace.png`` (reward against training clock, staleness
   distributions), ONE JSON line at the end and ``benchmarks/results/pace.json``.

    python benchmarks/pace.py [--quick] [--steps 16] [--policies sync,fully_async,fully_async_drop,pace,pace_measured,pace_rescored]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script modes.py
import modes  # noqa: E402

from thundersync_verl.demo import prepare_inputs  # noqa: E402
from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result  # noqa: E402

POLICIES = ("sync", "fully_async", "fully_async_drop", "pace", "pace_measured", "pace_rescored")
DROP_THRESHOLD = 2  # verl's span bound (global_steps - dispatch step + 1), strategy drop
PACE_OPTIONS = {"target_pool": 8, "gain": 0.5, "min_score": 1.0, "waiting_weight": 1.0, "drift_per_version": 1.0,
                "prefix_carry": 0.5, "decide_every": "step"}
MEASURED_OPTIONS = {"scorer": "rollout_server"}  # pace_measured: PACE_OPTIONS plus these
RESCORED_OPTIONS = {"scorer": "rollout_server", "rescore": "decision", "waiting_weight": 0.0}  # pace_rescored
ASYNC_SHARED = ["trainer.v1.separate_async.num_warmup_batches=2"]
SAMPLER = ["trainer.v1.sampler.custom_sampler.path=pkg://thundersync_verl.algos.pace.pace_sampler",
           "trainer.v1.sampler.custom_sampler.name=PaceReplayBufferAsync"]
ROLLOUT_N = 4  # trajectories per prompt in recipes/cpu_tiny/grpo.yaml
MINI_BATCH_TRAJECTORIES = 2 * ROLLOUT_N  # recipes/cpu_tiny/mode/fully_async.yaml: ppo_mini_batch_size 2 prompts
LAST = 3  # steps averaged for the final reward
HIST = ("0", "1", "2", "3", "4plus")


def policy_overrides(policy: str, log_path: Path) -> tuple[str, list[str]]:
    """(modes.py mode, extra hydra overrides) of one policy."""
    if policy == "sync":
        return "sync", []
    pace = dict(PACE_OPTIONS) if policy.startswith("pace") else {"gain": 0.0}
    pace.update({"pace_measured": MEASURED_OPTIONS, "pace_rescored": RESCORED_OPTIONS}.get(policy, {}))
    pace["log_path"] = str(log_path)
    threshold = DROP_THRESHOLD if policy == "fully_async_drop" else "null"
    kwargs = [f"+trainer.v1.sampler.sampler_kwargs.pace.{k}={v}" for k, v in pace.items()]
    return "fully_async", ASYNC_SHARED + SAMPLER + kwargs + [f"trainer.v1.sampler.max_off_policy_threshold={threshold}"]


def run_policy(policy: str, steps: int, inputs: dict, work: Path, scale: float) -> dict:
    log_path = work / f"pace_{policy}" / "pace_decisions.jsonl"
    log_path.unlink(missing_ok=True)
    mode, extra = policy_overrides(policy, log_path)
    run = modes.run_mode(mode, steps, inputs, work, latency_scale=scale, tag=f"_pace_{policy}", extra=extra)
    run["mode"], run["decisions"] = mode, _read_jsonl(log_path)
    return run


def load_policy(policy: str, work: Path) -> dict:
    """A finished run of ``policy`` read back from its folders (``--reuse``): verl's per-step metrics
    (its file logger's metrics.jsonl) and the decision log."""
    mode, _ = policy_overrides(policy, Path())
    run_dir = work / f"{mode}_pace_{policy}"
    per_step = {int(r["step"]): r["data"] for r in _read_jsonl(run_dir / "metrics.jsonl")}
    if not per_step:
        raise FileNotFoundError(f"--reuse: no metrics in {run_dir}; run benchmarks/pace.py without --reuse first")
    return {"per_step": per_step, "run_dir": run_dir, "traj_path": run_dir / "trajectories.jsonl", "mode": mode,
            "decisions": _read_jsonl(work / f"pace_{policy}" / "pace_decisions.jsonl")}


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def training_clock(per_step: dict) -> dict[int, float]:
    """step -> seconds of training when it ended (sum of timing_s/step from step 2; step 1 at 0)."""
    clock, t = {}, 0.0
    for s in sorted(per_step):
        if s > min(per_step):
            t += per_step[s]["timing_s/step"]
        clock[s] = t
    return clock


def summarise(policy: str, run: dict, budget_s: float) -> dict:
    """The policy's figures over the steps that ended inside the budget."""
    per_step, clock = run["per_step"], training_clock(run["per_step"])
    inside = [s for s in sorted(per_step) if clock[s] <= budget_s + 1e-6]
    rewards = [per_step[s].get("critic/score/mean", 0.0) for s in inside]
    stale = [per_step[s].get("training/off_policy/trajectory_staleness/mean", 0.0) for s in inside]
    decisions = [d for d in run["decisions"] if d["step"] in set(inside)]
    rejected = sum(len(d["rejected"]) for d in decisions)
    evicted = sum(per_step[s].get("training/off_policy/evicted_samples", 0.0) for s in inside)
    sampled = sum(len(d["selected"]) for d in decisions) if decisions else 0
    values = [v for d in decisions for v in d["selected_staleness"]]
    hist = [0] * len(HIST)
    for v in values:
        hist[min(max(int(v), 0), len(HIST) - 1)] += 1
    if policy == "sync":  # on-policy: every trajectory of every step at 0 (verl's per-step max says so)
        if any(per_step[s].get("training/off_policy/trajectory_staleness/max", 0.0) != 0 for s in inside):
            raise RuntimeError("the sync run trained a stale trajectory; its histogram cannot be read off the max")
        hist[0] = modes.BATCH_PROMPTS * ROLLOUT_N * len(inside)
    return {
        "steps_inside_budget": len(inside),
        "step_time_s": (clock[inside[-1]] / max(len(inside) - 1, 1)) if inside else None,
        "final_reward": sum(rewards[-LAST:]) / max(len(rewards[-LAST:]), 1),
        "staleness_mean": sum(stale) / max(len(stale), 1),
        "staleness_hist": dict(zip(HIST, hist)),
        "rejected_groups": int(rejected + evicted),
        "rejected_share": (rejected + evicted) / max(rejected + evicted + sampled, 1) if policy != "sync" else 0.0,
        "per_turn_share": (sum(d.get("per_turn_share", 0.0) for d in decisions) / len(decisions)) if decisions else None,
        "scored_trajectories": sum(d.get("scored", 0) for d in decisions),
        "scorer_s": sum(d.get("scorer_s", 0.0) for d in decisions),
        "nats_per_version": decisions[-1].get("nats_per_version") if decisions else None,
        "reward_curve": [[round(clock[s], 2), round(per_step[s].get("critic/score/mean", 0.0), 4)] for s in sorted(per_step)],
    }


LANDING_GRID_S = [i * 0.01 for i in range(1001)]  # candidate landing latencies, 0-10 s


def pool_landing_s(run: dict) -> float | None:
    """The landing latency h that best predicts the pool the sampler counted at each sample of an unfiltered run
    (module docstring, point 3); None without a decision log or trajectories."""
    if not run.get("decisions") or not Path(run["traj_path"]).is_file():
        return None
    ready: dict[str, float] = {}  # group -> when its last trajectory ended
    for r in _read_jsonl(Path(run["traj_path"])):
        ready[r["uid"]] = max(ready.get(r["uid"], 0.0), r["t_done"])
    taken: set[str] = set()
    rows = []  # (sample time, groups counted, group ends not yet taken)
    for d in run["decisions"]:
        rows.append((d["t"], d["pool"], sorted(t for u, t in ready.items() if u not in taken)))
        taken |= set(d["selected"]) | set(d["rejected"])
    err = [sum((sum(1 for e in ends if e + h <= t) - pool) ** 2 for t, pool, ends in rows) for h in LANDING_GRID_S]
    return LANDING_GRID_S[min(range(len(err)), key=err.__getitem__)]


def set_trace_landing(path: Path, landing_s: float) -> None:
    """The measured landing as each trajectory's t_reward in a written trace (a latency of 0 as 1 us: t_reward ==
    t_done everywhere means "no reward timing" to the replay, which would fit one again)."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    for r in lines:
        if r["kind"] == "trajectory":
            r["t_reward"] = r["t_done"] + max(landing_s, 1e-6)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _in_budget(per_step: dict, steps: int) -> dict:
    """A simulated policy's rejected share and mean staleness over its first ``steps`` steps."""
    rows = [per_step[s] for s in range(1, steps + 1) if s in per_step]
    rejected, trained = sum(r["rejected"] for r in rows), sum(r["trained"] for r in rows)
    return {"steps_compared": steps, "rejected_share_in_budget": round(rejected / max(rejected + trained, 1), 3),
            "staleness_mean_in_budget": round(sum(r["staleness_sum"] for r in rows) / max(trained, 1), 3)}


def simulate_policies(runs: dict, traces: Path, rewrite: bool = True, windows: dict | None = None) -> dict:
    """The simulator's prediction: the unfiltered fully-async trace replayed under each policy. The trace is
    written from this invocation's runs (``rewrite``); ``--reuse`` reads back the one written with them (the
    runs read back lack the log times a trace needs)."""
    from thundersync_verl.sim import load_trace, replay, simulate
    from thundersync_verl.sim.sim_pace import PacePolicy

    out, windows, written = {}, windows or {}, set()
    sims = {"fully_async": PacePolicy(gain=0.0), "fully_async_drop": PacePolicy(drop_threshold=DROP_THRESHOLD),
            "pace": PacePolicy(**{k: PACE_OPTIONS[k] for k in ("target_pool", "gain", "min_score", "waiting_weight",
                                                               "drift_per_version")})}
    sources = {"sync": "sync"} | {p: "fully_async" for p in sims}
    for policy, base in sources.items():
        if policy not in runs or base not in runs:
            continue
        path = traces / f"pace_{base}.jsonl"
        if base not in written:  # once per trace
            written.add(base)
            if rewrite or not path.is_file():
                modes.write_sim_trace(runs[base]["mode"], runs[base], path)
            landing = pool_landing_s(runs[base]) if base == "fully_async" else None
            if landing is not None:
                set_trace_landing(path, landing)
        trace = load_trace(path)
        cfg, source, costs = replay(trace)
        if policy in sims:  # the trainer's 2-prompt mini-batches (the trace has one learner record per step)
            chunks = max(source.batch_size // MINI_BATCH_TRAJECTORIES, 1)
            cfg = replace(cfg, pace=sims[policy], mini_batch=MINI_BATCH_TRAJECTORIES)
            costs = replace(costs, chunk_overhead_s=costs.chunk_overhead_s / chunks)
        res = simulate(cfg, source, costs)
        summary = res.staleness_summary()
        out[policy] = {"step_time_s": round(res.step_time_s, 3), "staleness_mean": round(summary["mean"], 3),
                       "staleness_hist": {str(k): v for k, v in summary["hist"].items()},
                       "rejected_share": round(res.extra.get("rejected_share", 0.0), 3), "steps": cfg.steps}
        if "per_step" in res.extra and policy in windows:
            out[policy].update(_in_budget(res.extra["per_step"], windows[policy]))
        if base == "fully_async":
            lands = [r["t_reward"] - r["t_done"] for r in trace.trajectories]
            out[policy]["landing_s"] = round(sum(lands) / max(len(lands), 1), 3)
    return out


def plot(rows: dict, budget_s: float, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, r in rows.items():
        xs, ys = zip(*r["reward_curve"]) if r["reward_curve"] else ((), ())
        ax.plot(xs, ys, marker="o", label=policy)
    ax.axvline(budget_s, color="grey", linestyle="--", label=f"budget {budget_s:.0f} s")
    ax.set_xlabel("training clock (s, from the end of step 1)")
    ax.set_ylabel("mean reward")
    ax.legend(fontsize=8)
    width = 0.8 / max(len(rows), 1)
    for i, (policy, r) in enumerate(rows.items()):
        counts = [r["staleness_hist"][h] for h in HIST]
        total = max(sum(counts), 1)
        bx.bar([j + i * width for j in range(len(HIST))], [c / total for c in counts], width, label=policy)
    bx.set_xticks([j + 0.4 - width / 2 for j in range(len(HIST))], HIST)
    bx.set_xlabel("staleness of trained trajectories (versions)")
    bx.set_ylabel("share")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def print_table(rows: dict, sim: dict) -> None:
    print(f"\n{'policy':<17} {'steps':>5} {'step s':>7} {'stale':>6} {'rej share':>9} {'reward':>7} | "
          f"{'sim step s':>10} {'sim stale':>9} {'sim rej':>7} {'same steps':>10}")
    for policy, r in rows.items():
        p = sim.get(policy, {})
        print(f"{policy:<17} {r['steps_inside_budget']:>5} {r['step_time_s'] or 0:>7.2f} {r['staleness_mean']:>6.2f} "
              f"{r['rejected_share']:>9.3f} {r['final_reward']:>7.3f} | {p.get('step_time_s', float('nan')):>10.2f} "
              f"{p.get('staleness_mean', float('nan')):>9.2f} {p.get('rejected_share', float('nan')):>7.3f} "
              f"{p.get('rejected_share_in_budget', float('nan')):>10.3f}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="6 steps per policy (~10 minutes on 2 cores)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--work-dir", default="runs/modes")
    ap.add_argument("--latency-scale", type=float, default=modes.LATENCY_SCALE)
    ap.add_argument("--reuse", action="store_true", help="read the runs of a previous invocation instead of running")
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    results_dir = find_results_dir(args.results_dir)
    steps = 6 if args.quick else args.steps
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        ap.error(f"unknown policies {unknown}; choose from {POLICIES}")
    work = Path(args.work_dir).resolve()
    if args.reuse:
        runs = {p: load_policy(p, work) for p in policies}
        steps = min(max(r["per_step"]) for r in runs.values())
    else:
        inputs = prepare_inputs(work)
        runs = {p: run_policy(p, steps, inputs, work, args.latency_scale) for p in policies}
    budget_s = min(training_clock(r["per_step"])[max(r["per_step"])] for r in runs.values())
    rows = {p: summarise(p, runs[p], budget_s) for p in policies}
    traces = work / "pace_traces"
    traces.mkdir(parents=True, exist_ok=True)
    sim = simulate_policies(runs, traces, rewrite=not args.reuse,
                            windows={p: r["steps_inside_budget"] for p, r in rows.items()})
    print_table(rows, sim)
    results_dir.mkdir(parents=True, exist_ok=True)
    png = plot(rows, budget_s, results_dir / "pace.png")
    result = {"steps": steps, "wall_clock_budget_s": round(budget_s, 2),
              "budget_rule": "equal training clock: sum of verl timing_s/step from step 2, cut at the shortest run",
              "latency_scale": args.latency_scale, "drop_threshold": DROP_THRESHOLD, "pace_options": PACE_OPTIONS,
              "measured_options": MEASURED_OPTIONS, "rescored_options": RESCORED_OPTIONS,
              "async_shared": ASYNC_SHARED, "png": str(png)}
    for key in ("staleness_mean", "rejected_share", "final_reward", "step_time_s", "steps_inside_budget",
                "staleness_hist", "per_turn_share", "scored_trajectories", "scorer_s", "nats_per_version"):
        result[key] = {p: (round(r[key], 4) if isinstance(r[key], float) else r[key]) for p, r in rows.items()}
    result["reward_curves"] = {p: r["reward_curve"] for p, r in rows.items()}
    result["simulated"] = sim
    write_result("pace", result, results_dir)
    return result


if __name__ == "__main__":
    main()
