"""The Qwen3-MoE with its experts split over 2 expert-parallel ranks (gloo all-to-all token dispatch).

Needs no GPU: two Ray workers on the CPU platform; the dense layers are data-parallel over both, each rank
holds 2 of the 4 experts and Megatron's all-to-all dispatcher sends every token to its experts' rank
(``backends/megatron/cpu_patches.py``: the dispatcher's CPU stream and split sizes). One launch for the module
(~40-70 s on 2 cores). Micro-batches of 2 rows: each rank gets half of every 4-row batch.
"""

from __future__ import annotations

import pytest

from megatron_checks import forward_matches_hf, streamed_vs_verl

pytestmark = pytest.mark.slow  # one Ray launch of verl's Megatron engine over gloo

GROUPS = 2


@pytest.fixture(scope="module")
def group(start_megatron):
    return start_megatron(groups=GROUPS, micro=2, dp=2, moe=True, ep=2)


def test_ep2_forward_matches_the_hf_model(group):
    # each rank loads its own two experts (global ids 2r, 2r + 1); a wrong expert map or a token dispatched to the
    # wrong rank changes the log-probs
    forward_matches_hf(group)


def test_ep2_streamed_step_equals_verls_update_and_finalize_per_call_does_not(group):
    from thundersync_verl import verl_adapter as va

    assert va.actor_dp_size(group.wg) == 2  # rows are split over the two ranks, experts too
    out = streamed_vs_verl(group, GROUPS)
    assert float(out["sync"].norm()) > 1e-4
    assert out["gap"] < 1e-5, out["gap"]  # fp32 summation order
    assert out["info"]["ops/bucket"] > 0 and out["info"]["ops/fold"] > 0
    assert out["gap_every_call"] > 1e-3 > 100 * out["gap"], out["gap_every_call"]
