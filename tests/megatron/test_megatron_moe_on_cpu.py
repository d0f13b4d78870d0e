"""A Qwen3-MoE on verl's Megatron engine (4 experts, top-2, expert parallel 1) and the streamed step on it.

Needs no GPU: one Ray worker on the CPU platform, the local experts of ``backends/megatron/cpu_patches.py``.
The model is ``thundersync_harness.moe``'s (router aux loss off, as verl builds MoE models). One launch for the
module (~30-60 s on 2 cores).
"""

from __future__ import annotations

import pytest

from megatron_checks import forward_matches_hf, streamed_vs_verl

pytestmark = pytest.mark.slow  # one Ray launch of verl's Megatron engine

GROUPS = 2


@pytest.fixture(scope="module")
def group(start_megatron):
    return start_megatron(groups=GROUPS, moe=True)


def test_moe_engine_forward_matches_the_hf_model(group):
    # verl's compute_log_prob through mbridge's qwen3_moe bridge (router, 4 local experts named as grouped ones,
    # query/key norms, untied output layer) gives the HF Qwen3-MoE's log-probs
    forward_matches_hf(group)


def test_moe_streamed_step_equals_verls_update(group):
    from thundersync_verl import verl_adapter as va

    assert va.actor_dp_size(group.wg) == 1
    out = streamed_vs_verl(group, GROUPS)
    assert float(out["sync"].norm()) > 1e-4  # verl's step moved the weights
    assert out["gap"] < 1e-5, out["gap"]  # fp32 summation order (floor ~5e-7 on the dense layouts)
    assert out["info"]["grad_norm"] == pytest.approx(out["info_sync"]["grad_norm"], rel=1e-5)
    info = out["info"]
    assert info["ops/bucket"] > 0 and info["ops/fold"] > 0 and info["ops/direct"] > 0  # every route ran
    # one rank, untied output layer: verl's per-call finalize has nothing to reduce here, so its control is the
    # expert-parallel module's (test_megatron_moe_ep2_on_cpu.py), where it all-reduces over two ranks
