"""Setup for running verl's real FSDP2 engine on the CPU: tiny models, verl's config, a worker
group of the streaming worker, and replayed trajectories (GRPO groups, multi-turn OPD).

Why:
1. The equivalence benchmark (``benchmarks/equivalence.py``) and the engine tests
   (``tests/conftest.py``) build the same thing; it lives here, once, so the figures
   the benchmark prints come from the setup the tests check.
2. Everything is small and seeded: a 2-layer Qwen2 with the project's tokenizer builds in
   seconds, and the same seed gives the same weights and the same trajectories.
3. Heavy imports (transformers, ray, verl's workers) happen inside the functions that need them.
4. The platform is the caller's: ``prepare_environment`` keeps a ``VERL_PLATFORM`` already set (``cpu`` only
   when unset; ``ci/gpu_check.sh`` sets ``nvidia``), ``harness_platform`` names it with the package's own rule
   (``requested_platform``), dtypes follow it (``platform_dtype``), and every harness module starts Ray and its
   worker group through ``start_ray`` / ``start_group``: logical device slots on the CPU, the GPUs the world
   needs on a GPU platform (refused up front when fewer are visible).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from dataclasses import replace as dataclass_replace
from pathlib import Path

import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.backends.cpu.platform import PLATFORM_NAME as CPU_PLATFORM
from thundersync_verl.backends.cpu.platform import requested_platform

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
    reward: float = 0.0  # the task reward (read only with distillation_loss.use_task_rewards=true)


RAY_WORKER_ENV = ("VERL_PLATFORM", "RAY_AUTH_MODE", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")


# ----- setup ---------------------------------------------------------------------------------
def harness_platform(env=None) -> str:
    """The verl platform the harness runs on given ``env`` (default: this process's): its VERL_PLATFORM, cpu when
    unset. ``prepare_environment`` applies it; ``ci/gpu_check.py`` prints it for each check's environment."""
    return requested_platform(env)


def platform_dtype(platform: str | None = None) -> str:
    """The Megatron harness dtype on ``platform`` (default: ``harness_platform()``): ``float32`` on the CPU (its
    patch allows it, and the equivalence floor needs it), ``bfloat16`` on a GPU platform (verl's config accepts
    only bf16/fp16 there), whatever CUDA visibility says."""
    return "float32" if (platform or harness_platform()) == CPU_PLATFORM else "bfloat16"


def prepare_environment() -> Path:
    """The caller's platform (cpu when unset), a self-contained Ray cluster (no auth token, private temp dir), 1 thread.

    Returns Ray's temp dir: a short path under /tmp (Ray's socket paths must stay < 108 bytes).
    """
    ray_tmp = Path(tempfile.mkdtemp(prefix="tsray_", dir="/tmp"))
    os.environ.update({"VERL_PLATFORM": harness_platform(), "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(ray_tmp),
                       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "1"})
    torch.set_num_threads(1)
    return ray_tmp


def start_ray(slots: int) -> None:
    """``ray.init`` for ``slots`` worker processes, one device slot each, with the harness environment.

    On the CPU the slots are logical (``num_gpus`` declares them); on a GPU platform each is a real GPU, so the
    machine must show at least ``slots`` of them (refused here, not as a worker that never schedules).
    """
    import ray

    if harness_platform() != CPU_PLATFORM and torch.cuda.device_count() < slots:
        raise RuntimeError(f"platform {harness_platform()!r}: this world needs {slots} GPUs, "
                           f"{torch.cuda.device_count()} visible")
    env = {k: os.environ[k] for k in RAY_WORKER_ENV}
    ray.init(num_cpus=2 * slots + 2, num_gpus=slots, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env}, _temp_dir=os.environ["RAY_TMPDIR"])


PORT_RACE_TRIES = 3
PORT_RACE_MARKS = ("EADDRINUSE", "address already in use")


def start_group(worker_cls, actor_config, n_workers: int, *, slots: int | None = None, **kwargs):
    """``start_ray(slots or n_workers)``, then a worker group of ``worker_cls`` (role actor) with its model built.

    ``slots`` above ``n_workers`` leaves room for groups started next (e.g. a reference model); ``kwargs`` go to
    ``va.ray_worker_group_with`` (``name_prefix``, ``distillation_config``).
    """
    import ray

    for attempt in range(PORT_RACE_TRIES):
        start_ray(slots or n_workers)
        try:
            wg = va.ray_worker_group_with(worker_cls, config=actor_config, role="actor", n_workers=n_workers, **kwargs)
            wg.init_model()
            return wg
        except Exception as exc:  # noqa: BLE001 - only a lost port race is retried, anything else re-raised
            if attempt + 1 == PORT_RACE_TRIES or not any(m in str(exc) for m in PORT_RACE_MARKS):
                raise
            # verl picked a free port for torch.distributed's store and another process on this host took it
            # before rank 0 bound it: a fresh Ray (its workers and placement groups gone) picks again
            print(f"[harness] worker group lost a port race (try {attempt + 1}); starting it again", flush=True)
            ray.shutdown()


@contextlib.contextmanager
def ray_session():
    """A test module's private Ray: ``prepare_environment`` on entry (yields Ray's temp dir; the caller starts
    Ray or verl's workers); on exit Ray is shut down, its temp dir removed, and the process environment and
    torch's thread count are as they were before."""
    saved, threads = dict(os.environ), torch.get_num_threads()
    ray_tmp = prepare_environment()
    try:
        yield ray_tmp
    finally:
        import ray

        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        os.environ.clear()
        os.environ.update(saved)
        torch.set_num_threads(threads)


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


PROJECT_DISTILL_LOSS = {"loss_mode": "k1", "use_policy_gradient": True, "use_task_rewards": False}  # the project's OPD


def opd_overrides(teacher: Path, distill_loss: dict | None = None) -> list[str]:
    """verl's distillation section: ``distill_loss`` overrides verl's shipped ``distillation_loss`` keys (None: the
    project's OPD as a policy gradient, A_t = -(log pi - log p_teacher); ``{}``: verl's defaults as shipped)."""
    dist, loss = "distillation", "distillation.distillation_loss"
    keys = PROJECT_DISTILL_LOSS if distill_loss is None else distill_loss
    return [f"{dist}.enabled=true", *(f"{loss}.{k}={_yaml(v)}" for k, v in keys.items()),
            f"{dist}.teacher_models.teacher_model.model_path={teacher}",
            f"{dist}.teacher_models.teacher_model.inference.tensor_model_parallel_size=1",
            f"{dist}.n_gpus_per_node=1", f"{dist}.nnodes=1"]


def _yaml(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def verl_config(model_path: Path, *, groups: int, micro: int, optimizer: str = "SGD", lr: float = 0.05,
                loss_agg_mode: str = "token-mean", dtype: str = "fp32", teacher: Path | None = None,
                remove_padding: bool = False, max_token_len: int | None = None, distill_loss: dict | None = None):
    """verl's ppo_trainer.yaml with the CPU settings and one mini-batch per step.

    ``remove_padding``: verl's default packed, unpadded rows (``use_remove_padding=true``; on the CPU sdpa/eager
    separates the packed rows by their restarting ``position_ids``). ``max_token_len``: ``use_dynamic_bsz=true``
    with that ``ppo_max_token_len_per_gpu`` (and the same budget for log-prob calls) instead of fixed micro-batches.

    With ``teacher``: verl's OPD settings, and no gradient clipping (OPD gradients exceed verl's
    clip of 1.0, and a clipped step dθ = lr g/||g|| would hide a wrong normaliser).
    """
    actor = "actor_rollout_ref.actor"
    overrides = [
        f"actor_rollout_ref.model.path={model_path}",
        f"actor_rollout_ref.model.use_remove_padding={str(remove_padding).lower()}",
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
    opd = opd_overrides(teacher, distill_loss) + [f"{actor}.grad_clip=1e9", f"{actor}.optim.clip_grad=1e9"] \
        if teacher is not None else []  # grad_clip: the legacy key; verl 0.9.1's engine clips by optim.clip_grad
    return va.compose_ppo_config(overrides + opd + dynamic_bsz_overrides(max_token_len))


def dynamic_bsz_overrides(max_token_len: int | None) -> list[str]:
    """verl's token-budgeted micro-batches: the actor's update and its (and the rollout's) log-prob calls."""
    if max_token_len is None:
        return []
    actor, rollout = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    return [f"{actor}.use_dynamic_bsz=true", f"{actor}.ppo_max_token_len_per_gpu={max_token_len}",
            f"{rollout}.log_prob_use_dynamic_bsz=true", f"{rollout}.log_prob_max_token_len_per_gpu={max_token_len}"]


def start_workers(config, dp: int, *, distillation: bool = False, worker_cls=None):
    """``start_group`` with ``dp`` device slots and a worker group of StreamingActorWorker.

    ``distillation``: build the actor as verl's trainer does for OPD (``distillation_config``),
    so verl's own ``update_actor`` runs verl's distillation loss.
    """
    from thundersync_verl.learner.streaming_worker import StreamingActorWorker

    extra = {"distillation_config": config.distillation} if distillation else {}
    return start_group(worker_cls or StreamingActorWorker, config.actor_rollout_ref, dp, **extra)


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
    rewards = random.Random(seed + 7919)  # its own stream: the trajectories above are unchanged
    for g in range(groups):
        draw = [float(rewards.random() < 0.5) for _ in range(GROUP_SIZE)]
        if g > 0 and len(set(draw)) == 1:  # ties, and group 0 may be uniform, as in make_trajectories
            draw[rewards.randrange(GROUP_SIZE)] = 1.0 - draw[0]
        for k, r in enumerate(draw):
            out[g * GROUP_SIZE + k] = dataclass_replace(out[g * GROUP_SIZE + k], reward=r)
    return out


def score_turns(teacher_path: Path, trajs: list[TurnTraj], seed: int) -> tuple[dict, dict, dict, float]:
    """Teacher log-probs per turn on its prefix (``TurnScorer``: KV-cache sessions, trajectories
    interleaved at random, each in turn order) and once on the whole sequence (verl's teacher).

    Returns ``(turns {tid: [OPDTurn]}, rows, whole, max |diff|)``: ``rows`` and ``whole`` map each
    trajectory to teacher log-probs per response token, from the turns and from the whole sequence.
    """
    from transformers import AutoModelForCausalLM

    from thundersync_harness.teacher import HFTeacherScorer, TurnScorer, score_turn
    from thundersync_verl.algos.opd.opd_stream import turns_of_trajectory

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
