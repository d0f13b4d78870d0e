"""Streaming in Megatron's per-token-loss regime with TP=2 (sequence parallel) x PP=2 (1F1B, tied embeddings).

Four gloo processes, one launch (~40-120 s on 2 cores). In the regime only the last pipeline stage counts tokens
(``finalize_model_grads`` broadcasts the count over PP); the streamed barrier finalises with no count at all, so
the sequence-parallel norms and the tied embedding are reduced once, as outside the regime. CP > 1 does not run on
the CPU: see ``test_megatron_per_token_loss_on_cpu.py``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # one Ray launch of verl's Megatron engine over gloo

GROUPS = 2


@pytest.fixture(scope="module")
def group(start_megatron):
    return start_megatron(tp=2, pp=2, groups=GROUPS, per_token_loss=True)


def test_per_token_regime_tp2_pp2_streamed_step_equals_verls_update(group):
    from megatron_checks import streamed_vs_verl

    out = streamed_vs_verl(group, GROUPS, control="probe_raw_per_token", key="raw")
    assert float(out["sync"].norm()) > 1e-4
    assert out["gap"] < 1e-5, out["gap"]  # fp32 summation order, the floor of the other Megatron tests
    assert out["info"]["grad_norm"] == pytest.approx(out["info_sync"]["grad_norm"], rel=1e-5)
    assert out["info"]["ops/bucket"] > 0 and out["info"]["ops/fold"] > 0
    assert out["gap_raw"] > 1e-3 > 100 * out["gap"], out["gap_raw"]
