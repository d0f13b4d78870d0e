"""Deferred normalisers: c_batch * sum w_{i,t} x_{i,t} == verl's agg_loss, for every mode.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync_verl.core import (
    LOSS_AGG_MODES,
    StreamingConfigError,
    StreamingInputError,
    batch_scale,
    token_weight,
    token_weights,
)


def test_closed_forms():
    assert batch_scale("token-mean", num_tokens=8, num_sequences=3) == 1 / 8
    assert batch_scale("token-mean", num_tokens=8, num_sequences=3, dp_size=4) == 4 / 8
    assert batch_scale("token-sum", num_tokens=8, num_sequences=3, dp_size=2) == 2.0
    assert batch_scale("seq-mean-token-sum", num_tokens=8, num_sequences=4) == 1 / 4
    assert batch_scale("seq-mean-token-mean", num_tokens=8, num_sequences=4) == 1 / 4
    assert batch_scale("seq-mean-token-sum-norm", num_tokens=8, num_sequences=4, loss_scale_factor=10) == 1 / 40
    assert token_weight("seq-mean-token-mean", 4) == 0.25
    assert token_weight("token-mean", 4) == 1.0
    assert token_weight("seq-mean-token-mean", 0) == 0.0
    assert batch_scale("token-mean", num_tokens=0, num_sequences=0) is None


def test_token_weights_tensor():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    w = token_weights("seq-mean-token-mean", mask)
    assert torch.equal(w, torch.tensor([[0.5, 0.5, 0, 0], [0.25] * 4, [0.0] * 4], dtype=torch.float64))
    assert torch.equal(token_weights("token-mean", mask, dtype=torch.float32), mask.float())


def test_sum_norm_needs_a_fixed_divisor():
    with pytest.raises(StreamingConfigError, match="actor_rollout_ref.actor.loss_scale_factor"):
        batch_scale("seq-mean-token-sum-norm", num_tokens=3, num_sequences=1)
    with pytest.raises(StreamingConfigError, match="loss_agg_mode"):
        batch_scale("seq-mean", num_tokens=3, num_sequences=1)
    with pytest.raises(StreamingInputError, match="dp_size"):
        batch_scale("token-mean", num_tokens=3, num_sequences=1, dp_size=0)


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(LOSS_AGG_MODES),
    lengths=st.lists(st.integers(0, 7), min_size=1, max_size=6),
    dp_size=st.integers(1, 4),
    use_global=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_matches_verl_agg_loss(mode, lengths, dp_size, use_global, seed):
    """verl's agg_loss on a bool mask (as verl's ppo_loss passes it) == deferred form."""
    from verl.trainer.ppo.core_algos import agg_loss

    if sum(lengths) == 0:
        lengths = lengths + [1]
    width = max(lengths) + 2  # padding that must not matter
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    x = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    tokens, seqs = int(mask.sum()), sum(1 for n in lengths if n > 0)
    if dp_size > 1 or use_global:  # global counts (here: pretend the other ranks add 10 of each)
        tokens, seqs = tokens + 10 * (dp_size - 1), seqs + 10 * (dp_size - 1)
        info = dict(dp_size=dp_size, batch_num_tokens=tokens, global_batch_size=seqs)
    else:
        info = dict(dp_size=1)
    lsf = 9 if mode == "seq-mean-token-sum-norm" else None
    expected = agg_loss(x, mask, mode, loss_scale_factor=lsf, **info)
    scale = batch_scale(mode, num_tokens=tokens, num_sequences=seqs, dp_size=dp_size, loss_scale_factor=lsf)
    got = scale * (token_weights(mode, mask) * x).sum()
    assert float(got) == pytest.approx(float(expected), rel=1e-14, abs=1e-15)
