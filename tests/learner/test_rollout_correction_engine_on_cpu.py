"""Rollout correction (``algorithm.rollout_correction.rollout_is``) through the real streaming worker on verl's FSDP2
engine (CPU, no GPU).

verl's side is verl's own trainer function (``compute_rollout_correction_and_add_to_batch``) and ``update_actor``;
the stream computes each token's IS weight in the learner's loss from the chunk's rollout log-probs
(``learner/stream_loss.py`` point 8). The rollout log-probs are the start policy's plus seeded noise
(``thundersync_harness.rollout_correction`` point 2), so the weights are far from 1, some clamped or masked: an update
that dropped them, or weighed the KL/normaliser with them, would be off by far more than fp32 summation order.
"""

from __future__ import annotations

import pytest

from thundersync_harness import engine_setup as setup
from thundersync_harness.engine_steps import relative_gap, stream_step, sync_step, train
from thundersync_harness.rollout_correction import VARIANTS, RolloutCorrectionSpec
from thundersync_verl.step.chunk_layout import build_stream_chunk

pytestmark = pytest.mark.slow  # Ray and verl's FSDP2 engine (~1 min on 2 cores)
GROUPS = 2


@pytest.fixture(scope="module")
def engine(start_engine):
    return start_engine(groups=GROUPS)


@pytest.mark.parametrize("variant", ["tis", "sequence-mask"])
def test_streamed_step_with_rollout_is_weights_equals_verls(engine, variant):
    wg, pad = engine.wg, engine.pad_id
    trajs, arrival = setup.make_trajectories(11, GROUPS, engine.vocab)
    rows = list(range(len(trajs)))
    level, threshold = VARIANTS[variant]
    spec = RolloutCorrectionSpec(level=level, threshold=threshold)
    plain = RolloutCorrectionSpec(level=level, threshold=1e6, rollout_lp=spec.rollout_lp)  # weights never clamped
    d_sync, _ = train(wg, [lambda: sync_step(wg, trajs, rows, pad, spec)])
    d_stream, info = train(wg, [lambda: stream_step(wg, trajs, arrival, pad, spec)])
    d_unclamped, _ = train(wg, [lambda: sync_step(wg, trajs, rows, pad, plain)])
    assert float(d_sync[0].norm()) > 1e-4 and info[0]["ops/bucket"] > 0 and info[0]["ops/fold"] > 0
    assert relative_gap(d_stream[0], d_sync[0]) < 2e-5  # fp32 summation order only
    assert relative_gap(d_unclamped[0], d_sync[0]) > 1e-3  # the clamp / band moves this update
    stats = spec.stats
    assert stats["tokens"] > 0 and stats["between"] > 0  # weights away from 1, and ...
    assert stats["at_upper"] + stats["zero"] > 0  # ... some clamped (TIS) or masked (band)


def test_a_chunk_without_rollout_log_probs_is_refused_before_its_backward(engine):
    wg, pad = engine.wg, engine.pad_id
    trajs, _ = setup.make_trajectories(12, GROUPS, engine.vocab)
    wg.stream_begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": GROUPS, "rollout_is": "token",
                           "rollout_is_threshold": 2.0})
    before = wg.gather_flat_params()[0]
    chunk = build_stream_chunk([trajs[0].prompt], [trajs[0].response], [1.0], "direct", dp_size=1, pad_token_id=pad)
    with pytest.raises(Exception, match="rollout_is='token' is on but the chunk has no ts_rollout_log_prob") as info:
        wg.stream_backward(chunk)
    assert "calculate_log_probs" in str(info.value)
    assert (wg.gather_flat_params()[0] == before).all()  # nothing applied
