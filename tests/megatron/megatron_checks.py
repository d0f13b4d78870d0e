"""The checks every Megatron layout runs (``test_megatron_*_on_cpu.py`` call them with their worker group)..

1. One streamed step (arrival order permuted, buckets for open groups, folds, ONE finalize) equals
   verl's own ``update_actor`` on the same batch, to fp32 summation order.
2. The same stream with verl's per-call ``finalize_model_grads`` left on is far off: the test of (1)
   can fail, and the learner's switch is what makes it pass. The per-token-loss tests use another control
   (the stream without the regime's compensation, ``probe_raw_per_token``).
3. verl's own ``compute_log_prob`` on the engine gives the HF model's log-probs (``forward_matches_hf``): the
   CPU layer spec, the weight split and, on the packed (THD) path, the block-diagonal attention compute the
   model itself.
"""

from __future__ import annotations

import torch

from thundersync_harness.engine_setup import make_trajectories
from thundersync_harness.engine_steps import relative_gap, stream_step, sync_step, train

SEED = 5


def streamed_vs_verl(group, groups: int, control: str = "probe_finalize_every_call", key: str = "every_call") -> dict:
    """dθ of verl's update, of the streamed step, and of the stream under a broken control (the worker's probe
    method ``control`` switched on: by default finalize on every call), reported as ``key`` and ``gap_<key>``."""
    wg, pad = group.wg, group.pad_id
    trajs, arrival = make_trajectories(SEED, groups, group.vocab)
    [d_sync], [info_sync] = train(wg, [lambda: sync_step(wg, trajs, list(range(len(trajs))), pad)])
    [d_stream], [info] = train(wg, [lambda: stream_step(wg, trajs, arrival, pad)])
    getattr(wg, control)(True)
    try:
        [d_control], _ = train(wg, [lambda: stream_step(wg, trajs, arrival, pad)])
    finally:
        getattr(wg, control)(False)
    return {"sync": d_sync, "stream": d_stream, key: d_control, "info": info, "info_sync": info_sync,
            "gap": relative_gap(d_stream, d_sync), f"gap_{key}": relative_gap(d_control, d_sync)}


def _hf_log_probs(model_path, prompts, responses) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            logits = model(torch.tensor([list(p) + list(r)])).logits[0, len(p) - 1 : -1]  # [R, V]
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0])  # [R]
    return out


def forward_matches_hf(group, atol: float = 2e-5) -> None:
    """Point 3: four rows of different lengths (one log-prob micro-batch), every response token within ``atol``."""
    from thundersync_verl import verl_adapter as va
    from thundersync_verl.step.chunk_layout import pad_batch

    prompts = [[11, 12, 13, 40], [20, 21], [50, 51, 52], [60]]
    responses = [[14, 15, 16, 17, 18], [30, 31, 32], [70, 71], [80, 81, 82, 83, 84, 85, 86]]
    data = va.data_proto_cls().from_dict(tensors=pad_batch(prompts, responses, group.pad_id), meta_info={"temperature": 1.0})
    td = va.to_no_padding(data.to_tensordict())
    va.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
    got = va.unpad_response(va.td_get(group.wg.compute_log_prob(td), "log_probs"), td).float()  # [B, R]
    for b, want in enumerate(_hf_log_probs(group.model_path, prompts, responses)):
        assert torch.allclose(got[b, : len(want)], want, atol=atol, rtol=0), (got[b], want)
