"""LoRA in the equivalence comparison (``--lora-rank R``): verl's FSDP2 engine with a peft adapter, and its rollout.

Why:
1. verl trains LoRA (``actor_rollout_ref.model.lora_rank > 0``) with peft on its FSDP2 engine: the base weights are
   frozen, the adapter (``lora_A`` / ``lora_B`` of every linear layer, ``target_modules=all-linear``) is trained.
   verl's update and the streamed step run on the same adapted model (both read the actor's config,
   ``apply_lora``); the stream's buckets hold the adapter's parameters only (``learner/engines/fsdp.py`` point 4),
   which the JSON reports beside the model's size (``stream_bucket_bytes``, ``model_param_bytes``).
2. Every run starts from one adapter: peft initialises ``lora_A`` at random, and ``va.reset_actor`` seeds torch
   before every rebuild. ``lora_B`` starts at zero, so step 1 moves ``lora_B`` only and later steps both factors.
3. ``--kl``: verl's trainer then takes the reference log-probs from the actor with its adapter disabled
   (``ref_in_actor``: ``compute_log_prob`` with ``no_lora_adapter``): the base model is the reference, and no
   reference worker group is started. ``AdapterOffReference`` is that call on the actor's own group, for verl's side
   (the whole batch) and the stream (each chunk on arrival) alike. The policy equals the base at step 1, so the KL
   term pulls from step 2 on.
4. The adapter must reach the rollout every step. ``measure_rollout`` runs the streamed steps once more and after
   each one pushes the weights as the ThunderSync trainer does (the worker's ``update_weights`` through the
   ``cpu_channel`` checkpoint engine: the learner sends its adapter, ``learner/streaming_worker.py`` point 6) into an
   ``hf_cpu`` server in this process (its ``update_weights`` merges the adapter), then reads the rollout's log-probs
   of the first batch's sequences (verl's teacher-scoring call, ``prompt_logprobs``) and the learner's (verl's
   ``compute_log_prob``). The rollout's staleness after step k is the smallest j with
   max |rollout_k - learner_{k-j}| <= ``STALENESS_TOL``; it tells a stale rollout apart only when every step moves
   the learner's log-probs by more than that (``rollout_logprob_step_change_min``; else the staleness is None).
5. The flag applies to the plain FSDP2 GRPO comparison (with ``--remove-padding`` / ``--dynamic-bsz``) and to
   ``--kl`` / ``--entropy`` at ``--dp 1``; elsewhere it is refused, not ignored.
6. What the yardstick sees differently with an adapter (the figures stay the benchmark's; these explain them):
   ``lora_B`` starts at zero, so the adapter IS the sum of the updates so far. A rounding difference of step 1 is
   then a relative difference of ``lora_B`` at step 2, and of the gradient of ``lora_A`` (which ``lora_B``
   multiplies), where in the full model the start weights dilute it by orders of magnitude. The table's runs are
   trained apart for all steps, so later steps carry the earlier steps' rounding; ``gap_over_floor_common_theta``
   compares each later step from ONE point (verl's weights after the steps before it: verl's update, its
   regrouped floor and the stream each take that step from there). The plain comparison also runs point 7's
   controls (verl's own update with its loss scalars rounded otherwise, x24 against x16: ``gap_verl_rescaled_over_floor``).
7. Measured (``--quick --lora-rank 8 --seeds 0,1,2``, plain and ``--kl``): benchmarks/results/equivalence_lora8_seeds.json
   and benchmarks/results/equivalence_kl_low_var_kl_lora8_seeds.json.
"""

from __future__ import annotations

import asyncio

import torch

LORA_ALPHA = 16  # verl's default model.lora_alpha
STALENESS_TOL = 1e-4  # rollout vs learner log-probs at one version: fp32 forwards of one model (~1e-6 apart)
MODEL = "actor_rollout_ref.model"


def add_lora_arguments(parser) -> None:
    parser.add_argument("--lora-rank", type=int, default=0, metavar="R",
                        help=f"fsdp: model.lora_rank=R (lora_alpha={LORA_ALPHA}, all-linear) for verl's update and the stream")


def check_lora(parser, args):
    """``args`` when ``--lora-rank`` fits the comparison, else ``parser.error``."""
    if args.lora_rank < 0:
        parser.error("--lora-rank takes a rank >= 1 (0: no LoRA)")
    if args.lora_rank and (args.engine != "fsdp" or args.algo != "grpo" or args.estimator != "grpo" or args.dp != 1
                           or args.mini_batches > 1 or args.ppo_epochs > 1 or getattr(args, "dtype", "fp32") != "fp32"):
        parser.error("--lora-rank runs the fp32 GRPO comparison (plain or --kl / --entropy) on --engine fsdp at --dp 1")
    return args


def lora_overrides(rank: int) -> dict:
    """verl's LoRA keys, and the CPU rollout with the ThunderSync learner's push (point 4)."""
    return {f"{MODEL}.lora_rank": rank, f"{MODEL}.lora_alpha": LORA_ALPHA, f"{MODEL}.target_modules": "all-linear",
            "actor_rollout_ref.rollout.name": "hf_cpu", "actor_rollout_ref.rollout.dtype": "float32",
            "actor_rollout_ref.rollout.checkpoint_engine.backend": "cpu_channel"}


def apply_lora(config, args):
    """``config`` (verl's, from ``engine_setup.verl_config`` or ``kl_entropy_config``) with ``--lora-rank``."""
    from omegaconf import OmegaConf

    for key, value in (lora_overrides(args.lora_rank) if getattr(args, "lora_rank", 0) else {}).items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


def verl_config(model_path, *, lora_rank: int, **kwargs):
    """``engine_setup.verl_config`` with the adapter of rank ``lora_rank`` (tests)."""
    from types import SimpleNamespace

    from thundersync_harness import engine_setup

    return apply_lora(engine_setup.verl_config(model_path, **kwargs), SimpleNamespace(lora_rank=lora_rank))


class AdapterOffReference:
    """verl's reference with LoRA: the actor's ``compute_log_prob`` with ``no_lora_adapter`` (point 3), under the
    name the harness calls a reference group by (``compute_ref_log_prob``)."""

    def __init__(self, actor_wg):
        self.wg = actor_wg

    def compute_ref_log_prob(self, data):
        from thundersync_verl import verl_adapter as va

        va.assign_non_tensor(data, no_lora_adapter=True)
        return self.wg.compute_log_prob(data)


def kl_workers(args, config, n_workers: int, model_path, work):
    """``(actor group, reference)`` for ``--kl`` / ``--entropy``: with ``--lora-rank`` the actor alone and its
    adapter-off reference (point 3); else ``kl_entropy_steps``' reference model in its own group."""
    from thundersync_harness import kl_entropy_steps as kle

    if not getattr(args, "lora_rank", 0):
        ref_path = kle.build_reference(model_path, work / "ref") if args.kl else None
        return kle.start_kl_workers(config, n_workers, ref_path)
    wg, _ = kle.start_kl_workers(config, n_workers, None)
    return wg, AdapterOffReference(wg) if args.kl else None


# ----- the rollout's side (point 4) ----------------------------------------------------------
def rollout_server(config):
    """An ``hf_cpu`` server in this process, built from verl's rollout and model config as its replica builds it."""
    from thundersync_verl.backends.cpu.rollout import HFCpuServer

    return HFCpuServer(config.actor_rollout_ref.rollout, config.actor_rollout_ref.model, None, 0)


def push(wg, server, version: int, loop) -> int:
    """The ThunderSync trainer's push of ``version``: the learner's ``update_weights`` into the ``cpu_channel``
    checkpoint engine, the rollout worker's receive, the server's ``update_weights``; returns the tensors pushed."""
    import ray

    from thundersync_verl.backends.cpu.cpu_channel import make_engine_class

    ray.get(wg.update_weights(global_steps=version))
    receiver = make_engine_class()()

    async def receive() -> list:
        return [item async for item in receiver.receive_weights(global_steps=version)]

    named = loop.run_until_complete(receive())
    loop.run_until_complete(server.update_weights(named, version))
    return len(named)


def rollout_log_probs(server, trajs, loop) -> list[torch.Tensor]:
    """The rollout's log-probs of each trajectory's response tokens (verl's ``prompt_logprobs`` call)."""
    async def score(t):
        out = await server.generate(list(t.prompt + t.response), {"prompt_logprobs": 0}, request_id=f"probe{t.gid}:{t.tid}")
        rows = out.extra_fields["prompt_logprobs"]  # row p: log p(token p+1 | tokens <= p)
        return torch.tensor([rows[len(t.prompt) - 1 + j][0] for j in range(len(t.response))], dtype=torch.float64)

    async def all_rows():
        return await asyncio.gather(*(score(t) for t in trajs))

    return loop.run_until_complete(all_rows())


def learner_log_probs(wg, trajs, pad_id: int) -> list[torch.Tensor]:
    """verl's ``compute_log_prob`` of each trajectory's response tokens at the learner's current weights."""
    from thundersync_harness.engine_steps import old_log_probs
    from thundersync_verl import verl_adapter as va
    from thundersync_verl.step.chunk_layout import pad_batch

    tensors = pad_batch([t.prompt for t in trajs], [t.response for t in trajs], pad_id)
    data = va.data_proto_cls().from_dict(tensors=tensors, meta_info={"temperature": 1.0})
    lp = old_log_probs(wg, data).double()  # [B, R]
    return [lp[b, : len(t.response)] for b, t in enumerate(trajs)]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def common_theta_ratios(wg, steps: dict) -> list[float]:
    """Point 6: per step k >= 2, gap / floor of the stream with verl's update, all three taking step k from verl's
    weights after steps 1..k-1 (``steps``: the comparison's step functions by kind)."""
    from thundersync_harness.engine_steps import relative_gap, train

    ratios = []
    for k in range(1, len(steps["stream"])):
        prefix = steps["sync_a"][:k]
        a, b, s = (train(wg, prefix + [steps[kind][k]])[0][-1] for kind in ("sync_a", "sync_b", "stream"))
        ratios.append(relative_gap(s, a) / relative_gap(b, a))
    return ratios


def measure_rollout(args, wg, steps: dict, batches, pad_id: int, config) -> None:
    """Points 4 and 6 with ``--lora-rank`` (``steps``: the comparison's step functions by kind): reset, push, then per
    streamed step push and compare; then the common-point ratios. The figures go to ``args.lora_rollout``
    (``lora_result`` reports them). Without ``--lora-rank``: nothing."""
    if not getattr(args, "lora_rank", 0):
        return
    stream_steps = steps["stream"]
    server, probe, loop = rollout_server(config), batches[0][0], asyncio.new_event_loop()  # one loop: the server's
    try:
        wg.reset_actor()
        pushed = push(wg, server, 0, loop)
        learner, rollout = [learner_log_probs(wg, probe, pad_id)], [rollout_log_probs(server, probe, loop)]
        for k, step in enumerate(stream_steps, start=1):
            step()
            push(wg, server, k, loop)
            learner.append(learner_log_probs(wg, probe, pad_id))
            rollout.append(rollout_log_probs(server, probe, loop))
    finally:
        loop.close()
    lags = []
    for k in range(1, len(rollout)):
        lag = next((j for j in range(k + 1) if _max_diff(rollout[k], learner[k - j]) <= STALENESS_TOL), None)
        lags.append(lag)
    moved = min(_max_diff(learner[k], learner[k - 1]) for k in range(1, len(learner)))
    args.lora_rollout = {  # None: not measured (a lag beyond the run, or steps too small to tell versions apart)
        "rollout_adapter_staleness": None if None in lags or moved <= STALENESS_TOL else max(lags),
        "rollout_staleness_per_step": lags,
        "rollout_logprob_gap_max": max(_max_diff(r, lp) for r, lp in zip(rollout, learner)),
        "rollout_logprob_step_change_min": moved,
        "rollout_tensors_pushed": pushed, "rollout_merged_modules": len(server.lora.merged_modules)}
    ratios = common_theta_ratios(wg, steps)
    args.lora_rollout.update(gap_over_floor_common_theta=max(ratios, default=None), gap_over_floor_common_theta_per_step=ratios)


def lora_result(args, result: dict, name: str, runs: dict) -> str:
    """Add ``lora_rank`` (and with it the bucket sizes and the rollout's figures, point 4) to ``result``, print the
    rollout's staleness; the result's name with ``_lora<R>``."""
    rank = int(getattr(args, "lora_rank", 0) or 0)
    result["lora_rank"] = rank
    if not rank:
        return name
    info = runs["stream"][1][0]
    result.update(stream_bucket_bytes=int(info["stream/buffer_bytes"]), model_param_bytes=4 * runs["sync_a"][0][0].numel(),
                  **getattr(args, "lora_rollout", {}))
    fig = getattr(args, "lora_rollout", None)
    if fig is not None:
        resolved = fig["rollout_logprob_step_change_min"] > STALENESS_TOL
        print(f"rollout_adapter_staleness: {fig['rollout_adapter_staleness']} (per step {fig['rollout_staleness_per_step']};"
              f" hf_cpu vs learner log-probs after each push, max |diff| {fig['rollout_logprob_gap_max']:.2e} <= "
              f"{STALENESS_TOL:g}; each step moved them by >= {fig['rollout_logprob_step_change_min']:.2e}"
              f"{'' if resolved else ': NOT above the tolerance, staleness unresolved'}; "
              f"{fig['rollout_tensors_pushed']} adapter tensors per push, {fig['rollout_merged_modules']} modules merged)")
    print(f"  LoRA rank {rank}: stream buckets of {result['stream_bucket_bytes']} bytes (the adapter) for a model of "
          f"{result['model_param_bytes']} bytes")
    if fig is not None and fig["gap_over_floor_common_theta_per_step"]:
        print("  steps 2.. from one point (verl's weights after the steps before), gap/floor: "
              + ", ".join(f"{r:.2f}" for r in fig["gap_over_floor_common_theta_per_step"]))
    return f"{name}_lora{rank}"
