"""``thundersync demo``: the embedded CPU run of stock ``verl.trainer.main_ppo``.

1. Builds what is missing (tiny student/teacher models, the task's parquet files),
   then launches verl's own entry point with the ``recipes/cpu_tiny`` overlay; nothing
   of verl's training loop is re-implemented here.
2. Streams verl's console metrics into one progress line per step (reward and the
   ``timing_s/*`` breakdown), keeps verl's JSONL metrics file, draws the reward curve.
3. Ends with one JSON line of headline figures (also written to ``demo.json`` in the results
   folder: ``--results-dir``, else ``benchmarks/results/`` of the checkout, see ``results.py``).
4. ``--algo opd`` runs the ``opd`` recipe (on-policy distillation from the tiny teacher) with the
   same mode flag; its headline adds the student's reverse KL to the teacher.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE_DIR = REPO_ROOT / "recipes" / "cpu_tiny"
MODES = ("sync", "async", "fully_async", "thundersync")
ALGOS = ("grpo", "opd")
STEP_RE = re.compile(r"step:(\d+) - (.*)$")
TIMING_KEYS = ("gen", "reward", "old_log_prob", "adv", "update_actor", "stream", "update_weights", "step")


def recipe_dir() -> Path:
    if not (RECIPE_DIR / "grpo.yaml").is_file():
        raise FileNotFoundError(
            f"recipe folder {RECIPE_DIR} is missing; run the demo from a clone of the thundersync_verl repository "
            "(pip install -e .), where recipes/ sits next to the package"
        )
    return RECIPE_DIR


def prepare_inputs(work_dir: Path, *, n_train: int = 2048, n_val: int = 64, model: str | None = None,
                   variants: tuple[str, ...] = ("student",)) -> dict[str, Path]:
    """Tiny models and datasets, built once and cached (``model``: use this HF folder as the student instead)."""
    from thundersync_verl.envs.dataset import write_dataset
    from thundersync_verl.models import ensure_tiny_models

    models = {"student": Path(model), "teacher": Path(model)} if model else ensure_tiny_models(variants=variants)
    data_dir = work_dir / "data"
    paths = {"train": data_dir / "train.parquet", "val": data_dir / "val.parquet"}
    if not paths["train"].is_file():
        write_dataset(paths["train"], n_train, seed=0, split="train")
    if not paths["val"].is_file():
        write_dataset(paths["val"], n_val, seed=0, split="test")
    return {**paths, "student": models["student"], "teacher": models["teacher"]}


def verl_command(inputs: dict[str, Path], *, algo: str, mode: str, steps: int, extra: list[str]) -> list[str]:
    """Stock verl entry point + our overlay; ``mode=`` is the one flag (recipes/cpu_tiny/mode/)."""
    teacher = [f"distillation.teacher_models.teacher_model.model_path={inputs['teacher']}"] if algo == "opd" else []
    return [
        sys.executable, "-m", "verl.trainer.main_ppo",
        f"--config-path={recipe_dir()}", f"--config-name={algo}",
        f"data.train_files={inputs['train']}", f"data.val_files={inputs['val']}",
        f"actor_rollout_ref.model.path={inputs['student']}",
        f"trainer.total_training_steps={steps}", f"mode={mode}",
        f"trainer.experiment_name={algo}_{mode}",
        *teacher,
        *extra,
    ]


RAY_TASK_EVENTS_KEPT = 10000  # run_env: Ray's task-event table in the GCS, bounded for long runs


def run_env(work_dir: Path, metrics_path: Path) -> dict[str, str]:
    from thundersync_verl.backends.cpu.platform import requested_platform  # imports torch: only when a run starts

    env = dict(os.environ)
    ray_tmp = Path(os.environ.get("THUNDERSYNC_RAY_TMP", "/tmp/thundersync_ray"))
    ray_tmp.mkdir(parents=True, exist_ok=True)
    env.update({
        "VERL_PLATFORM": requested_platform(env),  # the caller's, cpu when unset
        "RAY_AUTH_MODE": "disabled",  # a self-contained local cluster; no token files under $HOME
        "RAY_TMPDIR": str(ray_tmp),
        "RAY_DEDUP_LOGS": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VERL_FILE_LOGGER_PATH": str(metrics_path),
        "HYDRA_FULL_ERROR": "1",
    })
    # Ray's GCS keeps the events of the last N tasks (Ray's default 100000) and every actor call of a step is a
    # task: over a long run that table grows the GCS steadily until it reaches N (benchmarks/soak.py).
    env.setdefault("RAY_task_events_max_num_task_in_gcs", str(RAY_TASK_EVENTS_KEPT))
    return env


def parse_step_line(line: str) -> tuple[int, dict[str, float]] | None:
    match = STEP_RE.search(line)
    if not match:
        return None
    values = {}
    for item in match.group(2).split(" - "):
        key, _, raw = item.partition(":")
        raw = re.sub(r"^np\.\w+\((.*)\)$", r"\1", raw.strip())
        try:
            values[key.strip()] = float(raw)
        except ValueError:
            continue
    return int(match.group(1)), values


def progress_line(step: int, steps: int, m: dict[str, float], t0: float) -> str:
    timing = " ".join(f"{k}={m[f'timing_s/{k}']:.2f}s" for k in TIMING_KEYS if f"timing_s/{k}" in m)
    return (f"[{time.time() - t0:6.1f}s] step {step:>3}/{steps} reward={m.get('critic/score/mean', float('nan')):.3f} "
            f"logprob_gap={m.get('training/rollout_logprob_diff_max', float('nan')):.1e} | {timing}")


def run_verl(cmd: list[str], env: dict, log_path: Path, steps: int) -> dict[int, dict[str, float]]:
    """Run verl, echo one progress line per step, keep the full log; raise with its tail on failure."""
    per_step: dict[int, dict[str, float]] = {}
    t0 = time.time()
    with open(log_path, "w") as log, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            log.write(line)
            parsed = parse_step_line(line)
            if parsed:
                parsed[1]["_t_logged"] = time.time()  # wall clock of the step's end (for traces)
                per_step[parsed[0]] = parsed[1]
                print(progress_line(parsed[0], steps, parsed[1], t0), flush=True)
        rc = proc.wait()
    if rc != 0:
        tail = "".join(open(log_path).readlines()[-40:])
        raise RuntimeError(f"verl.trainer.main_ppo exited with {rc}; full log at {log_path}. Last lines:\n{tail}")
    return per_step


def plot_rewards(per_step: dict[int, dict[str, float]], png: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(per_step)
    rewards = [per_step[s].get("critic/score/mean", float("nan")) for s in steps]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def reverse_kl(step_metrics: dict[str, float]) -> float | None:
    """The student's reverse KL to the teacher at the batch's weights (token mean of log pi - log p_teacher).

    ThunderSync logs it itself; verl's distillation loss with k1 as a policy gradient logs the same
    quantity as ``actor/distillation/loss`` (ratio 1, no clamp).
    """
    for key in ("thundersync/opd/reverse_kl", "actor/distillation/loss"):
        if key in step_metrics:
            return float(step_metrics[key])
    return None


def summarise(per_step: dict[int, dict[str, float]], *, algo: str, mode: str, seconds: float) -> dict:
    steps = sorted(per_step)
    rewards = [per_step[s].get("critic/score/mean", float("nan")) for s in steps]
    gaps = [per_step[s].get("training/rollout_logprob_diff_max", float("nan")) for s in steps]
    gaps = [g for g in gaps if g == g]
    k = min(5, len(rewards))
    kls = [reverse_kl(per_step[s]) for s in steps]
    kls = [x for x in kls if x is not None]
    opd = {"reverse_kl_first5": round(sum(kls[:k]) / max(len(kls[:k]), 1), 4),
           "reverse_kl_last5": round(sum(kls[-k:]) / max(len(kls[-k:]), 1), 4)} if algo == "opd" and kls else {}
    return {
        "algo": algo,
        "mode": mode,
        "steps": len(steps),
        "reward_first5": round(sum(rewards[:k]) / max(k, 1), 4),
        "reward_last5": round(sum(rewards[-k:]) / max(k, 1), 4),
        "seconds": round(seconds, 1),
        "max_rollout_logprob_diff": max(gaps) if gaps else None,
        **opd,
    }


def run_demo(*, algo: str = "grpo", mode: str = "thundersync", steps: int = 20, work_dir: str | Path = "runs/demo",
             extra: list[str] | None = None, results_dir: str | Path | None = None) -> dict:
    from thundersync_verl.run.results import find_results_dir, write_result

    if mode not in MODES or algo not in ALGOS:
        raise ValueError(f"--mode must be one of {MODES} and --algo one of {ALGOS}, got {mode!r}, {algo!r}")
    results_dir = find_results_dir(results_dir)  # refuse before the run, not after it
    work = Path(work_dir).resolve() / f"{algo}_{mode}"
    work.mkdir(parents=True, exist_ok=True)
    for stale in work.glob("*.jsonl"):  # metrics and step traces of an earlier run: the recorders append
        stale.unlink()
    print(f"[demo] preparing tiny models and data under {work}", flush=True)
    inputs = prepare_inputs(work.parent, variants=("student", "teacher") if algo == "opd" else ("student",))
    metrics_path = work / "metrics.jsonl"
    extra = list(extra or []) + ([f"thundersync.run_dir={work}"] if mode == "thundersync" else [])
    cmd = verl_command(inputs, algo=algo, mode=mode, steps=steps, extra=extra)
    print("[demo] " + " ".join(cmd[1:4]) + " ... (full log: " + str(work / "verl.log") + ")", flush=True)
    t0 = time.time()
    per_step = run_verl(cmd, run_env(work, metrics_path), work / "verl.log", steps)
    seconds = time.time() - t0
    if not per_step:
        raise RuntimeError(f"verl finished without logging a training step; see {work / 'verl.log'}")
    png = plot_rewards(per_step, work / "reward_curve.png", f"{algo} / {mode} on the embedded CPU task")
    result = summarise(per_step, algo=algo, mode=mode, seconds=seconds)
    print(f"[demo] metrics: {metrics_path}\n[demo] reward curve: {png}", flush=True)
    timelines = sorted((work / "timelines").glob("*.png"))
    if timelines:
        print(f"[demo] timeline of the last step: {timelines[-1]} ({len(timelines)} in {timelines[-1].parent})", flush=True)
    write_result("demo", result, results_dir)
    return result
