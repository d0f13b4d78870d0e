"""Off-policy corrections that stay linear, and sign buckets for PPO's clip at ratio != 1.

Oracles: verl's compute_rollout_correction_weights and its vanilla policy loss (with old
log-probs from a perturbed "rollout engine" model, so ratios leave the clip band).

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import random

import pytest
import torch

from thundersync_verl.core import (
    NEG,
    POS,
    StreamingConfigError,
    check_sign_independent,
    double_sided_token_mask,
    ppo_clip_token_weights,
    rollout_is_weights,
    token_weights,
)

CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "0.5_2.0"])
def test_is_weights_match_verl(level, threshold):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    rollout = old + 0.4 * torch.randn(5, 7, generator=g, dtype=torch.float64) * (0.3 if level == "sequence" else 1)
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    expected, _ = compute_rollout_correction_weights(old - rollout, mask, level, threshold)
    upper, lower = (threshold, None) if isinstance(threshold, float) else (2.0, 0.5)
    got = rollout_is_weights(old, rollout, mask, level=level, upper=upper, lower=lower)
    assert torch.equal(got, expected)
    assert not got.requires_grad


def test_ppo_clip_token_weights_match_verl_gradient():
    """d(verl vanilla loss)/d(log_prob) == -A * c_t with c_t from the matching sign class."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
    from verl.workers.config import ActorConfig

    g = torch.Generator().manual_seed(1)
    old = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 2
    log_prob = (old + 0.5 * torch.randn(6, 9, generator=g, dtype=torch.float64)).requires_grad_()
    adv_rows = torch.tensor([1.3, -0.7, 2.0, -2.5, 0.4, -0.1], dtype=torch.float64)
    adv = adv_rows[:, None].expand(6, 9)
    mask = torch.ones(6, 9, dtype=torch.bool)
    cfg = ActorConfig(strategy="fsdp2", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                      use_dynamic_bsz=False, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    cfg.global_batch_info.update(dp_size=1)
    loss, _ = compute_policy_loss_vanilla(old, log_prob, adv, mask, "token-sum", cfg)
    loss.backward()
    pos = ppo_clip_token_weights(log_prob, old, "pos", **CLIP)
    neg = ppo_clip_token_weights(log_prob, old, "neg", **CLIP)
    chosen = torch.where(adv > 0, pos, neg)
    assert torch.allclose(log_prob.grad, -adv * chosen, rtol=1e-14, atol=1e-15)
    assert bool((pos != neg).any())  # the data really exercises both branches
    with pytest.raises(StreamingConfigError, match="sign_buckets"):
        check_sign_independent(log_prob, old, mask, **CLIP)
    check_sign_independent(log_prob, log_prob.detach(), mask, **CLIP)  # ratio 1: linear


def test_double_sided_mask_is_strict_and_sign_free():
    lp = torch.log(torch.tensor([[0.69, 0.71, 1.0, 5.99, 6.01]], dtype=torch.float64))
    keep = double_sided_token_mask(lp, torch.zeros_like(lp), eps_low=0.3, eps_high=5.0)
    assert keep.tolist() == [[False, True, True, True, False]]
    with pytest.raises(StreamingConfigError, match="0.3"):
        double_sided_token_mask(lp, lp, eps_low=0.0, eps_high=5.0)


def _perturbed(harness, model, seed: int, scale: float):
    """A copy of ``model`` with noisy weights: the "rollout engine" whose log-probs differ."""
    rollout = type(model)(model.config).to(next(model.parameters()).dtype)
    rollout.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in rollout.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    rollout.eval()
    return harness.use_own_dtype_norms(rollout)


def _oracle(harness, model, spec, trajs, old, is_weights):
    return harness.oracle_gradient(model, None, spec, trajs, old_log_prob=old, is_weights=is_weights)


def _stream(harness, model, spec, trajs, order, weights_of, sign_buckets):
    """Per-trajectory streaming with per-token detached weights (per sign class if needed)."""
    acc = harness.make_accumulator(model, spec, "buckets" if sign_buckets else "affine", sign_buckets=sign_buckets)
    sizes = {}
    for t in trajs:
        sizes[t.gid] = sizes.get(t.gid, 0) + 1
    acc.begin_batch(sizes)
    params = list(model.parameters())
    late = []
    for k in order:
        t = trajs[k]
        logp, mask, _ = harness.response_log_probs(model, [t])
        base = token_weights(spec.loss_agg_mode, mask, dtype=logp.dtype)  # [1, T]
        grads = {}
        variants = acc.required_variants(t.gid, t.tid) if sign_buckets else ("any",)
        for i, v in enumerate(variants):
            model.zero_grad(set_to_none=True)
            (logp * base * weights_of(k, logp, v)).sum().backward(retain_graph=i + 1 < len(variants))
            grads[v] = [p.grad.clone() if p.grad is not None else None for p in params]
        reward = t.reward if k % 2 else None  # half the rewards arrive after the gradient
        acc.add_policy_grad(t.gid, t.tid, grads.get(POS, grads.get("any")), len(t.response), reward=reward,
                            grads_negative=grads.get(NEG))
        if reward is None:
            late.append(t)
    for t in late:
        acc.report_reward(t.gid, t.tid, t.reward)
    model.zero_grad(set_to_none=True)
    return acc.compute_batch_gradient()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_sign_buckets_match_verl_ppo_clip_against_rollout_log_probs(harness, agg):
    model = harness.tiny_qwen2(0, torch.float64)
    rollout = _perturbed(harness, model, 5, 0.15)
    spec = harness.LossSpec(estimator="grpo", loss_agg_mode=agg, clip_low=0.2, clip_high=0.28, clip_c=3.0)
    trajs = harness.make_batch(11, [4, 3, 4], "ties", response_len=(4, 10))
    with torch.no_grad():
        old, mask, _ = harness.response_log_probs(rollout, trajs)
        cur, _, _ = harness.response_log_probs(model, trajs)
    pos = ppo_clip_token_weights(cur, old, "pos", **CLIP)
    neg = ppo_clip_token_weights(cur, old, "neg", **CLIP)
    assert bool(((pos != neg) & mask).any()), "rollout model must push some ratios out of the band"
    expected = _oracle(harness, model, spec, trajs, old, None)

    def weights_of(k, logp, v):
        n = len(trajs[k].response)
        return ppo_clip_token_weights(logp, old[k : k + 1, :n], v, **CLIP)

    order = list(range(len(trajs)))
    random.Random(3).shuffle(order)
    got = _stream(harness, model, spec, trajs, order, weights_of, sign_buckets=True)
    assert harness.relative_error(got, expected) <= 1e-12


@pytest.mark.parametrize("kind", ["tis-token", "tis-sequence", "icepop-token", "sao-mask"])
def test_detached_corrections_stream_exactly(harness, kind):
    """Decoupled mode: old log-probs recomputed (ratio 1) + detached per-token factor."""
    model = harness.tiny_qwen2(0, torch.float64)
    rollout = _perturbed(harness, model, 9, 0.1)
    spec = harness.LossSpec(estimator="rloo", loss_agg_mode="token-mean")
    trajs = harness.make_batch(12, [3, 4, 2], "binary", response_len=(3, 9))
    with torch.no_grad():
        roll, mask, _ = harness.response_log_probs(rollout, trajs)
        cur, _, _ = harness.response_log_probs(model, trajs)
    if kind == "sao-mask":
        factor = double_sided_token_mask(cur, roll, eps_low=0.3, eps_high=0.4).to(cur.dtype) * mask
        assert 0 < float(factor.sum()) < float(mask.sum())
    else:
        level = kind.split("-")[1]
        lower = 0.7 if kind.startswith("icepop") else None
        factor = rollout_is_weights(cur, roll, mask, level=level, upper=1.3, lower=lower)
    expected = _oracle(harness, model, spec, trajs, None, factor)

    def weights_of(k, logp, v):
        return factor[k : k + 1, : len(trajs[k].response)]

    order = list(range(len(trajs)))
    random.Random(4).shuffle(order)
    got = _stream(harness, model, spec, trajs, order, weights_of, sign_buckets=False)
    assert harness.relative_error(got, expected) <= 1e-12
