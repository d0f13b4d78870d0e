"""verl's Megatron engine with TP=2 (sequence parallel) in two gloo processes, and the streamed step on it.

Needs no GPU: two Ray workers on the project's CPU platform, the CPU runtime of
``thundersync_verl/backends/megatron``. One launch for the module (~30-90 s on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from megatron_checks import streamed_vs_verl

pytestmark = pytest.mark.slow  # one Ray launch of verl's Megatron engine over gloo

GROUPS = 2


@pytest.fixture(scope="module")
def group(start_megatron):
    return start_megatron(tp=2, groups=GROUPS)


def _hf_log_probs(model_path, prompts, responses) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            logits = model(torch.tensor([list(p) + list(r)])).logits[0, len(p) - 1 : -1]  # [R, V]
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0])  # [R]
    return out


def test_tp2_engine_forward_matches_the_hf_model(group):
    # verl's own compute_log_prob on the Megatron engine (mbridge weights split over 2 TP ranks,
    # local layer spec, padded causal mask) gives the HF model's log-probs
    from thundersync_verl import verl_adapter as va
    from thundersync_verl.step.chunk_layout import pad_batch

    prompts = [[11, 12, 13, 40], [20, 21], [50, 51, 52], [60]]  # 4 rows: one log-prob micro-batch
    responses = [[14, 15, 16, 17, 18], [30, 31, 32], [70, 71], [80, 81, 82, 83, 84, 85, 86]]
    data = va.data_proto_cls().from_dict(tensors=pad_batch(prompts, responses, group.pad_id), meta_info={"temperature": 1.0})
    td = va.to_no_padding(data.to_tensordict())
    va.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
    got = va.unpad_response(va.td_get(group.wg.compute_log_prob(td), "log_probs"), td).float()  # [B, R]
    for b, want in enumerate(_hf_log_probs(group.model_path, prompts, responses)):
        assert torch.allclose(got[b, : len(want)], want, atol=2e-5, rtol=0), (got[b], want)


def test_tp2_streamed_step_equals_verls_update_and_finalize_per_call_does_not(group):
    from thundersync_verl import verl_adapter as va

    assert va.actor_dp_size(group.wg) == 1  # both TP ranks receive every row: chunks are not padded
    out = streamed_vs_verl(group, GROUPS)
    assert float(out["sync"].norm()) > 1e-4  # verl's step moved the weights
    assert out["gap"] < 1e-5  # fp32 summation order (floor ~5e-7 on this layout)
    assert out["info"]["grad_norm"] == pytest.approx(out["info_sync"]["grad_norm"], rel=1e-5)
    info = out["info"]
    assert info["ops/bucket"] > 0 and info["ops/fold"] > 0 and info["ops/direct"] > 0  # every route ran
    assert info["stream/bytes_in_use"] == 0 and info["stream/peak_bytes"] >= info["stream/buffer_bytes"] > 0
    # sequence-parallel norm gradients all-reduced over TP at every call: far from verl's update
    assert out["gap_every_call"] > 1e-3 > 100 * out["gap"]
