"""The streamed chunk loss with verl's KL loss and entropy bonus (stream_loss.py point 6). No GPU, no Ray.

1. A tiny bigram model (one [V, V] logit table) gives the per-token log-probs and entropies that
   verl's engine would hand the loss, in verl's no-padding layout, on a real streamed chunk.
2. The KL/entropy part of a chunk times the deferred normaliser equals verl's own
   ``kl_loss_coef * agg_loss(kl_penalty) - entropy_coeff * agg_loss(entropy)`` for every
   ``kl_loss_type`` and every ``loss_agg_mode`` of verl 0.9.1.
3. The hand-checkable case of the bucket route: a bucketed row's policy part is multiplied by
   A at the fold, its KL/entropy part is not; the sum equals the direct row's gradient with A.
"""

from __future__ import annotations

import pytest
import torch

from thundersync_verl.core import LOSS_AGG_MODES, StreamingConfigError, StreamingInputError, batch_scale
from thundersync_verl.step.chunk_layout import PART_KEY, IndependentTerms, build_stream_chunk
from thundersync_verl.learner.stream_loss import make_stream_loss, set_chunk_part, stream_policy_loss

VOCAB = 11
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 2, 1]]
RESPONSES = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [2, 2]]
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "low_var_kl+", "abs+")
LOSS_SCALE_FACTOR = 7.0


def _chunk(coefs, dest="direct", with_ref=True):
    ref = [[-2.0 - 0.1 * t - 0.05 * b for t in range(len(r))] for b, r in enumerate(RESPONSES)] if with_ref else None
    return build_stream_chunk(PROMPTS, RESPONSES, coefs, dest, dp_size=1, pad_token_id=0, ref_log_probs=ref)


def _model_output(table: torch.Tensor, chunk) -> dict:
    """log p(x_{p+1} | x_p) and the entropy at every position, flat over the chunk's sequences (verl's layout)."""
    ids = chunk["input_ids"]  # nested [B, j]
    offsets = ids.offsets().tolist()
    flat = ids.values()  # [total_nnz]
    log_soft = torch.log_softmax(table[flat], dim=-1)  # [nnz, V]
    nxt = torch.cat([flat[1:], flat[:1]])  # [nnz], the next token (wraps at sequence ends: never scored)
    log_probs = log_soft.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)  # [nnz]
    entropy = -(log_soft.exp() * log_soft).sum(-1)  # [nnz]
    ends = torch.tensor(offsets[1:]) - 1
    keep = torch.ones_like(log_probs)
    keep[ends] = 0.0  # the last position of a sequence predicts nothing
    return {"log_probs": log_probs * keep, "entropy": entropy}


def _table(seed=0):
    torch.manual_seed(seed)
    return torch.randn(VOCAB, VOCAB, dtype=torch.float32, requires_grad=True)


def _grad(table, chunk, terms, mode="token-mean", part="all"):
    set_chunk_part(chunk, part, terms)
    loss, _ = make_stream_loss(mode, terms)(_model_output(table, chunk), chunk)
    (g,) = torch.autograd.grad(loss, table)
    return g


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_kl_and_entropy_part_times_the_deferred_normaliser_is_verls_loss(mode, kl_type):
    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty
    from verl.workers.utils.padding import no_padding_2_padding

    terms = IndependentTerms(use_kl_loss=True, kl_loss_type=kl_type, kl_loss_coef=0.3, entropy_coeff=0.02)
    table, chunk = _table(), _chunk([0.0, 0.0, 0.0])
    set_chunk_part(chunk, "independent", terms)
    out = _model_output(table, chunk)
    ours, metrics = stream_policy_loss(out, chunk, loss_agg_mode=mode, terms=terms)
    mask = chunk["response_mask"].bool()  # [B, R]
    info = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=len(RESPONSES),
                loss_scale_factor=LOSS_SCALE_FACTOR if mode == "seq-mean-token-sum-norm" else None)
    log_prob = no_padding_2_padding(out["log_probs"], chunk)  # [B, R]
    entropy = no_padding_2_padding(out["entropy"], chunk)  # [B, R]
    ref = chunk["ts_ref_log_prob"]  # [B, R]
    verl = 0.3 * agg_loss(kl_penalty(log_prob, ref, kl_type), mask, mode, **info) - 0.02 * agg_loss(entropy, mask, mode, **info)
    scale = batch_scale(mode, num_tokens=info["batch_num_tokens"], num_sequences=len(RESPONSES),
                        loss_scale_factor=info["loss_scale_factor"])
    assert float(ours.detach()) * scale == pytest.approx(float(verl), rel=2e-6, abs=1e-7)
    (g_ours,) = torch.autograd.grad(ours * scale, table, retain_graph=True)
    (g_verl,) = torch.autograd.grad(verl, table)
    torch.testing.assert_close(g_ours, g_verl, rtol=2e-5, atol=1e-7)  # the "+" forms: k2's gradient, as verl's
    assert "stream/kl_loss_sum" in metrics and "stream/entropy_sum" in metrics


def test_a_bucketed_rows_kl_and_entropy_gradient_is_not_scaled_by_its_advantage():
    terms = IndependentTerms(use_kl_loss=True, kl_loss_type="k1", kl_loss_coef=0.5, entropy_coeff=0.1)
    advantage = -1.5  # A(r) the fold applies once the group closes
    table = _table(1)
    bucket = _grad(table, _chunk([1.0, 1.0, 1.0], dest="g=0|r=1.0"), terms, part="policy")  # into the bucket
    direct = _grad(table, _chunk([1.0, 1.0, 1.0], dest="g=0|r=1.0"), terms, part="independent")  # into .grad
    folded = direct + advantage * bucket  # .grad after stream_fold({bucket: A})
    closed = _grad(table, _chunk([advantage] * 3), terms, part="all")  # the same rows, group already closed
    torch.testing.assert_close(folded, closed, rtol=1e-5, atol=1e-6)
    wrong = advantage * (bucket + direct)  # what one bucket backward of every term would give
    assert float((wrong - closed).norm()) > 0.1 * float(closed.norm())
    # by hand: the independent part is grad sum_t (0.5 (log pi - ref) - 0.1 H) over the scored tokens
    chunk = _chunk([1.0, 1.0, 1.0])
    out = _model_output(table, chunk)
    from verl.workers.utils.padding import no_padding_2_padding

    mask = chunk["response_mask"].float()  # [B, R]
    log_prob, entropy = no_padding_2_padding(out["log_probs"], chunk), no_padding_2_padding(out["entropy"], chunk)
    by_hand = ((0.5 * (log_prob - chunk["ts_ref_log_prob"]) - 0.1 * entropy) * mask).sum()
    (g_hand,) = torch.autograd.grad(by_hand, table)
    torch.testing.assert_close(direct, g_hand, rtol=1e-5, atol=1e-6)


def test_without_terms_the_parts_are_the_policy_term_alone():
    table = _table(2)
    plain = _grad(table, _chunk([0.7, -0.2, 1.1], with_ref=False), IndependentTerms(), part="all")
    policy = _grad(table, _chunk([0.7, -0.2, 1.1], with_ref=False), IndependentTerms(), part="policy")
    torch.testing.assert_close(plain, policy)
    assert float(plain.norm()) > 0


def test_a_kl_chunk_without_reference_log_probs_is_refused_with_the_rule():
    terms = IndependentTerms(use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.1)
    chunk = _chunk([1.0, 1.0, 1.0], with_ref=False)
    set_chunk_part(chunk, "all", terms)
    with pytest.raises(StreamingInputError, match="no ts_ref_log_prob") as info:
        stream_policy_loss(_model_output(_table(), chunk), chunk, loss_agg_mode="token-mean", terms=terms)
    assert "fix:" in str(info.value)


def test_terms_are_read_from_verls_actor_config_and_an_unknown_kl_type_is_refused():
    from omegaconf import OmegaConf

    actor = OmegaConf.create({"use_kl_loss": True, "kl_loss_type": "k3+", "kl_loss_coef": 0.01, "entropy_coeff": 0.001})
    terms = IndependentTerms.from_actor_config(actor)
    assert terms == IndependentTerms(True, "k3+", 0.01, 0.001) and terms.active
    assert not IndependentTerms.from_actor_config(OmegaConf.create({"entropy_coeff": 0})).active
    with pytest.raises(StreamingConfigError, match="kl_loss_type"):
        IndependentTerms.from_actor_config(OmegaConf.create({"use_kl_loss": True, "kl_loss_type": "full"}))


def test_the_policy_part_computes_no_entropy():
    terms = IndependentTerms(entropy_coeff=0.01)
    chunk = _chunk([1.0, 1.0, 1.0], with_ref=False)
    from thundersync_verl import verl_adapter as va

    set_chunk_part(chunk, "policy", terms)
    assert va.non_tensor(chunk, "calculate_entropy") is False and va.non_tensor(chunk, PART_KEY) == "policy"
    set_chunk_part(chunk, "independent", terms)
    assert va.non_tensor(chunk, "calculate_entropy") is True
    with pytest.raises(ValueError):
        set_chunk_part(chunk, "kl", terms)
