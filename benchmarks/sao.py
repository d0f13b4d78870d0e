"""SAO on the embedded CPU task: stock ``verl.trainer.main_ppo`` with the ``sao`` recipe, one JSON line.

``python benchmarks/sao.py [--mode sync|async|fully_async|thundersync] [--steps 30]`` (``--quick``: 8 steps).

Why:
1. SAO must train through verl's own machinery: one rollout per prompt on the live ``hf_cpu`` rollout,
   verl's critic worker as the value model (``critic.ppo_epochs`` = 2 critic updates per policy update,
   ``trainer.critic_warmup`` critic-only steps), the registered ``sao`` estimator (GAE over agent tokens,
   Monte-Carlo targets) and ``sao`` policy loss (double-sided mask against the rollout log-probs).
   Nothing of verl's loop is re-implemented: this script builds the inputs, launches
   ``recipes/cpu_tiny/sao/sao.yaml`` and reads verl's step metrics.
2. Output: ONE JSON line (also ``benchmarks/results/sao_<mode>.json``) with ``reward_first5``,
   ``reward_last5`` (verl's ``critic/score/mean``), ``value_explained_variance_last``
   (``critic/vf_explained_var``: the values the step's advantages used against its Monte-Carlo
   returns), ``value_loss_last`` (``critic/vf_loss``), steps, mode; and a PNG of the three curves.
3. ``gap_over_floor``: the streamed SAO actor update (``algos/sao/sao_streaming.py``: single-rollout trajectories
   arriving in a random order, each backpropagated at arrival with its final GAE coefficients, the batch
   whitening folded at the barrier) against verl's own ``update_actor`` with loss ``sao`` on the same batch,
   on verl's FSDP2 engine on the CPU (``tests/harness/sao_steps.py``); the floor is verl's update with the
   rows regrouped across micro-batches, and the figure is the worst step's gap / floor (acceptance: <= 2).
   It is an engine-level measurement of the same streamed update the ThunderSync trainer runs with
   ``--mode thundersync`` (``algos/sao/sao_trainer_step.py``: the critic's forward on each arrival, the actor's
   backwards streamed, verl's own critic update at the barrier, not streamed).
   ``--gap-only`` measures it without the main_ppo run, and with it ``critic_gap_over_floor``: the streamed
   critic update (``algos/sao/critic_stream.py``: c_t = V_t - G_t per agent token at arrival, 1/N at the barrier)
   against verl's own ``train_mini_batch`` with its value loss on the FSDP2 critic engine
   (``tests/harness/critic_steps.py``; floor: verl's update with the rows regrouped; ``critic_control_gap``: the
   stream with the normaliser left off, which must be far off).
4. ``staleness_max``: verl's ``training/off_policy/trajectory_staleness/max`` over the run (0 for sync and
   thundersync); ``step_s_mean``: the mean of verl's ``timing_s/step`` after step 1.
5. Every mode's critic starts from one value-model checkpoint made from the student with a value head
   drawn from seed 0 (``models/value_model.py``; verl would draw the head anew in each run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from thundersync_verl.demo import prepare_inputs, run_env, run_verl
from thundersync_verl.models.value_model import write_value_model
from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "cpu_tiny" / "sao"
MODES = ("sync", "async", "fully_async", "thundersync")
CURVES = (("critic/score/mean", "mean reward"), ("critic/vf_loss", "value loss"),
          ("critic/vf_explained_var", "explained variance"))


def sao_command(inputs: dict, *, mode: str, steps: int, warmup: int, critic_epochs: int, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={RECIPE}", "--config-name=sao",
        f"data.train_files={inputs['train']}", f"data.val_files={inputs['val']}",
        f"actor_rollout_ref.model.path={inputs['student']}", f"trainer.total_training_steps={steps}",
        f"mode={mode}", f"trainer.experiment_name=sao_{mode}", f"trainer.critic_warmup={warmup}",
        f"critic.ppo_epochs={critic_epochs}", *extra,
    ]


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x == x]
    return round(sum(xs) / len(xs), 4) if xs else None


def _last(per_step: dict, key: str) -> float | None:
    vals = [per_step[s][key] for s in sorted(per_step) if key in per_step[s] and per_step[s][key] == per_step[s][key]]
    return round(vals[-1], 4) if vals else None


def summarise(per_step: dict, *, mode: str, seconds: float, warmup: int, critic_epochs: int) -> dict:
    steps = sorted(per_step)
    rewards = [per_step[s].get("critic/score/mean", float("nan")) for s in steps]
    k = min(5, len(rewards))
    actor_steps = [s for s in steps if "actor/pg_loss" in per_step[s] or per_step[s].get("thundersync/chunks", 0) > 0]
    staleness = [per_step[s]["training/off_policy/trajectory_staleness/max"] for s in steps
                 if "training/off_policy/trajectory_staleness/max" in per_step[s]]
    step_s = [per_step[s]["timing_s/step"] for s in steps[1:] if "timing_s/step" in per_step[s]]
    return {
        "algo": "sao", "mode": mode, "steps": len(steps),
        "reward_first5": _mean(rewards[:k]), "reward_last5": _mean(rewards[-k:]),
        "value_explained_variance_last": _last(per_step, "critic/vf_explained_var"),
        "value_explained_variance_first": next((round(per_step[s]["critic/vf_explained_var"], 4) for s in steps
                                                if "critic/vf_explained_var" in per_step[s]), None),
        "value_loss_last": _last(per_step, "critic/vf_loss"),
        "value_loss_first": next((round(per_step[s]["critic/vf_loss"], 4) for s in steps if "critic/vf_loss" in per_step[s]), None),
        "masked_frac_mean": _mean([per_step[s]["actor/sao_masked_frac"] for s in actor_steps
                                   if "actor/sao_masked_frac" in per_step[s]]),
        "critic_warmup": warmup, "critic_ppo_epochs": critic_epochs,
        "staleness_max": max(staleness) if staleness else None, "step_s_mean": _mean(step_s),
        "first_actor_step": actor_steps[0] if actor_steps else None,
        "seconds": round(seconds, 1),
    }


def measure_gap(work: Path, steps: int, dp: int = 1) -> dict:
    """Streamed SAO actor step vs verl's ``update_actor`` (loss sao) on the FSDP2 CPU engine (point 3)."""
    import shutil

    from thundersync_harness import engine_setup as setup
    from thundersync_harness.sao_steps import run_sao_equivalence

    saved = dict(os.environ)
    ray_tmp = setup.prepare_environment()
    try:
        model, pad_id, vocab = setup.build_tiny_model(work / "engine_model")
        res = run_sao_equivalence(model, pad_id, vocab, groups=2, micro=4, steps=steps, dp=dp)
    finally:
        import ray

        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        os.environ.clear()
        os.environ.update(saved)
    per_step = res["steps"]
    for i, s in enumerate(per_step, 1):
        print(f"[sao] engine step {i}: gap {s['gap']:.3e} floor {s['floor']:.3e} gap/floor {s['gap_over_floor']:.2f} "
              f"||dθ|| {s['update_norm']:.3e} grad norm stream/sync {s['grad_norm_stream']:.6f}/{s['grad_norm_sync']:.6f}",
              flush=True)
    worst = max(per_step, key=lambda s: s["gap_over_floor"])
    return {"gap_over_floor": round(worst["gap_over_floor"], 3), "gap": worst["gap"], "floor": worst["floor"],
            "gap_over_floor_steps": [round(s["gap_over_floor"], 3) for s in per_step], "gap_rows": res["rows"], "gap_dp": dp,
            "gap_over_floor_status": "measured: streamed SAO actor update vs verl's update_actor (loss sao), "
                                     "FSDP2 CPU engine, floor = verl's update with rows regrouped"}


def measure_critic_gap(work: Path, steps: int, dp: int = 1) -> dict:
    """Streamed critic update vs verl's ``train_mini_batch`` (value loss) on the FSDP2 CPU critic engine (point 3)."""
    from thundersync_harness import engine_setup as setup
    from thundersync_harness.critic_steps import critic_config, run_critic_equivalence, start_critic

    with setup.ray_session():
        model, pad_id, vocab = setup.build_tiny_model(work / "critic_engine_model")
        value = write_value_model(model, work / "critic_engine_value", seed=0)
        wg = start_critic(critic_config(value, groups=2, micro=4), dp=dp)
        res = run_critic_equivalence(wg, pad_id, vocab, groups=2, micro=4, steps=steps, dp=dp)
    per_step = res["steps"]
    for i, s in enumerate(per_step, 1):
        print(f"[sao] critic engine step {i}: gap {s['gap']:.3e} floor {s['floor']:.3e} gap/floor "
              f"{s['gap_over_floor']:.2f} ||dθ|| {s['update_norm']:.3e}", flush=True)
    worst = max(per_step, key=lambda s: s["gap_over_floor"])
    return {"critic_gap_over_floor": round(worst["gap_over_floor"], 3), "critic_gap": worst["gap"],
            "critic_floor": worst["floor"], "critic_gap_over_floor_steps": [round(s["gap_over_floor"], 3) for s in per_step],
            "critic_control_gap": round(res["control_gap"], 3),
            "critic_gap_status": "measured: streamed critic update vs verl's train_mini_batch (value loss), FSDP2 CPU "
                                 "critic engine, floor = verl's update with rows regrouped"}


def plot(per_step: dict, png: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(per_step)
    first_actor = next((s for s in steps if "actor/pg_loss" in per_step[s] or per_step[s].get("thundersync/chunks", 0) > 0), None)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, (key, label) in zip(axes, CURVES):
        ys = [per_step[s].get(key, float("nan")) for s in steps]
        if key == "critic/vf_explained_var":  # a batch whose rewards are all equal has Var(G) = 0: EV -> -inf
            low = [(s, y) for s, y in zip(steps, ys) if y < -1.5]
            ys = [max(y, -1.5) for y in ys]
            for s, y in low:
                ax.annotate(f"{y:.0f}", (s, -1.5), fontsize=7, ha="center", va="bottom")
        ax.plot(steps, ys, marker=".")
        if first_actor is not None:  # verl's critic_warmup=k: steps 1..k-1 update the critic only
            ax.axvline(first_actor - 0.5, color="grey", ls=":", lw=1)
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="sync")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--critic-warmup", type=int, default=3)
    parser.add_argument("--critic-epochs", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="8 steps (2 of them critic-only): a few minutes")
    parser.add_argument("--work-dir", default=str(REPO / "runs" / "sao"))
    parser.add_argument("--gap-steps", type=int, default=None, help="engine steps of the gap measurement (default 2, 1 with --quick)")
    parser.add_argument("--gap-dp", type=int, default=1, help="data-parallel ranks of the gap measurement")
    parser.add_argument("--gap-only", action="store_true", help="only the streamed-vs-verl engine measurement (point 3)")
    parser.add_argument("extra", nargs="*", help="further hydra overrides")
    add_results_dir_argument(parser)
    args = parser.parse_args(argv)
    steps, warmup = (8, 2) if args.quick else (args.steps, args.critic_warmup)
    results_dir = find_results_dir(args.results_dir)
    work = Path(args.work_dir).resolve() / args.mode
    work.mkdir(parents=True, exist_ok=True)
    for stale in work.glob("*.jsonl"):
        stale.unlink()
    gap_steps = args.gap_steps or (1 if args.quick else 2)
    if args.gap_only:
        result = {"algo": "sao", "mode": "engine", **measure_gap(work, gap_steps, args.gap_dp),
                  **measure_critic_gap(work, gap_steps, args.gap_dp)}
        write_result("sao_gap" + (f"_dp{args.gap_dp}" if args.gap_dp > 1 else "") + ("_quick" if args.quick else ""), result, results_dir)
        return result
    inputs = prepare_inputs(work.parent, variants=("student",))
    critic = work.parent / "critic_init"  # the same value head in every mode (models/value_model.py)
    if not (critic / "config.json").is_file():
        write_value_model(inputs["student"], critic, seed=0)
    cmd = sao_command(inputs, mode=args.mode, steps=steps, warmup=warmup, critic_epochs=args.critic_epochs,
                      extra=[f"critic.model.path={critic}", *args.extra])
    print(f"[sao] {' '.join(cmd[1:5])} ... (full log: {work / 'verl.log'})", flush=True)
    t0 = time.time()
    per_step = run_verl(cmd, run_env(work, work / "metrics.jsonl"), work / "verl.log", steps)
    if not per_step:
        raise RuntimeError(f"verl finished without logging a training step; see {work / 'verl.log'}")
    result = summarise(per_step, mode=args.mode, seconds=time.time() - t0, warmup=warmup,
                       critic_epochs=args.critic_epochs)
    result.update(measure_gap(work, gap_steps, args.gap_dp))
    name = f"sao_{args.mode}" + ("_quick" if args.quick else "")
    png = plot(per_step, results_dir / f"{name}.png", f"SAO / {args.mode} on the embedded CPU task "
               f"(n=1, critic_warmup={warmup}, {args.critic_epochs} critic epochs)")
    result["png"] = str(png.relative_to(REPO)) if png.is_relative_to(REPO) else str(png)
    write_result(name, result, results_dir)
    return result


if __name__ == "__main__":
    main()
