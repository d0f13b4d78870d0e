"""A tiny Qwen3-MoE on verl's Megatron engine on the CPU: the model, the comparison's flags, expert parallel.

Why:
1. The 30B-A3B recipes stream a Qwen3-MoE through verl's Megatron engine. The CPU check of that path is the
   equivalence comparison (verl's ``update_actor`` against the streamed step) on a model of the same shape,
   made here: 2 layers, every layer an MoE layer of 4 experts with top-2 routing (softmax scores, renormalised
   over the chosen two: ``norm_topk_prob``, as Qwen3-30B-A3B), separate query/key norms, untied output layer,
   the vocabulary padded to a multiple of 128 for tensor parallelism. HF-format files written locally (the
   project tokenizer, seeded weights); verl loads them through mbridge's ``qwen3_moe`` bridge, as the dense
   tiny model goes through its ``qwen2`` bridge.
2. ``router_aux_loss_coef`` is 0 in the checkpoint, and verl 0.9.1 builds MoE models with
   ``moe_router_load_balancing_type="none"`` on both of its bridges (mbridge's Qwen-MoE configs, and
   ``provider_overrides`` on the Megatron-Bridge path): the router's load-balancing loss is off unless a
   recipe turns it on. ``apply_moe(aux=(KIND, COEF))`` (``aux_overrides``) turns one on through
   ``override_transformer_config``, as a recipe would, for ``benchmarks/moe_aux_loss.py``.
3. ``--moe`` runs the plain GRPO comparison on this model (EP 1); ``--ep N`` splits the experts over N
   expert-parallel ranks, which Megatron carves out of the data-parallel ranks: ``--dp`` must be a multiple of
   N (N Ray workers over gloo at ``--dp N``). Flags are refused, never ignored, where they do not apply.
4. The router losses (``composition_steps``, megatron-core 0.16): ``aux_loss`` balances each expert's share of
   ONE micro-batch's routed tokens against its mean router probability there, ``global_aux_loss`` against a
   running count over the micro-batches seen so far: a row's gradient depends on which rows share its
   micro-batch. ``seq_aux_loss`` (per padded sequence, divided by the micro-batch's row count) and the z-loss
   (a mean over the micro-batch's padded tokens; verl passes no padding mask on the padded path) are per row
   and per token, but the schedule scales all of them per CALL (by 1 / its micro-batch count). Measured on
   verl's own update: the same rows regrouped, or cut into micro-batches of another size, the router term
   alone (every advantage 0) under both groupings, and the streamed step with the learner's refusal lifted.
5. The CPU runtime for MoE (the local experts ``SequentialMLP`` instead of a grouped GEMM, their names in
   mbridge's map, a CPU stream for the all-to-all dispatcher) is ``backends/megatron/cpu_patches.py``.
"""

from __future__ import annotations

from pathlib import Path

import torch

NUM_EXPERTS, TOP_K = 4, 2
MEGA = "actor_rollout_ref.actor.megatron"
AUX_KINDS = ("aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss")


def build_moe_model(folder: Path, seed: int = 0) -> tuple[Path, int, int]:
    """The tiny Qwen3-MoE of point 1 with the project tokenizer, in HF format: (path, pad id, vocab)."""
    from transformers import AutoConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from thundersync_harness.engine_setup import build_tiny_model
    from thundersync_harness.megatron_engine import VOCAB_MULTIPLE

    path, pad_id, vocab = build_tiny_model(folder, seed=seed)  # the tokenizer; its dense weights are replaced
    dense = AutoConfig.from_pretrained(path)
    config = Qwen3MoeConfig(
        vocab_size=-(-dense.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=0.0, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=dense.eos_token_id, pad_token_id=dense.pad_token_id)
    for stale in path.glob("model*.safetensors*"):
        stale.unlink()
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path, pad_id, vocab


def parse_aux(text: str) -> tuple[str, float]:
    """``KIND:COEF`` (KIND one of ``AUX_KINDS``), e.g. ``aux_loss:0.01``."""
    import argparse

    kind, _, coef = text.partition(":")
    try:
        value = float(coef)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KIND:COEF, e.g. aux_loss:0.01, got {text!r}") from None
    if kind not in AUX_KINDS or value <= 0:
        raise argparse.ArgumentTypeError(f"KIND is one of {', '.join(AUX_KINDS)} and COEF > 0, got {text!r}")
    return kind, value


def aux_overrides(kind: str | None, coef: float = 0.0) -> dict:
    """``override_transformer_config`` keys that turn one router loss on (point 2); {} for none."""
    if kind is None:
        return {}
    if kind == "z_loss":
        return {"moe_z_loss_coeff": coef}
    return {"moe_router_load_balancing_type": kind, "moe_aux_loss_coeff": coef}


def apply_moe(config, ep: int = 1, aux: tuple[str, float] | None = None):
    """Expert parallel ``ep`` and the router loss ``aux`` (point 2) on a composed Megatron ``config``, in place."""
    from omegaconf import OmegaConf

    OmegaConf.update(config, f"{MEGA}.expert_model_parallel_size", ep)
    OmegaConf.update(config, f"{MEGA}.expert_tensor_parallel_size", 1)
    for key, value in aux_overrides(*(aux or (None,))).items():
        OmegaConf.update(config, f"{MEGA}.override_transformer_config.{key}", value, force_add=True)
    return config


# ----- the comparison's flags (benchmarks/equivalence.py) -----------------------------------------
def apply_moe_args(config, args):
    """``apply_moe`` with ``--ep`` when ``--moe`` is on; the config unchanged otherwise."""
    return apply_moe(config, ep=args.ep) if getattr(args, "moe", False) else config


def add_moe_arguments(parser) -> None:
    parser.add_argument("--moe", action="store_true", help="megatron: the tiny Qwen3-MoE (4 experts, top-2)")
    parser.add_argument("--ep", type=int, default=1, choices=[1, 2], help="megatron --moe: expert parallel size")


def check_moe(parser, args):
    """``args`` when ``--moe`` / ``--ep`` fit the comparison, else ``parser.error`` (point 3)."""
    if args.ep > 1 and not args.moe:
        parser.error("--ep splits the experts of --moe")
    if not args.moe:
        return args
    refused = [flag for flag, on in (
        ("--engine fsdp", args.engine != "megatron"), ("--kl", args.kl), ("--entropy", args.entropy),
        ("--estimator", args.estimator != "grpo"), ("--mini-batches", args.mini_batches > 1),
        ("--ppo-epochs", args.ppo_epochs > 1), ("--per-token-loss", args.per_token_loss),
        ("--float64-sum", args.float64_sum), ("--tp 2", args.tp > 1), ("--pp 2", args.pp > 1)) if on]
    if refused:
        parser.error(f"--moe runs the plain GRPO comparison on --engine megatron; not with {', '.join(refused)}")
    if args.dp % args.ep:
        parser.error(f"--ep {args.ep} needs --dp {args.ep}: Megatron carves expert-parallel ranks out of the "
                     "data-parallel ones")
    return args


def moe_result(args, result: dict, name: str) -> str:
    """Add the ``moe`` and ``ep`` keys to ``result``; the name with ``_moe`` / ``_epN`` (dense names unchanged)."""
    moe, ep = bool(getattr(args, "moe", False)), int(getattr(args, "ep", 1))
    result.update(moe=moe, ep=ep)
    return name + ("_moe" if moe else "") + (f"_ep{ep}" if ep > 1 else "")


# ----- the router losses and micro-batch composition (benchmarks/moe_aux_loss.py) ------------------
def stride_order(n_rows: int, micro: int) -> list[int]:
    """Rows regrouped so that no two share a micro-batch of ``micro`` rows in both orders (the floor's regrouping)."""
    from thundersync_harness.minibatch_steps import regrouped

    return regrouped([list(range(n_rows))], micro)[0]


def composition_steps(wg, batches, pad_id: int, micro: int) -> dict:
    """verl's own update, per batch, five ways (point 4): ``a`` rows in order; ``b`` regrouped (same micro-batch
    size and count); ``half`` micro-batches of ``micro / 2`` rows; ``a0`` / ``b0`` as ``a`` / ``b`` with every
    advantage 0 (the policy term vanishes: what is left of the update is the router loss's alone). And
    ``stream``: the streamed step with the learner's router-loss refusal lifted (``RouterProbeWorker``)."""
    from functools import partial

    from thundersync_harness.engine_steps import PolicySpec, sync_step

    zero = PolicySpec(advantage_scale=0.0)
    steps = {k: [] for k in ("a", "b", "half", "a0", "b0", "stream")}
    for trajs, arrival in batches:
        order, other = list(range(len(trajs))), stride_order(len(trajs), micro)
        steps["a"].append(partial(sync_step, wg, trajs, order, pad_id))
        steps["b"].append(partial(sync_step, wg, trajs, other, pad_id))
        steps["half"].append(partial(sync_step, wg, trajs, order, pad_id, micro=max(1, micro // 2)))
        steps["a0"].append(partial(sync_step, wg, trajs, order, pad_id, zero))
        steps["b0"].append(partial(sync_step, wg, trajs, other, pad_id, zero))
        steps["stream"].append(partial(_unrefused_stream_step, wg, trajs, arrival, pad_id))
    return steps


def _unrefused_stream_step(wg, trajs, arrival, pad_id: int) -> dict:
    from thundersync_harness.engine_steps import stream_step

    wg.probe_ignore_router_losses(True)
    try:
        return stream_step(wg, trajs, arrival, pad_id)
    finally:
        wg.probe_ignore_router_losses(False)


def router_probe_worker_class():
    """``StreamingActorWorker`` plus ``probe_ignore_router_losses(on)``: with it on, the learner streams with a
    router loss on (its ``auxiliary_losses`` refusal lifted, every other rule kept), to measure what the refusal
    prevents. Off (the default) it is the streaming worker unchanged."""
    from thundersync_verl import verl_adapter as va
    from thundersync_verl.backends.megatron import grads as mg
    from thundersync_verl.learner import engine_rules
    from thundersync_verl.learner.engines.megatron import MegatronLearner
    from thundersync_verl.learner.streaming_worker import Dispatch, StreamingActorWorker, register

    class RouterLossBlindLearner(MegatronLearner):
        def check(self) -> None:
            chunks = self._chunks()
            facts = dict(va.megatron_streaming_blockers(self._engine()), strategy=va.actor_strategy(self.worker),
                         model_chunks=len(chunks), overlap_grad_reduce=bool(mg.ddp_config(chunks).overlap_grad_reduce),
                         auxiliary_losses=None)
            engine_rules.raise_first(facts, engine=self.name, owners=(engine_rules.STREAM,))

    class RouterProbeWorker(StreamingActorWorker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def probe_ignore_router_losses(self, on: bool) -> None:
            self._ts_learner = RouterLossBlindLearner(self) if on else None

    return RouterProbeWorker


def composition_rows(runs: dict) -> list[dict]:
    """Per step: ``regrouped`` ||b - a|| / ||a||, ``half_micro`` ||half - a|| / ||a||, ``router_share``
    ||a0|| / ||a||, ``router_regrouped`` ||b0 - a0|| / ||a0|| (None when the router term is exactly 0) and
    ``stream`` ||stream - a|| / ||a||."""
    from thundersync_harness.engine_steps import relative_gap

    rows = []
    for a, b, h, a0, b0, st in zip(*(runs[k][0] for k in ("a", "b", "half", "a0", "b0", "stream"))):
        zero = float(a0.norm()) == 0.0
        rows.append({"regrouped": relative_gap(b, a), "half_micro": relative_gap(h, a),
                     "router_share": float(a0.double().norm() / a.double().norm()),
                     "router_regrouped": None if zero else relative_gap(b0, a0), "stream": relative_gap(st, a)})
    return rows


def stream_refusal(wg, batch, pad_id: int) -> str | None:
    """The first line of the streaming learner's refusal of a streamed step on ``wg``; None when it streams."""
    from thundersync_harness.engine_steps import stream_step

    trajs, arrival = batch
    try:
        stream_step(wg, trajs, arrival, pad_id)
    except Exception as exc:  # the worker's StreamingConfigError, raised through Ray
        text = str(exc)
        start = text.find("streaming on Megatron")
        return text[start:].splitlines()[0] if start >= 0 else text.splitlines()[-1]
    return None
