"""Streamed vs batch-synchronous update on verl's real FSDP2 engine: is it the same step?

Why:
1. The claim of streaming is that it changes WHEN each backward runs, not the update. This
   benchmark checks it end to end on the real stack: verl's FSDP2 engine in a Ray worker group
   (CPU platform, gloo), the streaming worker driven by the stream planner, against verl's own
   ``update_actor`` fed with verl's own ``compute_advantage`` (GRPO, one epoch, one mini-batch).
2. Summation order differs between any two ways of computing the same gradient, so "equal"
   needs a yardstick: the NOISE FLOOR is verl's own update run twice with the rows in different
   micro-batch orders (a stride permutation: every row gets new micro-batch companions). Per step it prints the relative update gap
   ||dθ_stream - dθ_sync|| / ||dθ_sync|| next to ||dθ_sync_a - dθ_sync_b|| / ||dθ_sync_a||; the
   acceptance is gap <= 2 x floor.
3. The optimizer is SGD by default: Adam's first step is about lr * sign(g) per coordinate, so
   its dθ compares gradient SIGNS and hides the gradient gap behind coordinates whose gradient
   is near zero. SGD's dθ is the clipped gradient itself. ``--optimizer AdamW`` runs verl's default.
4. All three runs start from the same weights (the worker reloads its model path and rebuilds
   the optimizer) and see the same trajectories: groups of n=4, varied lengths, binary rewards
   with ties, a random arrival order; new trajectories each step.
5. float64 would shrink the floor to ~1e-16, but verl 0.9.1's engine maps model_dtype/mixed
   precision names through ``PrecisionType.to_dtype``, which has no 64-bit entry: the run says so.
Run: python benchmarks/equivalence.py [--algo grpo] [--dp 1|2] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from thundersync_verl import verl_adapter as va  # noqa: E402

GROUP_SIZE = 4


@dataclass(frozen=True)
class Traj:
    gid: int
    tid: int
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    reward: float


# ----- setup ---------------------------------------------------------------------------------
def prepare_environment() -> Path:
    """CPU platform, a self-contained Ray cluster (no auth token, private temp dir), 1 thread.

    Returns Ray's temp dir: a short path under /tmp (Ray's socket paths must stay < 108 bytes).
    """
    ray_tmp = Path(tempfile.mkdtemp(prefix="tsray_", dir="/tmp"))
    os.environ.update({"VERL_PLATFORM": "cpu", "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(ray_tmp),
                       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "1"})
    torch.set_num_threads(1)
    return ray_tmp


def build_tiny_model(folder: Path, seed: int = 0) -> tuple[Path, int, int]:
    """A random 2-layer Qwen2 with the project's tokenizer in HF format: (path, pad id, vocab)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from thundersync_verl.envs import protocol
    from thundersync_verl.models.tokenizer import render_chat, train_tokenizer

    corpus = [render_chat(t) for t in protocol.transcripts(200, seed, tool_fraction=0.5)]
    tokenizer = train_tokenizer(corpus, vocab_size=400)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, int(tokenizer.pad_token_id), len(tokenizer)


def verl_config(model_path: Path, *, groups: int, micro: int, optimizer: str = "SGD", lr: float = 0.05,
                loss_agg_mode: str = "token-mean", dtype: str = "fp32"):
    """verl's ppo_trainer.yaml with the CPU settings and one mini-batch per step."""
    actor = "actor_rollout_ref.actor"
    return va.compose_ppo_config([
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.model.use_remove_padding=false",  # padded path: no varlen kernels on CPU
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{actor}.strategy=fsdp2", f"{actor}.ppo_mini_batch_size={groups}", f"{actor}.ppo_epochs=1",
        f"{actor}.ppo_micro_batch_size_per_gpu={micro}", f"{actor}.use_torch_compile=false",
        f"{actor}.loss_agg_mode={loss_agg_mode}", f"{actor}.optim.optimizer={optimizer}", f"{actor}.optim.lr={lr}",
        f"{actor}.optim.weight_decay=0.0", f"{actor}.fsdp_config.model_dtype={dtype}",
        f"{actor}.fsdp_config.use_torch_compile=false",
        f"+{actor}.fsdp_config.mixed_precision.param_dtype={dtype}",
        f"+{actor}.fsdp_config.mixed_precision.reduce_dtype={dtype}",
        f"+{actor}.fsdp_config.mixed_precision.buffer_dtype={dtype}",
        f"actor_rollout_ref.rollout.n={GROUP_SIZE}", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"data.train_batch_size={groups}", "algorithm.adv_estimator=grpo",
    ])


def start_workers(config, dp: int):
    """ray.init with ``dp`` logical device slots, then a worker group of StreamingActorWorker."""
    import ray

    from thundersync_verl.trainer.streaming_worker import StreamingActorWorker

    env = {k: os.environ[k] for k in ("VERL_PLATFORM", "RAY_AUTH_MODE", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    ray.init(num_cpus=2 * dp + 2, num_gpus=dp, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env}, _temp_dir=os.environ["RAY_TMPDIR"])
    wg = va.ray_worker_group(StreamingActorWorker, config=config.actor_rollout_ref, role="actor", n_workers=dp)
    wg.init_model()
    return wg


# ----- data ----------------------------------------------------------------------------------
def make_trajectories(seed: int, groups: int, vocab: int) -> tuple[list[Traj], list[int]]:
    """Groups of n=4 with varied lengths and binary rewards (ties; group 0 may be uniform)."""
    rng = random.Random(seed)
    out = []
    for gid in range(groups):
        prompt = tuple(rng.randrange(8, vocab) for _ in range(rng.randint(3, 8)))
        rewards = [float(rng.random() < 0.5) for _ in range(GROUP_SIZE)]
        if gid > 0 and len(set(rewards)) == 1:
            rewards[rng.randrange(GROUP_SIZE)] = 1.0 - rewards[0]
        for tid in range(GROUP_SIZE):
            response = tuple(rng.randrange(8, vocab) for _ in range(rng.randint(2, 14)))
            out.append(Traj(gid, tid, prompt, response, rewards[tid]))
    arrival = list(range(len(out)))
    rng.shuffle(arrival)
    return out, arrival


# ----- the batch-synchronous path: verl's own functions --------------------------------------
def sync_step(wg, trajs: list[Traj], row_order: list[int], pad_token_id: int) -> dict:
    """compute_log_prob -> compute_advantage (GRPO) -> update_actor, as verl's trainer does."""
    import numpy as np

    from thundersync_verl.trainer.stream_loss import pad_batch

    rows = [trajs[i] for i in row_order]
    tensors = pad_batch([t.prompt for t in rows], [t.response for t in rows], pad_token_id)
    rewards = torch.zeros(tensors["response_mask"].shape, dtype=torch.float32)  # [B, R]
    for b, t in enumerate(rows):
        rewards[b, len(t.response) - 1] = t.reward
    data = va.data_proto_cls().from_dict(tensors={**tensors, "token_level_rewards": rewards},
                                         non_tensors={"uid": np.array([f"g{t.gid}" for t in rows], dtype=object)},
                                         meta_info={"temperature": 1.0})
    td = va.to_no_padding(data.to_tensordict())
    va.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
    old = va.unpad_response(va.td_get(wg.compute_log_prob(td), "log_probs"), td)  # [B, R]
    data.batch["old_log_probs"] = old.float()
    data = va.grpo_compute_advantage(data, adv_estimator="grpo")
    td = va.to_no_padding(data.to_tensordict())
    n = len(rows)
    va.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=n, mini_batch_size=n, epochs=1, seed=42,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    metrics = va.td_get(wg.update_actor(td), "metrics")
    return {"grad_norm": float(np.mean(metrics["grad_norm"]))}


# ----- the streamed path: planner + streaming worker -----------------------------------------
def stream_step(wg, trajs: list[Traj], arrival: list[int], pad_token_id: int, *, every: int = 2,
                max_chunk: int = 4, loss_agg_mode: str = "token-mean") -> dict:
    """Trajectories arrive one by one; every ``every`` arrivals the planner's ops are sent."""
    from thundersync_verl.trainer.stream_plan import FoldOp, StreamPlanner
    from thundersync_verl.trainer.streaming_worker import StreamingLearnerClient

    planner = StreamPlanner(adv_estimator="grpo", loss_agg_mode=loss_agg_mode, max_chunk_size=max_chunk)
    client = StreamingLearnerClient(wg, pad_token_id=pad_token_id)
    groups = sorted({t.gid for t in trajs})
    planner.begin_batch({g: GROUP_SIZE for g in groups})
    client.begin_batch({"loss_agg_mode": loss_agg_mode, "train_batch_size": len(groups), "adv_estimator": "grpo"})
    table = {(t.gid, t.tid): (t.prompt, t.response) for t in trajs}
    kinds = {"direct": 0, "bucket": 0, "fold": 0}
    for k, i in enumerate(arrival):
        t = trajs[i]
        planner.arrive(t.gid, t.tid, t.reward, len(t.response))
        if (k + 1) % every == 0 or k + 1 == len(arrival):
            ops = planner.next_ops()
            for op in ops:
                key = "fold" if isinstance(op, FoldOp) else ("direct" if op.dest == "direct" else "bucket")
                kinds[key] += 1
            client.run(ops, table)
    metrics = client.finalize(planner.finalize())
    return {**metrics, **{f"ops/{k}": v for k, v in kinds.items()}}


# ----- comparison ----------------------------------------------------------------------------
def transposed_order(n_rows: int, micro: int) -> list[int]:
    """Row order that gives every row new micro-batch (and rank) companions: a stride permutation.

    With 16 rows and micro-batches of 4, run a sees {0..3}, {4..7}, ... and run b sees
    {0, 4, 8, 12}, {1, 5, 9, 13}, ...: no two rows share a micro-batch in both runs, so the
    floor measures the full dependence on micro-batch composition, not part of it.
    """
    stride = max(1, n_rows // micro)
    return sorted(range(n_rows), key=lambda i: (i % stride, i))


def train(wg, kind: str, batches, pad_token_id: int, micro: int) -> tuple[list[torch.Tensor], list[dict]]:
    """Reset the actor, run one step per batch, return each step's parameter update dθ."""
    wg.reset_actor()
    theta = wg.gather_flat_params()[0]
    deltas, infos = [], []
    for trajs, arrival in batches:
        if kind == "stream":
            info = stream_step(wg, trajs, arrival, pad_token_id)
        else:
            order = list(range(len(trajs)))
            if kind == "sync_b":
                order = transposed_order(len(trajs), micro)
            info = sync_step(wg, trajs, order, pad_token_id)
        new = wg.gather_flat_params()[0]
        deltas.append(new - theta)
        infos.append(info)
        theta = new
    return deltas, infos


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def fp64_probe() -> str:
    try:
        va.precision_dtype("fp64")
    except RuntimeError as exc:
        return f"no: verl's engine rejects model_dtype fp64 ({exc})"
    return "yes"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algo", default="grpo", choices=["grpo"])
    parser.add_argument("--dp", type=int, default=1, choices=[1, 2])
    parser.add_argument("--quick", action="store_true", help="3 steps of 4 groups x 4 (the default size)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=None, help="prompt groups per step (quick: 4, full: 8)")
    parser.add_argument("--optimizer", default="SGD", choices=["SGD", "AdamW"])
    args = parser.parse_args(argv)
    groups = args.groups or (4 if args.quick else 8)
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="ts_equivalence_"))
    ray_tmp = prepare_environment()
    model_path, pad_id, vocab = build_tiny_model(work / "model")
    micro = 4
    config = verl_config(model_path, groups=groups, micro=micro, optimizer=args.optimizer)
    import ray

    try:
        wg = start_workers(config, args.dp)
        batches = [make_trajectories(1000 + s, groups, vocab) for s in range(args.steps)]
        runs = {kind: train(wg, kind, batches, pad_id, micro) for kind in ("sync_a", "sync_b", "stream")}
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return report(args, runs, time.time() - t0)


def report(args, runs: dict, seconds: float) -> dict:
    from thundersync_verl.results import write_result

    (da, _), (db, _), (ds, info_s) = runs["sync_a"], runs["sync_b"], runs["stream"]
    print(f"\nequivalence: {args.algo}, dp={args.dp}, optimizer={args.optimizer}, fp32 (float64 possible: {fp64_probe()})")
    print(f"{'step':>4} | {'gap stream/sync':>16} | {'floor sync_a/sync_b':>19} | {'gap/floor':>9} | {'||dθ||':>9} | chunks direct/bucket/folds")
    worst = None
    for s, (a, b, st, info) in enumerate(zip(da, db, ds, info_s)):
        gap, floor = relative_gap(st, a), relative_gap(b, a)
        ratio = gap / floor if floor > 0 else float("inf")
        print(f"{s + 1:>4} | {gap:>16.3e} | {floor:>19.3e} | {ratio:>9.2f} | {float(a.norm()):>9.3e} | "
              f"{info['ops/direct']}/{info['ops/bucket']}/{info['ops/fold']} (peak bucket bytes {info['stream/peak_bytes']})")
        if worst is None or ratio > worst[2]:
            worst = (gap, floor, ratio)
    verdict = "PASS" if worst[2] <= 2.0 else "FAIL"
    print(f"worst step: gap/floor = {worst[2]:.2f} -> {verdict} (acceptance: gap <= 2 x floor); {seconds:.0f} s")
    result = {"algo": args.algo, "dp": args.dp, "gap": worst[0], "floor": worst[1], "gap_over_floor": worst[2]}
    write_result("equivalence" if args.dp == 1 else f"equivalence_dp{args.dp}", result)
    return result


if __name__ == "__main__":
    main()
