"""The PPO chunk loss of mini-batches after the first (``minibatch_loss.py``). No GPU, no Ray.

A tiny bigram model (one [V, V] logit table) gives the per-token log-probs verl's engine would hand the
loss, in verl's no-padding layout, on a real PPO chunk. Old log-probs are shifted from the current ones so
that ratios leave the clip band on both sides and advantages have both signs: the chunk's gradient times
the mini-batch's deferred normaliser must equal the gradient of verl's OWN ``ppo_loss`` (its
``ActorConfig``, per-mini-batch ``batch_num_tokens`` / ``global_batch_size``) for every ``loss_agg_mode``,
and with verl's KL loss (against seeded reference log-probs) and entropy bonus for every ``kl_loss_type``.
"""

from __future__ import annotations

import pytest
import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import LOSS_AGG_MODES, StreamingConfigError, StreamingInputError, batch_scale
from thundersync_verl.learner.minibatch_loss import PPOLossSettings, build_ppo_chunk, ppo_chunk_loss
from thundersync_verl.step.chunk_layout import REF_LP_KEY, ROLLOUT_LP_KEY, build_stream_chunk

VOCAB = 11
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 2, 1], [4, 4]]
RESPONSES = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [2, 2], [7, 3, 9]]
ADVANTAGES = [1.3, -0.7, 2.0, -2.5]
LOSS_SCALE_FACTOR = 7.0
KL_COEF, ENTROPY_COEF = 0.7, 0.05
ACTOR = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
         "policy_loss": {"loss_mode": "vanilla"}, "use_kl_loss": False, "entropy_coeff": 0.0}


def _log_probs(table: torch.Tensor, chunk) -> torch.Tensor:
    """log p(x_{p+1} | x_p) at every position, flat over the chunk's sequences (verl's no-padding layout)."""
    ids = chunk["input_ids"]  # nested [B, j]
    flat = ids.values()  # [total_nnz]
    log_soft = torch.log_softmax(table[flat], dim=-1)  # [nnz, V]
    nxt = torch.cat([flat[1:], flat[:1]])  # [nnz]; a sequence's last position is never scored
    return log_soft.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)  # [nnz]


def _old(table: torch.Tensor) -> list[list[float]]:
    """The current log-probs shifted by +-0.4 and +-0.1: ratios inside and outside the band (0.8, 1.28)."""
    probe = build_stream_chunk(PROMPTS, RESPONSES, [0.0] * 4, "direct", dp_size=1, pad_token_id=0)
    now = va.unpad_response(_log_probs(table.detach(), probe), probe)  # [B, R]
    shifts = [0.4, -0.4, 0.1, -0.1]
    return [[float(now[b, t]) + shifts[(b + t) % 4] for t in range(len(r))] for b, r in enumerate(RESPONSES)]


def _entropy(table: torch.Tensor, chunk) -> torch.Tensor:
    """The bigram's entropy at every position (flat, verl's no-padding layout), as ``calculate_entropy`` gives it."""
    log_soft = torch.log_softmax(table[chunk["input_ids"].values()], dim=-1)  # [nnz, V]
    return -(log_soft.exp() * log_soft).sum(-1)  # [nnz]


def _model_output(table, chunk, entropy: bool) -> dict:
    out = {"log_probs": _log_probs(table, chunk)}
    if entropy:
        out["entropy"] = _entropy(table, chunk)
    return out


def _verl_grad(table, old, mode, kl_type=None, entropy=False, ref=None):
    """verl's ppo_loss on the same rows, normalised as verl normalises one mini-batch."""
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    cfg = ActorConfig(strategy="fsdp2", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                      use_dynamic_bsz=False, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                      clip_ratio_c=3.0, loss_agg_mode=mode,
                      loss_scale_factor=LOSS_SCALE_FACTOR if mode == "seq-mean-token-sum-norm" else None,
                      use_kl_loss=kl_type is not None, kl_loss_type=kl_type or "low_var_kl",
                      kl_loss_coef=KL_COEF if kl_type else 0.0, entropy_coeff=ENTROPY_COEF if entropy else 0.0)
    data = build_stream_chunk(PROMPTS, RESPONSES, [0.0] * 4, "direct", dp_size=1, pad_token_id=0,
                              rollout_log_probs=old, ref_log_probs=ref)
    if ref is not None:
        data["ref_log_prob"] = data[REF_LP_KEY]
    adv = build_stream_chunk(PROMPTS, RESPONSES, [0.0] * 4, "direct", dp_size=1, pad_token_id=0,
                             rollout_log_probs=[[a] * len(r) for a, r in zip(ADVANTAGES, RESPONSES)])
    data["old_log_probs"], data["advantages"] = data[ROLLOUT_LP_KEY], adv[ROLLOUT_LP_KEY]
    va.assign_non_tensor(data, dp_size=1, batch_num_tokens=sum(len(r) for r in RESPONSES),
                         global_batch_size=len(RESPONSES))
    loss, _ = ppo_loss(cfg, _model_output(table, data, entropy), data)
    (g,) = torch.autograd.grad(loss, table)
    return g


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_ppo_chunk_times_the_deferred_normaliser_is_verls_ppo_loss(mode):
    torch.manual_seed(0)
    table = torch.randn(VOCAB, VOCAB, dtype=torch.float32, requires_grad=True)
    old = _old(table)
    actor = {**ACTOR, "loss_agg_mode": mode}
    parts, clipped = [], 0.0
    for rows in ([0, 1], [2, 3]):  # two chunks of one mini-batch
        chunk = build_ppo_chunk([PROMPTS[i] for i in rows], [RESPONSES[i] for i in rows], [ADVANTAGES[i] for i in rows],
                                [old[i] for i in rows], dp_size=1, pad_token_id=0)
        loss, metrics = ppo_chunk_loss(actor, chunk)({"log_probs": _log_probs(table, chunk)}, chunk)
        (g,) = torch.autograd.grad(loss, table)
        parts.append(g)
        clipped += metrics["stream/pg_clipfrac"]
    scale = batch_scale(mode, num_tokens=sum(len(r) for r in RESPONSES), num_sequences=len(RESPONSES),
                        loss_scale_factor=LOSS_SCALE_FACTOR if mode == "seq-mean-token-sum-norm" else None)
    ours = (parts[0] + parts[1]) * scale
    theirs = _verl_grad(table, old, mode)
    assert clipped > 0  # the clip binds on some tokens: the test exercises PPO's branches, not ratio 1
    assert float(theirs.norm()) > 1e-3
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kl_type,entropy,mode", [("low_var_kl", True, "token-mean"), ("k1", True, "seq-mean-token-mean"),
                                                   ("k2", False, "seq-mean-token-sum"), (None, True, "token-mean"),
                                                   ("mse", True, "seq-mean-token-sum-norm")])
def test_ppo_chunk_with_kl_and_entropy_is_verls_ppo_loss(kl_type, entropy, mode):
    torch.manual_seed(1)
    table = torch.randn(VOCAB, VOCAB, dtype=torch.float32, requires_grad=True)
    old = _old(table)
    gen = torch.Generator().manual_seed(3)
    ref = [[o - 0.3 + 0.6 * float(torch.rand((), generator=gen)) for o in row] for row in old]  # a moved reference
    actor = {**ACTOR, "loss_agg_mode": mode, "use_kl_loss": kl_type is not None, "kl_loss_type": kl_type or "low_var_kl",
             "kl_loss_coef": KL_COEF if kl_type else 0.0, "entropy_coeff": ENTROPY_COEF if entropy else 0.0}
    parts = []
    for rows in ([0, 1], [2, 3]):
        chunk = build_ppo_chunk([PROMPTS[i] for i in rows], [RESPONSES[i] for i in rows], [ADVANTAGES[i] for i in rows],
                                [old[i] for i in rows], dp_size=1, pad_token_id=0,
                                ref_log_probs=[ref[i] for i in rows] if kl_type else None)
        loss_fn = ppo_chunk_loss(actor, chunk)
        assert va.non_tensor(chunk, "calculate_entropy", None) is entropy  # the engine computes it only when used
        loss, metrics = loss_fn(_model_output(table, chunk, entropy), chunk)
        parts.append(torch.autograd.grad(loss, table)[0])
    scale = batch_scale(mode, num_tokens=sum(len(r) for r in RESPONSES), num_sequences=len(RESPONSES),
                        loss_scale_factor=LOSS_SCALE_FACTOR if mode == "seq-mean-token-sum-norm" else None)
    ours = (parts[0] + parts[1]) * scale
    with_terms = _verl_grad(table, old, mode, kl_type, entropy, ref if kl_type else None)
    policy_only = _verl_grad(table, old, mode)
    assert float((with_terms - policy_only).norm()) > 1e-3 * float(with_terms.norm())  # the terms move the gradient
    torch.testing.assert_close(ours, with_terms, rtol=1e-5, atol=1e-7)


def test_plain_chunks_keep_the_streamed_loss_and_bad_ppo_chunks_are_refused():
    plain = build_stream_chunk(PROMPTS[:1], RESPONSES[:1], [1.0], "direct", dp_size=1, pad_token_id=0)
    assert ppo_chunk_loss(ACTOR, plain) is None
    chunk = build_ppo_chunk(PROMPTS[:1], RESPONSES[:1], [1.0], [[-1.0] * 4], dp_size=1, pad_token_id=0)
    with pytest.raises(StreamingInputError, match="use_kl_loss(.|\n)*fix:(.|\n)*ref_log_probs"):
        ppo_chunk_loss({**ACTOR, "use_kl_loss": True}, chunk)  # a KL actor needs the reference log-probs
    with pytest.raises(StreamingConfigError, match="kl"):
        ppo_chunk_loss({**ACTOR, "use_kl_loss": True, "kl_loss_type": "no_such_kl"}, chunk)
    with pytest.raises(StreamingInputError, match="one value per response token"):
        build_ppo_chunk(PROMPTS[:1], RESPONSES[:1], [1.0], [[-1.0] * 2], dp_size=1, pad_token_id=0)
    assert PPOLossSettings({"clip_ratio": 0.3}).clip_ratio_high == 0.3  # unset bounds fall back to clip_ratio
