"""The streamed chunk: verl's padded/no-padding layout, DP padding rows, and the chunk loss. No GPU, no Ray."""

from __future__ import annotations

import pytest
import torch

from thundersync_verl.core import StreamingInputError
from thundersync_verl.step.chunk_layout import COEF_KEY, DEST_KEY, build_stream_chunk, pad_batch
from thundersync_verl.learner.stream_loss import make_stream_loss
from thundersync_verl import verl_adapter as va

PAD = 0
PROMPTS = [[5, 6, 7], [8, 9]]
RESPONSES = [[10, 11], [12, 13, 14, 15]]


def test_pad_batch_left_pads_prompts_and_right_pads_responses():
    t = pad_batch(PROMPTS, RESPONSES, PAD)
    assert t["prompts"].tolist() == [[5, 6, 7], [PAD, 8, 9]]
    assert t["responses"].tolist() == [[10, 11, PAD, PAD], [12, 13, 14, 15]]
    assert t["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]]
    assert t["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4, 4], [0, 0, 1, 2, 3, 4, 5]]


def test_chunk_is_padded_to_the_dp_size_with_rows_that_score_nothing():
    chunk = build_stream_chunk(PROMPTS[:1], RESPONSES[:1], [0.5], "g=0|r=1.0", dp_size=2, pad_token_id=PAD)
    assert chunk.batch_size[0] == 2
    assert chunk[COEF_KEY].tolist() == [0.5, 0.0]
    assert chunk["loss_mask"].sum(dim=-1).tolist() == [2, 0]  # verl counts tokens from loss_mask
    assert va.non_tensor(chunk, DEST_KEY) == "g=0|r=1.0" and va.non_tensor(chunk, "temperature") == 1.0
    assert chunk["input_ids"].offsets().diff().tolist() == [5, 5]  # no-padding layout, real tokens


@pytest.mark.parametrize(
    "prompts, responses, coefs, dest, match",
    [
        (PROMPTS, RESPONSES, [1.0], "direct", "as many prompts"),
        ([[1], []], [[2], [3]], [1.0, 1.0], "direct", "non-empty prompt"),
        (PROMPTS, RESPONSES, [1.0, float("nan")], "direct", "finite"),
        (PROMPTS, RESPONSES, [1.0, 1.0], "", "non-empty string"),
    ],
)
def test_bad_chunks_are_refused_before_any_backward(prompts, responses, coefs, dest, match):
    with pytest.raises(StreamingInputError, match=match):
        build_stream_chunk(prompts, responses, coefs, dest, dp_size=1, pad_token_id=PAD)


def _fake_model_output(chunk):
    """Per-token log-probs over each full sequence, in verl's no-padding (nested) layout."""
    offsets = chunk["input_ids"].offsets()
    values = torch.randn(int(offsets[-1]), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    values.requires_grad_(True)
    return {"log_probs": torch.nested.nested_tensor_from_jagged(values, offsets=offsets)}, values, offsets


def _response_logp(values, offsets, prompts, responses):
    """log pi of response token j of row b: the model output at the position before it."""
    rows = []
    for b, (p, r) in enumerate(zip(prompts, responses)):
        start = int(offsets[b]) + len(p) - 1
        rows.append(values[start : start + len(r)])
    return rows


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("dp_size", [1, 2])
def test_loss_is_minus_dp_size_times_coef_weighted_log_likelihood(mode, dp_size):
    coefs = [0.75, -1.5]
    chunk = build_stream_chunk(PROMPTS, RESPONSES, coefs, "direct", dp_size=1, pad_token_id=PAD)
    va.assign_non_tensor(chunk, dp_size=dp_size)
    output, values, offsets = _fake_model_output(chunk)
    loss, metrics = make_stream_loss(mode)(model_output=output, data=chunk)
    expected = torch.zeros((), dtype=torch.float64)
    for c, logp in zip(coefs, _response_logp(values, offsets, PROMPTS, RESPONSES)):
        w = 1.0 / len(logp) if mode == "seq-mean-token-mean" else 1.0
        expected = expected - c * w * logp.sum()
    assert float(loss.detach()) == pytest.approx(dp_size * float(expected.detach()), rel=1e-12)
    assert metrics["stream/scored_tokens"] == 6


def test_response_masks_score_only_the_models_own_tokens():
    masks = [[1, 1], [1, 0, 0, 1]]  # row 2: two tool-observation tokens, attended but not scored
    chunk = build_stream_chunk(PROMPTS, RESPONSES, [1.0, 1.0], "direct", dp_size=1, pad_token_id=PAD,
                               response_masks=masks)
    assert chunk["loss_mask"].sum(dim=-1).tolist() == [2, 2]
    assert chunk["input_ids"].offsets().diff().tolist() == [5, 6]  # every token is still in the sequence
    output, values, offsets = _fake_model_output(chunk)
    loss, _ = make_stream_loss("seq-mean-token-mean")(model_output=output, data=chunk)
    rows = _response_logp(values, offsets, PROMPTS, RESPONSES)
    expected = -(rows[0].sum() / 2 + (rows[1][0] + rows[1][3]) / 2)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-12)
    with pytest.raises(StreamingInputError, match="one 0/1 entry per response token"):
        build_stream_chunk(PROMPTS, RESPONSES, [1.0, 1.0], "direct", dp_size=1, pad_token_id=PAD, response_masks=[[1], [1]])


def test_padding_rows_contribute_exactly_zero_gradient():
    chunk = build_stream_chunk(PROMPTS[:1], RESPONSES[:1], [2.0], "direct", dp_size=3, pad_token_id=PAD)
    output, values, offsets = _fake_model_output(chunk)
    loss, _ = make_stream_loss("token-mean")(model_output=output, data=chunk)
    loss.backward()
    first_row = int(offsets[1])
    assert values.grad[first_row:].abs().max() == 0  # rows 2 and 3 are padding
    assert values.grad[:first_row].abs().sum() > 0


def test_unknown_loss_agg_mode_is_refused():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        make_stream_loss("token-median")


def test_rollout_log_probs_give_the_max_gap_over_scored_tokens_only():
    masks = [[1, 1], [1, 0, 0, 1]]
    chunk = build_stream_chunk(PROMPTS, RESPONSES, [1.0, 1.0], "direct", dp_size=1, pad_token_id=PAD, response_masks=masks)
    output, values, offsets = _fake_model_output(chunk)
    learner = [row.detach().float() for row in _response_logp(values, offsets, PROMPTS, RESPONSES)]
    rollout = [(learner[0] + torch.tensor([0.01, -0.02])).tolist(),
               (learner[1] + torch.tensor([0.03, 5.0, 5.0, -0.04])).tolist()]  # 5.0: unscored tool tokens
    chunk = build_stream_chunk(PROMPTS, RESPONSES, [1.0, 1.0], "direct", dp_size=2, pad_token_id=PAD, response_masks=masks,
                               rollout_log_probs=rollout)
    output, values, offsets = _fake_model_output(chunk)
    loss, metrics = make_stream_loss("token-mean")(model_output=output, data=chunk)
    assert metrics["stream/rollout_logprob_diff_max"] == pytest.approx(0.04, abs=1e-5)
    plain = build_stream_chunk(PROMPTS, RESPONSES, [1.0, 1.0], "direct", dp_size=2, pad_token_id=PAD, response_masks=masks)
    assert float(make_stream_loss("token-mean")(model_output=output, data=plain)[0]) == float(loss)  # loss unchanged
    assert "stream/rollout_logprob_diff_max" not in make_stream_loss("token-mean")(model_output=output, data=plain)[1]
