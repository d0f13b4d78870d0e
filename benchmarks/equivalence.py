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
4. All runs start from the same weights (the worker reloads its model path and rebuilds
   the optimizer) and see the same trajectories: groups of n=4, varied lengths, binary rewards
   with ties, a random arrival order; new trajectories each step.
5. float64 would shrink the floor to ~1e-16, but verl 0.9.1's engine maps model_dtype/mixed
   precision names through ``PrecisionType.to_dtype``, which has no 64-bit entry: the run says so.
6. ``--algo opd``: replayed trajectories of 2-4 action turns separated by masked observation
   tokens; a second tiny model is the teacher. Streamed: each turn scored on its causal prefix
   (``TurnScorer``, KV-cache sessions) and backpropagated as a prefix row (``OPDTurnPlanner`` +
   ``stream_token_backward``), turns of all trajectories in a random order. Synchronous: verl's
   OWN ``update_actor`` running verl's distillation loss (worker built with
   ``distillation_config`` as verl's trainer does; k1, use_policy_gradient, no task rewards); its
   learner side needs no teacher server, only the teacher log-probs in the batch (verl's layout).
   Both get the same per-turn scores, so the gap is the learner's; the teacher's own fp32
   prefix-vs-whole difference is printed apart (max |diff| and its effect on verl's update).
Run: python benchmarks/equivalence.py [--algo grpo|opd] [--dp 1|2] [--quick]
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
from functools import partial
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from thundersync_verl import verl_adapter as va  # noqa: E402

GROUP_SIZE = 4
OPD_TEACHER_LAYERS = 3
OPD_TEACHER_INIT_STD = 0.2  # a teacher far from the student: mean |A_t| ~ 1 nat on these sequences


@dataclass(frozen=True)
class Traj:
    gid: int
    tid: int
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    reward: float


@dataclass(frozen=True)
class TurnTraj:
    """A replayed multi-turn trajectory: action turns separated by masked observation tokens."""

    tid: int
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    mask: tuple[int, ...]  # 1 on action (scored) tokens, 0 on observation tokens


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


def build_teacher(student: Path, folder: Path, seed: int = 1) -> Path:
    """The OPD teacher: a second tiny Qwen2 (one more layer, its own wider init), the student's vocabulary.

    Two near-uniform random models would give A_t ~ 0.1 and an update that is a near-cancelling
    sum dominated by fp32 rounding; a teacher far from the student, as at the start of real OPD,
    gives A_t of order 1.
    """
    from transformers import AutoConfig, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    fields = {k: v for k, v in AutoConfig.from_pretrained(student).to_dict().items() if k != "layer_types"}
    config = Qwen2Config(**{**fields, "num_hidden_layers": OPD_TEACHER_LAYERS,
                            "initializer_range": OPD_TEACHER_INIT_STD})
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(student).save_pretrained(folder)
    return folder


def opd_overrides(teacher: Path) -> list[str]:
    """verl's distillation section for OPD as a policy gradient (A_t = -(log pi - log p_teacher))."""
    dist, loss = "distillation", "distillation.distillation_loss"
    return [f"{dist}.enabled=true", f"{loss}.loss_mode=k1", f"{loss}.use_policy_gradient=true",
            f"{loss}.use_task_rewards=false", f"{dist}.teacher_models.teacher_model.model_path={teacher}",
            f"{dist}.teacher_models.teacher_model.inference.tensor_model_parallel_size=1",
            f"{dist}.n_gpus_per_node=1", f"{dist}.nnodes=1"]


def verl_config(model_path: Path, *, groups: int, micro: int, optimizer: str = "SGD", lr: float = 0.05,
                loss_agg_mode: str = "token-mean", dtype: str = "fp32", teacher: Path | None = None):
    """verl's ppo_trainer.yaml with the CPU settings and one mini-batch per step.

    With ``teacher``: verl's OPD settings, and no gradient clipping (OPD gradients exceed verl's
    clip of 1.0, and a clipped step dθ = lr g/||g|| would hide a wrong normaliser).
    """
    actor = "actor_rollout_ref.actor"
    overrides = [
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
    ]
    opd = opd_overrides(teacher) + [f"{actor}.grad_clip=1e9"] if teacher is not None else []
    return va.compose_ppo_config(overrides + opd)


def start_workers(config, dp: int, *, distillation: bool = False):
    """ray.init with ``dp`` logical device slots, then a worker group of StreamingActorWorker.

    ``distillation``: build the actor as verl's trainer does for OPD (``distillation_config``),
    so verl's own ``update_actor`` runs verl's distillation loss.
    """
    import ray

    from thundersync_verl.trainer.streaming_worker import StreamingActorWorker

    env = {k: os.environ[k] for k in ("VERL_PLATFORM", "RAY_AUTH_MODE", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    ray.init(num_cpus=2 * dp + 2, num_gpus=dp, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env}, _temp_dir=os.environ["RAY_TMPDIR"])
    extra = {"distillation_config": config.distillation} if distillation else {}
    wg = va.ray_worker_group_with(StreamingActorWorker, config=config.actor_rollout_ref, role="actor", n_workers=dp,
                                  **extra)
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


def make_turn_trajectories(seed: int, groups: int, vocab: int) -> list[TurnTraj]:
    """``groups`` prompts x n=4 trajectories of 2-4 action turns (2-8 tokens) with 2-6 observation tokens between."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        prompt = tuple(rng.randrange(8, vocab) for _ in range(rng.randint(3, 8)))
        for _ in range(GROUP_SIZE):
            response, mask, n_turns = [], [], rng.randint(2, 4)
            for j in range(n_turns):
                action = [rng.randrange(8, vocab) for _ in range(rng.randint(2, 8))]
                obs = [rng.randrange(8, vocab) for _ in range(rng.randint(2, 6))] if j < n_turns - 1 else []
                response += action + obs
                mask += [1] * len(action) + [0] * len(obs)
            out.append(TurnTraj(len(out), prompt, tuple(response), tuple(mask)))
    return out


def score_turns(teacher_path: Path, trajs: list[TurnTraj], seed: int) -> tuple[dict, dict, dict, float]:
    """Teacher log-probs per turn on its prefix (``TurnScorer``: KV-cache sessions, trajectories
    interleaved at random, each in turn order) and once on the whole sequence (verl's teacher).

    Returns ``(turns {tid: [OPDTurn]}, rows, whole, max |diff|)``: ``rows`` and ``whole`` map each
    trajectory to teacher log-probs per response token, from the turns and from the whole sequence.
    """
    from transformers import AutoModelForCausalLM

    from thundersync_verl.trainer.opd_stream import score_turn, turns_of_trajectory
    from thundersync_verl.trainer.teacher_scoring import HFTeacherScorer, TurnScorer

    model = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32, attn_implementation="sdpa")
    hf = HFTeacherScorer(model)
    whole = {t.tid: hf.score(t.prompt + t.response, (len(t.prompt), len(t.prompt) + len(t.response))).tolist()
             for t in trajs}
    skeleton = {t.tid: turns_of_trajectory(t.tid, t.prompt, t.response, t.mask) for t in trajs}
    queue = [tid for tid, turns in skeleton.items() for _ in turns]
    random.Random(seed).shuffle(queue)
    scorer, turns, rows = TurnScorer(hf), {tid: [] for tid in skeleton}, {t.tid: [0.0] * len(t.response) for t in trajs}
    for tid in queue:
        turn = score_turn(scorer, skeleton[tid][len(turns[tid])])
        turns[tid].append(turn)
        rows[tid][turn.action_start : len(turn.response)] = list(turn.teacher_log_probs)
    diff = max(abs(rows[t.tid][i] - whole[t.tid][i]) for t in trajs for i, m in enumerate(t.mask) if m)
    return turns, rows, whole, diff


def turn_arrival(turns: dict, seed: int) -> list[tuple[int, int]]:
    """Every (trajectory, turn) in a random order: turns of one trajectory may arrive out of order."""
    order = [(tid, t.turn) for tid, ts in turns.items() for t in ts]
    random.Random(seed).shuffle(order)
    return order


# ----- the batch-synchronous path: verl's own functions --------------------------------------
def _verl_update(wg, data, n: int) -> dict:
    """verl's ``update_actor`` on a DataProto batch: one epoch, one mini-batch of ``n`` rows."""
    import numpy as np

    td = va.to_no_padding(data.to_tensordict())
    va.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=n, mini_batch_size=n, epochs=1, seed=42,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    metrics = va.td_get(wg.update_actor(td), "metrics")
    return {"grad_norm": float(np.mean(metrics["grad_norm"]))}


def _old_log_probs(wg, data) -> torch.Tensor:
    td = va.to_no_padding(data.to_tensordict())
    va.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
    return va.unpad_response(va.td_get(wg.compute_log_prob(td), "log_probs"), td).float()  # [B, R]


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
    data.batch["old_log_probs"] = _old_log_probs(wg, data)
    data = va.grpo_compute_advantage(data, adv_estimator="grpo")
    return _verl_update(wg, data, len(rows))


def sync_opd_step(wg, trajs: list[TurnTraj], row_order: list[int], pad_token_id: int, teacher_rows: dict) -> dict:
    """verl's OPD update: teacher log-probs in the batch, old log-probs, ``update_actor`` (distillation loss).

    ``teacher_rows`` maps a trajectory to its teacher log-probs, one per response token.
    """
    import numpy as np

    from thundersync_verl.trainer.stream_loss import pad_batch

    rows = [trajs[i] for i in row_order]
    tensors = pad_batch([t.prompt for t in rows], [t.response for t in rows], pad_token_id,
                        response_masks=[t.mask for t in rows])
    n, width = tensors["input_ids"].shape
    p_width = tensors["prompts"].shape[1]
    teacher = torch.zeros(n, width, 1, dtype=torch.float32)  # [B, S, 1]: position p holds log p(x_{p+1} | x_<=p)
    for b, t in enumerate(rows):
        teacher[b, p_width - 1 : p_width - 1 + len(t.response), 0] = torch.tensor(teacher_rows[t.tid])
    data = va.data_proto_cls().from_dict(
        tensors={**tensors, "teacher_logprobs": teacher,
                 "teacher_ids": tensors["input_ids"].unsqueeze(-1).to(torch.int32)},  # read for top-k modes only
        non_tensors={"uid": np.array([f"t{t.tid}" for t in rows], dtype=object)}, meta_info={"temperature": 1.0})
    old = _old_log_probs(wg, data)  # [B, R]
    data.batch["old_log_probs"] = old
    data.batch["advantages"] = torch.zeros_like(old)  # task-reward term: read by verl's ppo_loss, then dropped
    return _verl_update(wg, data, len(rows))


# ----- the streamed paths: planners + streaming worker ---------------------------------------
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


def stream_opd_step(wg, trajs: list[TurnTraj], turns: dict, arrival: list[tuple[int, int]], pad_token_id: int, *,
                    every: int = 3, max_chunk: int = 4) -> dict:
    """Scored turns arrive in ``arrival`` order; every ``every`` arrivals the ready turns are backpropagated."""
    from thundersync_verl.trainer.opd_stream import OPDStreamClient, OPDTurnPlanner

    planner = OPDTurnPlanner(loss_agg_mode="token-mean", max_chunk_size=max_chunk)
    client = OPDStreamClient(wg, pad_token_id=pad_token_id)
    planner.begin_batch([t.tid for t in trajs])
    client.begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": len(trajs) // GROUP_SIZE})
    chunks = 0
    for k, (tid, j) in enumerate(arrival):
        planner.add_turn(turns[tid][j])
        if j == len(turns[tid]) - 1:
            planner.end_trajectory(tid, len(turns[tid]))  # may come before its earlier turns
        if (k + 1) % every == 0 or k + 1 == len(arrival):
            ops = planner.next_ops()
            chunks += len(ops)
            client.run(ops)
    metrics = client.finalize(planner.finalize())
    return {**metrics, "ops/turn_chunks": chunks, "turns": len(arrival)}


# ----- comparison ----------------------------------------------------------------------------
def transposed_order(n_rows: int, micro: int) -> list[int]:
    """Row order that gives every row new micro-batch (and rank) companions: a stride permutation.

    With 16 rows and micro-batches of 4, run a sees {0..3}, {4..7}, ... and run b sees
    {0, 4, 8, 12}, {1, 5, 9, 13}, ...: no two rows share a micro-batch in both runs, so the
    floor measures the full dependence on micro-batch composition, not part of it.
    """
    stride = max(1, n_rows // micro)
    return sorted(range(n_rows), key=lambda i: (i % stride, i))


def train(wg, steps) -> tuple[list[torch.Tensor], list[dict]]:
    """Reset the actor, run each step function (one optimizer step each), return each dθ and info."""
    wg.reset_actor()
    theta = wg.gather_flat_params()[0]
    deltas, infos = [], []
    for step in steps:
        t0 = time.perf_counter()
        info = step()
        info["seconds"] = time.perf_counter() - t0
        new = wg.gather_flat_params()[0]
        deltas.append(new - theta)
        infos.append(info)
        theta = new
    return deltas, infos


def grpo_steps(wg, batches, pad_id: int, micro: int) -> dict:
    steps = {"sync_a": [], "sync_b": [], "stream": []}
    for trajs, arrival in batches:
        steps["sync_a"].append(partial(sync_step, wg, trajs, list(range(len(trajs))), pad_id))
        steps["sync_b"].append(partial(sync_step, wg, trajs, transposed_order(len(trajs), micro), pad_id))
        steps["stream"].append(partial(stream_step, wg, trajs, arrival, pad_id))
    return steps


def opd_steps(wg, batches, pad_id: int, micro: int) -> dict:
    """sync_a/sync_b/stream see the same teacher log-probs (the per-turn scores): the gap is the
    learner's. sync_whole is fed whole-sequence scores: its distance to sync_a adds the teacher's."""
    steps = {"sync_a": [], "sync_b": [], "stream": [], "sync_whole": []}
    for trajs, turns, rows, whole, arrival in batches:
        steps["sync_a"].append(partial(sync_opd_step, wg, trajs, list(range(len(trajs))), pad_id, rows))
        steps["sync_b"].append(partial(sync_opd_step, wg, trajs, transposed_order(len(trajs), micro), pad_id, rows))
        steps["stream"].append(partial(stream_opd_step, wg, trajs, turns, arrival, pad_id))
        steps["sync_whole"].append(partial(sync_opd_step, wg, trajs, list(range(len(trajs))), pad_id, whole))
    return steps


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
    parser.add_argument("--algo", default="grpo", choices=["grpo", "opd"])
    parser.add_argument("--dp", type=int, default=1, choices=[1, 2])
    parser.add_argument("--quick", action="store_true", help="3 steps of 4 groups x 4 (the default size)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=None, help="prompt groups per step (quick: 4, full: 8)")
    parser.add_argument("--optimizer", default="SGD", choices=["SGD", "AdamW"])
    parser.add_argument("--seed", type=int, default=0, help="offsets every data seed (other batches, same model)")
    args = parser.parse_args(argv)
    groups = args.groups or (4 if args.quick else 8)
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="ts_equivalence_"))
    ray_tmp = prepare_environment()
    model_path, pad_id, vocab = build_tiny_model(work / "model")
    teacher = build_teacher(model_path, work / "teacher") if args.algo == "opd" else None
    micro = 4
    config = verl_config(model_path, groups=groups, micro=micro, optimizer=args.optimizer, teacher=teacher)
    extra = {}
    if args.algo == "opd":
        batches = []
        for s in range(args.steps):
            seed = 2000 + 100 * args.seed + s
            trajs = make_turn_trajectories(seed, groups, vocab)
            turns, rows, whole, diff = score_turns(teacher, trajs, seed + 1000)
            batches.append((trajs, turns, rows, whole, turn_arrival(turns, seed + 2000)))
            extra["teacher_prefix_max_diff"] = max(extra.get("teacher_prefix_max_diff", 0.0), diff)
    else:
        batches = [make_trajectories(1000 + 100 * args.seed + s, groups, vocab) for s in range(args.steps)]
    import ray

    try:
        wg = start_workers(config, args.dp, distillation=args.algo == "opd")
        steps = (opd_steps if args.algo == "opd" else grpo_steps)(wg, batches, pad_id, micro)
        runs = {kind: train(wg, fns) for kind, fns in steps.items()}
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return report(args, runs, time.time() - t0, extra)


def _ops_text(info: dict) -> str:
    if "ops/turn_chunks" in info:
        return f"{info['turns']} turns in {info['ops/turn_chunks']} chunks"
    return f"{info['ops/direct']}/{info['ops/bucket']}/{info['ops/fold']} (peak bucket bytes {info['stream/peak_bytes']})"


def _report_opd_teacher(runs: dict, extra: dict) -> None:
    """The teacher's share: per-turn vs whole-sequence scores, and what they change in verl's update."""
    da, dw, ds = runs["sync_a"][0], runs["sync_whole"][0], runs["stream"][0]
    print(f"teacher log-probs, per-turn prefix (KV-cache sessions) vs whole sequence: max |diff| = "
          f"{extra['teacher_prefix_max_diff']:.3e}")
    print("  verl's update fed whole-sequence vs per-turn scores, relative gap per step: "
          + ", ".join(f"{relative_gap(w, a):.3e}" for w, a in zip(dw, da)))
    print("  end to end, streamed (per-turn scores) vs verl (whole-sequence scores): "
          + ", ".join(f"{relative_gap(st, w):.3e}" for st, w in zip(ds, dw)))


def report(args, runs: dict, seconds: float, extra: dict | None = None) -> dict:
    from thundersync_verl.results import write_result

    extra = extra or {}
    (da, info_a), (db, _), (ds, info_s) = runs["sync_a"], runs["sync_b"], runs["stream"]
    print(f"\nequivalence: {args.algo}, dp={args.dp}, optimizer={args.optimizer}, fp32 (float64 possible: {fp64_probe()})")
    ops_head = "turn chunks" if args.algo == "opd" else "chunks direct/bucket/folds"
    print(f"{'step':>4} | {'gap stream/sync':>16} | {'floor sync_a/sync_b':>19} | {'gap/floor':>9} | {'||dθ||':>9} | "
          f"{'s stream/sync':>13} | {ops_head}")
    worst = None
    for s, (a, b, st, info, info_sync) in enumerate(zip(da, db, ds, info_s, info_a)):
        gap, floor = relative_gap(st, a), relative_gap(b, a)
        ratio = gap / floor if floor > 0 else float("inf")
        secs = f"{info['seconds']:.2f}/{info_sync['seconds']:.2f}"
        print(f"{s + 1:>4} | {gap:>16.3e} | {floor:>19.3e} | {ratio:>9.2f} | {float(a.norm()):>9.3e} | {secs:>13} | {_ops_text(info)}")
        if worst is None or ratio > worst[2]:
            worst = (gap, floor, ratio)
    verdict = "PASS" if worst[2] <= 2.0 else "FAIL"
    print(f"worst step: gap/floor = {worst[2]:.2f} -> {verdict} (acceptance: gap <= 2 x floor); {seconds:.0f} s")
    result = {"algo": args.algo, "dp": args.dp, "gap": worst[0], "floor": worst[1], "gap_over_floor": worst[2]}
    name = "equivalence" if args.algo == "grpo" else "equivalence_opd"
    if args.algo == "opd":
        _report_opd_teacher(runs, extra)
        result["teacher_prefix_max_diff"] = extra["teacher_prefix_max_diff"]
    write_result(name if args.dp == 1 else f"{name}_dp{args.dp}", result)
    return result


if __name__ == "__main__":
    main()
