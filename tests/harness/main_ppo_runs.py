"""Stock ``main_ppo`` runs of the CPU recipe on one replayed recording, and the weights they pushed.

Why:
1. Comparing two modes' updates end to end (the drop-in test, checkpoint/resume) needs every run to see
   the same trajectories: one run synthesises a recording (``replay`` backend, ``synthesize=paper``,
   nothing slept), every later run replays it (``time_scale=0``).
2. The replay server keeps each weight push (``$THUNDERSYNC_REPLAY_WEIGHTS_DIR``): version k is the
   learner's parameters after step k, whatever the mode, so updates are compared on the real pushes.
3. One launcher for the e2e tests that need it (``launch``: the bare process, for runs that must fail), so each
   test states only its overrides.
4. A launch costs about 45 s on 2 cores, of which the step is 8: the GRPO recording is made once per test run and
   shared by every test process that replays it (``shared_recording``: a file lock in the run's temporary root,
   which pytest-xdist's workers share), keyed by the model's bytes so a test with another model records its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from thundersync_verl.backends.replay.synthesize import SHAPES
from thundersync_verl.demo import recipe_dir, run_env
from thundersync_verl.envs.dataset import write_dataset

REPLAY = "+actor_rollout_ref.rollout.engine_kwargs.replay"
# a replay must see the tool outputs its recording saw: no injected retries, and no call timed out on a busy core (a
# timed-out call changes the next prompt, which the recording then lacks, and the agent loop fails: a likely cause of
# one such failure on a loaded CI host; emulated_rollout.py sets the same)
NO_LATENCY = ["thundersync.env.tool_latency.scale=0", "thundersync.env.verifier_latency.scale=0",
              "thundersync.env.retry_prob=0", "thundersync.env.tool_timeout_s=120"]
WEIGHTS_ENV = "THUNDERSYNC_REPLAY_WEIGHTS_DIR"
# Update gaps (relative to the update) below this are rounding in every main_ppo comparison measured so far (3e-6 to
# 4.5e-5, while the Sync-vs-Sync floor sample moved from 1.0e-6 to 3.2e-5 between invocations); a wrong coefficient,
# a missing term or fold moves the update by 1e-3 or more. Used with the floor: gap <= max(4 x floor, UPDATE_ATOL).
UPDATE_ATOL = 1e-4


def within_floor(gap: float, floor: float) -> bool:
    """The e2e equality rule: within 4x the Sync runs' own spread, or below rounding's measured range."""
    return gap <= max(4 * floor, UPDATE_ATOL)


def linear_sgd(lr: float) -> list[str]:
    """The actor's optimizer as plain SGD at ``lr``: its update is linear in the gradient, for runs that step more
    than once (RESOLVING_SGD's lr 1e4 resolves one step's gradient but leaves no model to train a second step)."""
    return ["actor_rollout_ref.actor.optim.optimizer=SGD", f"actor_rollout_ref.actor.optim.lr={lr}"]


# SGD at lr 1e4: the pushed update is 1e4 x the clipped gradient, far above the weights' float32 spacing, so a gap
# between two runs measures their gradients, not weights whose rounding flipped (emulated_rollout.py point 5).
RESOLVING_SGD = linear_sgd(1e4)
TOKEN_SUM = ["actor_rollout_ref.actor.loss_agg_mode=token-sum"]  # each row's coefficients exact, no per-row rounding
TOKEN_SUM_ATOL = 1e-6  # a gap this small is rounding whatever the floor sample (a wrong term moves it 1e-3 or more)

# verl's Megatron actor (megatron-core over gloo) in place of the CPU recipe's FSDP2 one, from the command line: the
# recipe's fsdp_config keys removed, mbridge (megatron-bridge needs Python >= 3.12), fp32, the distributed optimizer
# (verl's weight export needs the param buffer it allocates). The model: megatron_engine.build_megatron_model.
# optim.total_training_steps: any value, verl's trainer sets it from trainer.total_training_steps before building.
_ACTOR, _MEGA = "actor_rollout_ref.actor", "actor_rollout_ref.actor.megatron"
MEGATRON_OVERRIDES = [
    "model_engine=megatron", f"~{_ACTOR}.fsdp_config", "~actor_rollout_ref.ref.fsdp_config",
    f"{_ACTOR}.strategy=megatron", f"{_MEGA}.vanilla_mbridge=true", f"{_MEGA}.dtype=float32",
    f"{_MEGA}.use_distributed_optimizer=true", f"{_ACTOR}.optim.total_training_steps=2",
    "actor_rollout_ref.ref.megatron.vanilla_mbridge=true", "actor_rollout_ref.ref.megatron.dtype=float32",
]


def within_sums_order(gap: float, floor: float) -> bool:
    """The token-sum rule at lr 1e4: within 2x the Sync runs' own spread (another order of the same sums), or 1e-6."""
    return gap <= max(2 * floor, TOKEN_SUM_ATOL)


def launch(work: Path, model: Path, mode: str, extra: list[str], *, steps: int = 1, run: Path | None = None,
           env_extra: dict | None = None, timeout: int = 900, recipe: str = "grpo") -> subprocess.CompletedProcess:
    """``python -m verl.trainer.main_ppo`` of a CPU recipe (``grpo``, or ``sao`` from its own folder) on the tiny
    dataset under ``work``, metrics to ``run/metrics.jsonl``; returns the finished process, whatever its exit."""
    train = work / "train.parquet"
    if not train.is_file():
        write_dataset(train, 64, seed=0, split="train")
        write_dataset(work / "val.parquet", 8, seed=0, split="test")
    run = run or work
    folder = recipe_dir() / recipe if (recipe_dir() / recipe).is_dir() else recipe_dir()
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={folder}", f"--config-name={recipe}",
           f"data.train_files={train}", f"data.val_files={work / 'val.parquet'}",
           f"actor_rollout_ref.model.path={model}", f"trainer.total_training_steps={steps}", f"mode={mode}", *extra]
    ray_tmp = tempfile.mkdtemp(prefix="tsr_", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    env = run_env(run, run / "metrics.jsonl")
    env["THUNDERSYNC_RAY_TMP"] = env["RAY_TMPDIR"] = ray_tmp
    env.update(env_extra or {})
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=work)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def main_ppo(work: Path, model: Path, name: str, mode: str, extra: list[str], *, steps: int,
             env_extra: dict | None = None, timeout: int = 900, recipe: str = "grpo") -> list[dict]:
    """One replay-backed ``main_ppo`` of a CPU recipe under ``work/name``; returns its per-step metrics."""
    run = work / name
    run.mkdir()
    replay = ["actor_rollout_ref.rollout.name=replay", f"thundersync.run_dir={run}", *SHAPES["paper"].overrides(),
              *NO_LATENCY]
    out = launch(work, model, mode, [*replay, *extra], steps=steps, run=run, env_extra=env_extra, timeout=timeout,
                 recipe=recipe)
    assert out.returncode == 0, failure_report(out, run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["data"] if "data" in r else r for r in rows if "timing_s/step" in r.get("data", r)]


def failure_report(out, run: Path) -> str:
    """A failed launch's whole output kept in ``run/main_ppo.log``; the first error a worker logged (a Ray worker's
    traceback, e.g. an agent loop's: verl only logs it, the driver then reports the loop as failed) and the tail."""
    text = out.stdout + out.stderr
    (run / "main_ppo.log").write_text(text)
    marks = [i for i in (text.find("Error in _run_prompt"), text.find("Traceback (most recent call last)")) if i >= 0]
    first = text[min(marks):min(marks) + 2500] if marks else ""
    return f"first error logged:\n{first}\n...\nlast lines:\n{text[-3000:]}\n(whole output: {run / 'main_ppo.log'})"


def record(work: Path, model: Path, steps: int, *, recipe: str = "grpo", extra: list[str] = ()) -> Path:
    """Synthesise the ``paper``-shaped recording of ``steps`` Sync steps; every replay of it sees the same data."""
    path = work / "recording.jsonl"
    main_ppo(work, model, "record", "sync", [f"{REPLAY}.path={path}", f"{REPLAY}.synthesize=paper", *extra],
             steps=steps, recipe=recipe)
    return path


def shared_recording(tmp_path_factory, model: Path, steps: int = 2) -> Path:
    """The GRPO recipe's ``paper``-shaped recording of ``steps`` Sync steps, made once for every test process of this
    run (a replay of fewer steps reads its first ones). Not shared between runs: a code change re-records."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: the run's root, one per run
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(model.iterdir()) if p.is_file())).hexdigest()[:12]
    work = root / f"grpo_recording_{digest}_{steps}"
    with FileLock(f"{work}.lock"):
        done = work / "recorded"
        if not done.is_file():
            shutil.rmtree(work, ignore_errors=True)  # a failed attempt's half-written run
            work.mkdir()
            record(work, model, steps)
            done.touch()
    return work / "recording.jsonl"


def replayed(work: Path, model: Path, recording: Path, name: str, mode: str, extra: list[str], *, steps: int = 1,
             env_extra: dict | None = None, recipe: str = "grpo") -> tuple[list[dict], Path]:
    """A run replaying ``recording``; returns (its step metrics, the folder of its weight pushes)."""
    weights = work / f"weights_{name}"
    rows = main_ppo(work, model, name, mode, [f"{REPLAY}.path={recording}", f"{REPLAY}.time_scale=0", *extra],
                    steps=steps, env_extra={WEIGHTS_ENV: str(weights), **(env_extra or {})}, recipe=recipe)
    return rows, weights


def pushed(weights: Path, version: int) -> dict[str, torch.Tensor]:
    """The parameters pushed after step ``version``."""
    path = weights / f"weights_v{version}.pt"
    assert path.is_file(), f"no weight push v{version} in {weights}: {sorted(p.name for p in weights.glob('*'))}"
    return torch.load(path)


def start_weights(model: Path) -> dict[str, torch.Tensor]:
    """The HF checkpoint's parameters (the policy every run starts from), by name."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(f).items()}


def distance(a: dict, b: dict) -> float:
    """||a - b|| over the parameters both hold, in fp64."""
    keys = a.keys() & b.keys()
    assert keys, "the two weight sets share no parameter name"
    return sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in keys) ** 0.5


def update(start: dict, weights: Path, version: int = 1) -> dict[str, torch.Tensor]:
    """The step's parameter update in fp64: the push after step ``version`` minus ``start``."""
    pushed_ = pushed(weights, version)
    return {k: pushed_[k].double() - start[k].double() for k in pushed_.keys() & start.keys()}


def norm(weights: dict) -> float:
    """||weights|| over every parameter, in fp64."""
    return sum(float(v.double().norm() ** 2) for v in weights.values()) ** 0.5
