"""A tiny-transformer exactness harness: verl's batch-synchronous loss vs the streamed accumulator.

Why:
1. The exactness benchmarks and the core's tests compare the streamed gradient with the
   batch-synchronous gradient that verl's OWN functions produce (advantage estimators,
   ``agg_loss``, the vanilla policy loss, ``kl_penalty``) on a real tiny transformer. One
   harness serves both, so the figures printed are produced by the code the tests check.
2. The streamed side is the caller flow a learner backend runs: per-trajectory backward, then
   ``StreamingGradientAccumulator`` (affine path, buckets, pending rewards, chunks, canonical order).
3. Heavy imports (transformers, verl) happen inside the functions that need them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


# ----- tiny transformer and data -----------------------------------------------------------
@dataclass(frozen=True)
class Trajectory:
    gid: int
    tid: int
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    reward: float


def tiny_qwen2(seed: int = 0, dtype: torch.dtype = torch.float32, hidden: int = 32, layers: int = 2, vocab: int = 128):
    """A Qwen2ForCausalLM small enough for exhaustive CPU checks (eager attention, no dropout)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="sdpa",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    model.eval()  # no dropout; gradients still flow
    return use_own_dtype_norms(model)


def use_own_dtype_norms(model):
    """Make every RMSNorm of ``model`` compute in the model's dtype (see below); returns it."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _rms_norm_in_own_dtype.__get__(module)
    return model


def _rms_norm_in_own_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """RMSNorm without the library's float32 round trip, so float64 checks stay float64.

    The stock layer computes in float32 and casts back: a float64 model then rounds every
    activation to float32 and float64 comparisons would measure that rounding, not streaming.
    For float32 models the two are the same computation.
    """
    x = hidden_states.to(torch.promote_types(hidden_states.dtype, torch.float32))  # [..., H]
    variance = x.pow(2).mean(-1, keepdim=True)  # [..., 1]
    x = x * torch.rsqrt(variance + self.variance_epsilon)  # [..., H]
    return self.weight * x.to(hidden_states.dtype)


def make_batch(
    seed: int,
    group_sizes: list[int],
    reward_kind: str = "binary",
    prompt_len: tuple[int, int] = (3, 6),
    response_len: tuple[int, int] = (2, 9),
    vocab: int = 128,
) -> list[Trajectory]:
    """Groups of trajectories sharing a prompt, with binary, continuous or tied rewards."""
    rng = random.Random(seed)
    out = []
    for gid, n in enumerate(group_sizes):
        prompt = tuple(rng.randrange(vocab) for _ in range(rng.randint(*prompt_len)))
        for tid in range(n):
            response = tuple(rng.randrange(vocab) for _ in range(rng.randint(*response_len)))
            if reward_kind == "binary":
                reward = float(rng.random() < 0.5)
            elif reward_kind == "ties":
                reward = float(rng.choice([0.0, 0.5, 1.0]))
            else:
                reward = rng.gauss(0.0, 1.0)
            out.append(Trajectory(gid, tid, prompt, response, reward))
    return out


def response_log_probs(model, trajs: list[Trajectory], with_logits: bool = False):
    """Per-token log pi of each response token under ``model``, right-padded: [B, T] + mask.

    Returns (log_probs [B, T], mask [B, T] bool, response logits [B, T, V] or None).
    """
    lengths = [len(t.prompt) + len(t.response) for t in trajs]
    n_b, n_l, n_t = len(trajs), max(lengths), max(len(t.response) for t in trajs)
    dev = next(model.parameters()).device
    ids = torch.zeros(n_b, n_l, dtype=torch.long, device=dev)
    attn = torch.zeros(n_b, n_l, dtype=torch.long, device=dev)
    pos = torch.zeros(n_b, n_t, dtype=torch.long, device=dev)
    mask = torch.zeros(n_b, n_t, dtype=torch.bool, device=dev)
    for b, t in enumerate(trajs):
        seq = list(t.prompt) + list(t.response)
        ids[b, : len(seq)] = torch.tensor(seq)
        attn[b, : len(seq)] = 1
        r = len(t.response)
        pos[b, :r] = torch.arange(len(t.prompt), len(seq))
        pos[b, r:] = len(t.prompt)  # padding: any valid position, masked out below
        mask[b, :r] = True
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits  # [B, L, V] (a training forward, as verl's actor)
    pred = logits.gather(1, (pos - 1).unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # [B, T, V]
    tokens = ids.gather(1, pos)  # [B, T]
    logp = torch.log_softmax(pred, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, T]
    logp = logp * mask
    return logp, mask, (pred if with_logits else None)


# ----- the batch-synchronous oracle, built from verl's own functions -----------------------
@dataclass(frozen=True)
class LossSpec:
    """The objective both sides optimise (mirrors verl's ppo_loss composition)."""

    estimator: str = "grpo"  # "grpo", "grpo_no_std", "rloo"
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float = 3.0


def verl_advantages(spec: LossSpec, trajs: list[Trajectory], mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T] advantages from verl's estimator on outcome rewards placed at the last token."""
    import numpy as np
    from verl.trainer.ppo import core_algos as ca

    rewards = torch.zeros(mask.shape, dtype=dtype)
    for b, t in enumerate(trajs):
        rewards[b, len(t.response) - 1] = t.reward
    index = np.array([t.gid for t in trajs])
    maskf = mask.to(dtype)
    if spec.estimator == "rloo":
        adv, _ = ca.compute_rloo_outcome_advantage(rewards, maskf, index)
    else:
        norm = spec.estimator == "grpo"
        adv, _ = ca.compute_grpo_outcome_advantage(rewards, maskf, index, norm_adv_by_std_in_grpo=norm)
    return adv


def verl_actor_config(spec: LossSpec, batch_size: int):
    from verl.workers.config import ActorConfig

    cfg = ActorConfig(
        strategy="fsdp2",
        ppo_mini_batch_size=batch_size,
        ppo_micro_batch_size_per_gpu=batch_size,
        use_dynamic_bsz=False,
        clip_ratio=0.2,
        clip_ratio_low=spec.clip_low,
        clip_ratio_high=spec.clip_high,
        clip_ratio_c=spec.clip_c,
        loss_agg_mode=spec.loss_agg_mode,
        loss_scale_factor=spec.loss_scale_factor,
        rollout_n=1,
    )
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=None, global_batch_size=None)
    cfg.global_batch_info["loss_scale_factor"] = spec.loss_scale_factor
    return cfg


def verl_oracle_loss(model, ref_model, spec: LossSpec, trajs: list[Trajectory], old_log_prob=None, is_weights=None):
    """verl's batch-synchronous loss for the whole batch (one padded forward)."""
    from verl.trainer.ppo import core_algos as ca
    from verl.utils.torch_functional import entropy_from_logits

    dtype = next(model.parameters()).dtype
    logp, mask, logits = response_log_probs(model, trajs, with_logits=spec.entropy_coeff != 0.0)
    adv = verl_advantages(spec, trajs, mask, dtype)
    cfg = verl_actor_config(spec, len(trajs))
    old = logp.detach() if old_log_prob is None else old_log_prob
    policy_fn = ca.get_policy_loss_fn("vanilla")
    loss, _ = policy_fn(old, logp, adv, mask, spec.loss_agg_mode, cfg, is_weights)
    info = cfg.global_batch_info
    if spec.entropy_coeff != 0.0:
        ent = entropy_from_logits(logits)  # [B, T]
        loss = loss - spec.entropy_coeff * ca.agg_loss(ent, mask, spec.loss_agg_mode, **info)
    if spec.kl_coef != 0.0:
        with torch.no_grad():
            ref_logp, _, _ = response_log_probs(ref_model, trajs)
        kld = ca.kl_penalty(logp, ref_logp, spec.kl_type)
        loss = loss + spec.kl_coef * ca.agg_loss(kld, mask, spec.loss_agg_mode, **info)
    return loss


def oracle_gradient(model, ref_model, spec: LossSpec, trajs: list[Trajectory], **kwargs) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    verl_oracle_loss(model, ref_model, spec, trajs, **kwargs).backward()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all tensors, computed in float64."""
    num = sum(float(((x.double() - y.double()) ** 2).sum()) for x, y in zip(a, b))
    den = sum(float((y.double() ** 2).sum()) for y in b)
    return (num / den) ** 0.5 if den > 0 else num**0.5


# ----- the streamed side: the caller flow a learner backend runs ----------------------------
STREAM_MODES = ("affine", "buckets", "pending", "chunked", "canonical")


def make_accumulator(model, spec: LossSpec, mode: str, **kwargs):
    """An accumulator for ``model``'s parameters configured for streaming ``mode``."""
    from thundersync_verl.core import GRPOEstimator, RLOOEstimator, StreamingGradientAccumulator

    dtype = next(model.parameters()).dtype  # verl's statistics run in the reward dtype
    estimator = {
        "grpo": GRPOEstimator(True, dtype=dtype),
        "grpo_no_std": GRPOEstimator(False, dtype=dtype),
        "rloo": RLOOEstimator(dtype=dtype),
    }
    has_independent = spec.entropy_coeff != 0.0 or spec.kl_coef != 0.0
    return StreamingGradientAccumulator(
        list(model.parameters()),
        estimator=estimator[spec.estimator],
        loss_agg_mode=spec.loss_agg_mode,
        loss_scale_factor=spec.loss_scale_factor,
        path="buckets" if mode == "buckets" else "auto",
        canonical_order=mode == "canonical",
        independent_terms=mode == "canonical" and has_independent,
        **kwargs,
    )


def _terms(model, ref_model, spec: LossSpec, trajs: list[Trajectory]):
    """(policy surrogate sum_t w log pi per row [B], reward-independent loss or None, token counts)."""
    from thundersync_verl.core import entropy_from_logits, kl_per_token, token_weights

    logp, mask, logits = response_log_probs(model, trajs, with_logits=spec.entropy_coeff != 0.0)
    w = token_weights(spec.loss_agg_mode, mask, dtype=logp.dtype)  # [B, T]
    surrogate = (logp * w).sum(dim=-1)  # [B]
    indep = None
    if spec.entropy_coeff != 0.0:
        indep = -spec.entropy_coeff * (entropy_from_logits(logits) * w).sum()
    if spec.kl_coef != 0.0:
        with torch.no_grad():
            ref_logp, _, _ = response_log_probs(ref_model, trajs)
        kl = spec.kl_coef * (kl_per_token(logp, ref_logp, spec.kl_type) * w).sum()
        indep = kl if indep is None else indep + kl
    return surrogate, indep, [len(t.response) for t in trajs]


def _grads(params) -> list[torch.Tensor | None]:
    return [p.grad for p in params]


def stream_batch(acc, model, ref_model, spec: LossSpec, trajs: list[Trajectory], order: list[int], mode: str,
                 chunk_every: int = 4, max_chunk: int = 8) -> None:
    """Feed one batch into ``acc`` in arrival ``order`` (indices into ``trajs``); no barrier."""
    sizes: dict[int, int] = {}
    for t in trajs:
        sizes[t.gid] = sizes.get(t.gid, 0) + 1
    acc.begin_batch(sizes)
    if mode == "chunked":
        _stream_chunked(acc, model, ref_model, spec, trajs, order, chunk_every, max_chunk)
        return
    params = list(model.parameters())
    late: list[Trajectory] = []
    for k in order:
        t = trajs[k]
        surrogate, indep, counts = _terms(model, ref_model, spec, [t])
        model.zero_grad(set_to_none=True)
        surrogate.sum().backward(retain_graph=indep is not None)
        reward = None if mode == "pending" else t.reward
        acc.add_policy_grad_from_params(params, t.gid, t.tid, counts[0], reward=reward)
        if indep is not None:
            model.zero_grad(set_to_none=True)
            indep.backward()
            key = (t.gid, t.tid) if mode == "canonical" else None
            acc.add_independent_grad_from_params(params, key=key)
        if mode == "pending":  # rewards arrive two trajectories late
            late.append(t)
            if len(late) > 2:
                r = late.pop(0)
                acc.report_reward(r.gid, r.tid, r.reward)
    for r in late:
        acc.report_reward(r.gid, r.tid, r.reward)
    model.zero_grad(set_to_none=True)


def _stream_chunked(acc, model, ref_model, spec, trajs, order, chunk_every, max_chunk) -> None:
    """Rewards reported on arrival; every ``chunk_every`` arrivals the ready set runs in chunks."""
    params = list(model.parameters())
    by_key = {(t.gid, t.tid): t for t in trajs}
    ready: list[tuple[int, int]] = []
    for i, k in enumerate(order):
        t = trajs[k]
        acc.report_reward(t.gid, t.tid, t.reward)
        ready.append((t.gid, t.tid))
        if (i + 1) % chunk_every and i + 1 < len(order):
            continue
        chunks, waiting = acc.split_into_chunks(ready, max_chunk)
        for chunk in chunks:
            plan = acc.plan_chunk(chunk)
            members = [by_key[it] for it in chunk]
            surrogate, indep, counts = _terms(model, ref_model, spec, members)
            weights = torch.tensor(plan.loss_weights, dtype=surrogate.dtype)  # [C]
            loss = (weights * surrogate).sum()
            direct = plan.destination == "direct"
            if direct and indep is not None:
                loss = loss + indep  # same destination, same normaliser: one backward
            model.zero_grad(set_to_none=True)
            loss.backward(retain_graph=indep is not None and not direct)
            acc.add_chunk_grad(plan, _grads(params), counts)
            if indep is not None and not direct:
                model.zero_grad(set_to_none=True)
                indep.backward()
                acc.add_independent_grad(_grads(params))
        ready = list(waiting)
    model.zero_grad(set_to_none=True)
