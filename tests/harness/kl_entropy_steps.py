"""GRPO with verl's KL loss and entropy bonus on the engine: verl's batch-synchronous step and the streamed one.

Why:
1. ``actor.use_kl_loss`` / ``actor.entropy_coeff`` add advantage-free per-token terms to verl's
   actor loss (``ppo_loss``). The streamed step must give the same update: this module runs both
   on verl's FSDP2 engine with the same settings, for ``benchmarks/equivalence.py --kl --entropy``
   and the engine test.
2. The reference model lives in its own worker group, as verl's trainer builds it for a learner
   on its own pool (role ``ref``, verl's ``compute_ref_log_prob``). It is the start policy with
   seeded noise added, so the KL term pulls from the first step on (a reference equal to the start
   policy gives k3 a zero gradient at step 1, and hides a wrong KL path there).
3. ``kl_spec`` is the GRPO spec of ``engine_steps`` with the reference group: synchronous, verl's own
   ``compute_log_prob``, ``compute_ref_log_prob`` (whole batch), ``compute_advantage`` and
   ``update_actor`` with ``calculate_entropy`` as verl's trainer sets it; streamed, the planner routes
   rows direct or into buckets and each chunk's reference log-probs are computed on arrival
   (``chunk_layout.attach_ref_log_probs``) before its backward.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from thundersync_harness.engine_setup import verl_config
from thundersync_harness.engine_steps import PolicySpec, stream_step, sync_step
from thundersync_verl import verl_adapter as va
from thundersync_verl.step.chunk_layout import build_stream_chunk

ACTOR, REF = "actor_rollout_ref.actor", "actor_rollout_ref.ref"
KL_COEF, ENTROPY_COEF = 0.5, 0.05  # large enough that both terms move the update (verl's defaults: 0.001, 0)
REF_NOISE_STD = 0.05
LOSS_SCALE_FACTOR = 16  # seq-mean-token-sum-norm needs a fixed divisor (core/normalizers.py point 4)


def build_reference(student: Path, folder: Path, seed: int = 7, std: float = REF_NOISE_STD) -> Path:
    """The start policy plus N(0, std^2) noise on every weight (seeded), with the same tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(student).save_pretrained(folder)
    return folder


def kl_entropy_config(model_path: Path, *, groups: int, micro: int, kl_type: str | None, entropy: bool,
                      loss_agg_mode: str = "token-mean", optimizer: str = "SGD"):
    """verl's config of ``engine_setup.verl_config`` with the KL loss, entropy bonus and an fp32 reference."""
    from omegaconf import OmegaConf

    config = verl_config(model_path, groups=groups, micro=micro, optimizer=optimizer, loss_agg_mode=loss_agg_mode)
    changes = {
        f"{ACTOR}.use_kl_loss": kl_type is not None, f"{ACTOR}.kl_loss_type": kl_type or "low_var_kl",
        f"{ACTOR}.kl_loss_coef": KL_COEF if kl_type else 0.0, f"{ACTOR}.entropy_coeff": ENTROPY_COEF if entropy else 0.0,
        f"{REF}.log_prob_micro_batch_size_per_gpu": micro, f"{REF}.fsdp_config.use_torch_compile": False,
        f"{REF}.use_torch_compile": False,
    }
    changes.update({f"{REF}.fsdp_config.mixed_precision.{k}": "fp32" for k in ("param_dtype", "reduce_dtype", "buffer_dtype")})
    if loss_agg_mode == "seq-mean-token-sum-norm":
        changes[f"{ACTOR}.loss_scale_factor"] = LOSS_SCALE_FACTOR
    for key, value in changes.items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


def start_kl_workers(config, dp: int, ref_path: Path | None):
    """``(actor group, reference group)``: StreamingActorWorker (role actor) and verl's worker (role ref).

    No reference group (None) without ``ref_path``: the entropy bonus alone needs no reference model.
    """
    from omegaconf import OmegaConf

    from thundersync_harness.engine_setup import start_group
    from thundersync_verl.learner.streaming_worker import StreamingActorWorker

    # 2 * dp slots: the actor's ranks and the reference group's
    wg = start_group(StreamingActorWorker, config.actor_rollout_ref, dp, slots=2 * dp, name_prefix="actor")
    if ref_path is None:
        return wg, None
    ref_config = OmegaConf.create(OmegaConf.to_container(config.actor_rollout_ref, resolve=True))
    ref_config.model.path = str(ref_path)
    ref_wg = va.ray_worker_group_with(va.tinker_actor_worker_base(), config=ref_config, role="ref", n_workers=dp,
                                      name_prefix="ref")
    ref_wg.init_model()
    return wg, ref_wg


# ----- the step, two ways -----------------------------------------------------------------------
def kl_spec(ref_wg, *, entropy: bool, loss_agg_mode: str = "token-mean") -> PolicySpec:
    """The GRPO spec with the reference group and ``calculate_entropy`` (``engine_steps.PolicySpec``): verl's
    side takes the whole batch's reference log-probs, the stream each chunk's just before its backward."""
    scale_factor = LOSS_SCALE_FACTOR if loss_agg_mode == "seq-mean-token-sum-norm" else None
    return PolicySpec(loss_agg_mode=loss_agg_mode, loss_scale_factor=scale_factor, ref_wg=ref_wg, entropy=entropy)


def kl_entropy_steps(wg, ref_wg, batches, pad_id: int, row_orders, *, loss_agg_mode: str, entropy: bool) -> dict:
    """``{sync_a, sync_b, stream}``: step functions per batch; ``row_orders(n)`` gives (order a, order b)."""
    spec = kl_spec(ref_wg, entropy=entropy, loss_agg_mode=loss_agg_mode)
    steps = {"sync_a": [], "sync_b": [], "stream": []}
    for trajs, arrival in batches:
        order_a, order_b = row_orders(len(trajs))
        steps["sync_a"].append(partial(sync_step, wg, trajs, order_a, pad_id, spec))
        steps["sync_b"].append(partial(sync_step, wg, trajs, order_b, pad_id, spec))
        steps["stream"].append(partial(stream_step, wg, trajs, arrival, pad_id, spec))
    return steps


def refuses_kl_chunk_without_reference(wg, pad_token_id: int, groups: int) -> bool:
    """A KL chunk that lacks its reference log-probs is refused before its backward and leaves the weights as they
    were (any engine's streaming worker): True when both hold; raises if the chunk was accepted."""
    wg.reset_actor()
    before = wg.gather_flat_params()[0]
    wg.stream_begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": groups})
    chunk = build_stream_chunk([[9, 10, 11]], [[12, 13]], [0.5], "direct", dp_size=1, pad_token_id=pad_token_id)
    try:
        wg.stream_backward(chunk)
    except Exception as exc:  # the worker's refusal comes back through Ray
        if "no ts_ref_log_prob" not in str(exc):
            raise
        return torch.equal(wg.gather_flat_params()[0], before)
    raise AssertionError("a KL chunk without reference log-probs was accepted")


def run_kl_entropy(args, work: Path, model_path: Path, pad_id: int, vocab: int, groups: int, micro: int, order):
    """``benchmarks/equivalence.py`` point 8: the streamed step with KL and/or entropy vs verl's, same settings, on
    ``args.engine`` (Megatron: the reference group in the actor's layout); ``order(n)`` is the floor's row order.
    Returns (runs, terms) for the report. The caller shuts Ray down."""
    from thundersync_harness import lora
    from thundersync_harness.engine_setup import make_trajectories
    from thundersync_harness.engine_steps import train

    kl_type = args.kl_type if args.kl else None
    if args.engine == "megatron":  # the same steps; the Megatron config and a reference with the actor's layout
        from thundersync_harness import megatron_kl_entropy as mke

        config = mke.megatron_kl_entropy_config(model_path, groups=groups, micro=micro, tp=args.tp, pp=args.pp,
                                                kl_type=kl_type, entropy=args.entropy, loss_agg_mode=args.loss_agg_mode,
                                                distributed_optimizer=args.distributed_optimizer)
        n_workers = args.tp * args.pp * args.dp
    else:
        config = kl_entropy_config(model_path, groups=groups, micro=micro, kl_type=kl_type, entropy=args.entropy,
                                   loss_agg_mode=args.loss_agg_mode, optimizer=args.optimizer)
        n_workers = args.dp
    lora.apply_lora(config, args)  # --lora-rank (point 16)
    batches = [make_trajectories(1000 + 100 * args.seed + s, groups, vocab) for s in range(args.steps)]
    wg, ref_wg = lora.kl_workers(args, config, n_workers, model_path, work)  # with --lora-rank: the adapter-off actor
    steps = kl_entropy_steps(wg, ref_wg, batches, pad_id, lambda n: (list(range(n)), order(n)),
                             loss_agg_mode=args.loss_agg_mode, entropy=args.entropy)
    runs = {kind: train(wg, fns) for kind, fns in steps.items()}
    lora.measure_rollout(args, wg, steps, batches, pad_id, config)  # --lora-rank (point 16)
    terms = {"kl_loss_type": kl_type, "kl_loss_coef": KL_COEF if args.kl else 0.0,
             "entropy_coeff": ENTROPY_COEF if args.entropy else 0.0, "loss_agg_mode": args.loss_agg_mode,
             "ref_calls": sum(i["ref_calls"] for i in runs["stream"][1])}
    return runs, terms
