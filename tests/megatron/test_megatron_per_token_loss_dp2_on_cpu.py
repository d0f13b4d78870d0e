"""Streaming in Megatron's per-token-loss regime with DP=2 and the distributed optimizer (two gloo processes).

In the regime the DDP SUMS gradients over data-parallel ranks (scaling factor 1, no averaging) and verl's loss
carries routed_num_tokens / dp; the streamed step applies 1 / dp once at the barrier and keeps its buckets as
reduce-scattered regions. CP > 1 does not run on the CPU: see ``test_megatron_per_token_loss_on_cpu.py``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # one Ray launch of verl's Megatron engine over gloo

GROUPS = 2


@pytest.fixture(scope="module")
def group(start_megatron):
    return start_megatron(dp=2, distributed_optimizer=True, groups=GROUPS, per_token_loss=True)


def test_per_token_regime_dp2_distributed_optimizer_streamed_step_equals_verls_update(group):
    from megatron_checks import streamed_vs_verl
    from thundersync_verl import verl_adapter as va

    assert va.actor_dp_size(group.wg) == 2  # rows are split over the two data-parallel ranks
    out = streamed_vs_verl(group, GROUPS, control="probe_raw_per_token", key="raw")
    assert float(out["sync"].norm()) > 1e-4
    assert out["gap"] < 1e-5, out["gap"]  # fp32 summation order, the floor of the other Megatron tests
    assert out["info"]["grad_norm"] == pytest.approx(out["info_sync"]["grad_norm"], rel=1e-5)
    assert out["info"]["ops/bucket"] > 0 and out["info"]["ops/fold"] > 0
    assert out["gap_raw"] > 1e-3 > 100 * out["gap"], out["gap_raw"]  # the per-call factors left in: far off
