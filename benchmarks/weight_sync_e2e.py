"""``benchmarks/weight_sync.py --e2e``: ThunderSync ``main_ppo`` with dense and with sparse weight pushes.

Why:
1. The codec-level benchmark (``weight_sync.py``) pushes real optimizer steps through every method;
   this runs the whole trainer twice on one replayed recording (recipes/cpu_tiny, lr 1e-6, bf16
   rollout dtype): ``cpu_channel`` (dense) and ``sparse_sync`` pushes.
2. Per step it reports staleness, reward and grad norm of both runs, the sparse pushes' densities,
   and compares bit for bit the weights the rollout held after every push.
"""

from __future__ import annotations

import json

import torch

from thundersync_verl.backends.sparse_sync import codec


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(codec.bits(a.contiguous()).reshape(-1), codec.bits(b.contiguous()).reshape(-1))


E2E_OVERRIDES = ["actor_rollout_ref.actor.optim.lr=1e-6",  # an RL learning rate: bf16 pushes are sparse
                 "actor_rollout_ref.rollout.dtype=bfloat16"]
BACKENDS = {"dense": ["actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_channel"],
            "sparse": ["actor_rollout_ref.rollout.checkpoint_engine.backend=sparse_sync",
                       "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.sparse_sync.dtype=bfloat16"]}


def _held_weights(folder, dtype: torch.dtype) -> dict[int, dict]:
    """What the rollout held after each push (by version): every push's tensors written over the previous
    state (a sparse push carries the changed parameters only; one that changed nothing writes no file)."""
    held, out = {}, {}
    for path in sorted(folder.glob("weights_v*.pt"), key=lambda p: int(p.stem.split("_v")[1])):
        held.update({n: t.to(dtype) for n, t in torch.load(path).items()})
        out[int(path.stem.split("_v")[1])] = dict(held)
    return out


def _state_at(held: dict[int, dict], version: int) -> dict:
    return held[max(v for v in held if v <= version)]


def end_to_end(steps: int, work_dir: str) -> dict:
    """ThunderSync ``main_ppo`` (recipes/cpu_tiny) twice on one replayed recording: dense pushes
    (``cpu_channel``) and sparse ones (``sparse_sync``); per step staleness, reward and grad norm, and
    the weights the rollout held after every push, compared bit for bit."""
    from pathlib import Path

    import emulated_rollout as er  # sibling scripts in benchmarks/
    from thundersync_verl.backends.replay.server import WEIGHTS_DIR_ENV
    from thundersync_verl.backends.sparse_sync.sparse_engine import PUSH_LOG_ENV
    from thundersync_verl.demo import prepare_inputs

    from thundersync_verl.models import default_root, version_hash
    from thundersync_verl.models.factory import is_built

    work = Path(work_dir).resolve()
    student = default_root() / version_hash() / "student"
    if is_built(student):
        model, source = student, f"student, warm-started build ({student})"
    else:  # the replayed recording fixes the tokens; the policy only has to be the task's tokenizer's model
        from thundersync_harness.engine_setup import build_tiny_model

        model = work / "tiny_random_lm"
        if not (model / "config.json").is_file():
            build_tiny_model(model)
        source = "2-layer Qwen2 (hidden 32) at seeded init with the project's tokenizer (no cached student build)"
    inputs = prepare_inputs(work, model=str(model))
    rec = er.make_recording("paper", steps + 2, inputs, work)
    runs, held, sparse_pushes = {}, {}, []
    for name, backend in BACKENDS.items():
        wdir = work / "weights" / name
        wdir.mkdir(parents=True, exist_ok=True)
        for old in wdir.glob("weights_v*.pt"):
            old.unlink()
        push_log = wdir / "pushes.jsonl"
        push_log.unlink(missing_ok=True)
        run = er.run_replay("thundersync", steps, inputs, work, "paper", rec, 0.0, tag=f"_weight_sync_{name}",
                            extra=E2E_OVERRIDES + backend, env={WEIGHTS_DIR_ENV: str(wdir), PUSH_LOG_ENV: str(push_log)})
        if push_log.is_file():
            prefix = "checkpoint_engine/sparse_sync/"
            logged = [json.loads(line) for line in push_log.read_text().splitlines()]
            sparse_pushes = [{"version": r["version"], "full": bool(r[prefix + "full_push"]), "reason": r["reason"],
                              "density": round(r[prefix + "density"], 6),
                              "payload_vs_dense": round(r[prefix + "payload_mbytes"] / r[prefix + "dense_mbytes"], 6)}
                             for r in logged]
        runs[name] = [run["per_step"][k] for k in sorted(run["per_step"])]
        held[name] = _held_weights(wdir, torch.bfloat16)
    keys = ("training/off_policy/trajectory_staleness/max", "critic/score/mean", "actor/grad_norm",
            "timing_s/update_weights")
    per_step = {name: [{k.split("/")[-2] + "/" + k.split("/")[-1]: r.get(k) for k in keys} for r in rows]
                for name, rows in runs.items()}
    same = {v: all(_same_bits(state[n], _state_at(held["sparse"], v)[n]) for n in state)
            for v, state in held["dense"].items()}
    return {"steps": steps, "model": source, "per_step": per_step, "sparse_pushes": sparse_pushes,
            "rollout_weights_equal_per_push": same,
            "staleness_max": max(r["trajectory_staleness/max"] or 0 for rows in per_step.values() for r in rows),
            "rewards_equal": [r["score/mean"] for r in per_step["dense"]] == [r["score/mean"] for r in per_step["sparse"]],
            "grad_norms_equal": [r["actor/grad_norm"] for r in per_step["dense"]]
            == [r["actor/grad_norm"] for r in per_step["sparse"]],
            "grad_norm_max_rel_diff": max(abs(a["actor/grad_norm"] - b["actor/grad_norm"]) / abs(a["actor/grad_norm"])
                                          for a, b in zip(per_step["dense"], per_step["sparse"]))}
