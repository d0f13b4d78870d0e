"""KL loss and entropy bonus through the streaming worker on verl's Megatron engine, PP=2 (no GPU).

The checks of ``test_megatron_kl_entropy_on_cpu`` (TP=2) on a two-stage pipeline: the loss, the
engine's entropy and the reference log-probs exist on the last stage only, and the tied embedding's
gradient is reduced across the stages once, at the barrier. One launch for the module (with the TP=2
module: 3 passed in 64 s on 2 cores).
"""

from __future__ import annotations

import pytest

import test_megatron_kl_entropy_on_cpu as tp2_checks

pytestmark = pytest.mark.slow  # two Ray worker groups of verl's Megatron engine over gloo (~40 s on 2 cores)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    yield from tp2_checks.kl_engine(tmp_path_factory, pp=2)


def test_pp2_streamed_step_with_kl_and_entropy_equals_verls_update_actor(engine):
    tp2_checks.test_megatron_streamed_step_with_kl_and_entropy_equals_verls_update_actor(engine)
