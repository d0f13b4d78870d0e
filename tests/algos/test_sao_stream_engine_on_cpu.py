"""Streamed SAO actor update on verl's real FSDP2 engine (a 1-process Ray worker group on the CPU).

Needs no GPU. The worker's config sets ``policy_loss.loss_mode=sao`` and the band, so verl's own
``update_actor`` (fed verl's registered ``sao`` advantages, rollout log-probs as old_log_probs) is the
oracle. Single-rollout multi-turn trajectories arriving in a random order, streamed in chunks (direct +
whitening bucket, folded at the barrier), must give verl's step; skipping the fold must not.
Starts Ray once (~20-40 s on 2 cores).
"""

from __future__ import annotations

import pytest

from thundersync_harness import engine_setup as setup
from thundersync_harness.engine_steps import relative_gap, stream_step, sync_step, train
from thundersync_harness.sao_steps import make_sao_batch, regrouped, sao_config, sao_step_pair

pytestmark = pytest.mark.slow  # Ray and verl's FSDP2 engine, started once per module, then real steps
GROUPS, MICRO = 2, 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with setup.ray_session():
        model, pad_id, vocab = setup.build_tiny_model(tmp_path_factory.mktemp("sao_engine") / "model")
        wg = setup.start_workers(sao_config(model, groups=GROUPS, micro=MICRO), dp=1)
        yield {"wg": wg, "pad": pad_id, "batch": make_sao_batch(11, GROUPS, vocab)}


def test_streamed_sao_actor_step_equals_verls_update_actor(engine):
    wg, pad, batch = engine["wg"], engine["pad"], engine["batch"]
    n = len(batch["trajs"])
    trajs, arrival, spec = sao_step_pair(batch, GROUPS)
    assert batch["arrival"] != list(range(n))
    [d_stream], [info] = train(wg, [lambda: stream_step(wg, trajs, arrival, pad, spec)])
    [d_verl], [info_verl] = train(wg, [lambda: sync_step(wg, trajs, list(range(n)), pad, spec)])
    [d_floor], _ = train(wg, [lambda: sync_step(wg, trajs, regrouped(n, MICRO), pad, spec)])
    assert float(d_verl.norm()) > 1e-4  # verl's sao loss moved the weights
    assert info["ops/chunks"] >= 4  # several direct and bucket chunks before the barrier
    floor = relative_gap(d_floor, d_verl)
    gap = relative_gap(d_stream, d_verl)
    assert gap < 1e-5, (gap, floor)  # fp32: equal up to summation order
    assert info["grad_norm"] == pytest.approx(info_verl["grad_norm"], rel=1e-5)


def test_queued_through_the_trainers_op_pipeline_the_step_is_the_same(engine):
    wg, pad, batch = engine["wg"], engine["pad"], engine["batch"]
    n = len(batch["trajs"])
    trajs, arrival, spec = sao_step_pair(batch, GROUPS)
    [d_queued], _ = train(wg, [lambda: stream_step(wg, trajs, arrival, pad, spec, pipeline=2)])
    [d_verl], _ = train(wg, [lambda: sync_step(wg, trajs, list(range(n)), pad, spec)])
    assert relative_gap(d_queued, d_verl) < 1e-5


def test_without_the_whitening_fold_the_step_differs(engine):
    """The control: dropping the bucket's -mean fold (a plain GAE step scaled by inv_std) is not verl's step."""
    from thundersync_verl.algos.sao import sao_streaming as sao_stream

    wg, pad, batch = engine["wg"], engine["pad"], engine["batch"]
    n = len(batch["trajs"])
    trajs, arrival, spec = sao_step_pair(batch, GROUPS)
    original = sao_stream.SAOStreamPlanner.finalize

    def no_fold(self):
        folds, final = original(self)
        return {k: 0.0 for k in folds}, final

    sao_stream.SAOStreamPlanner.finalize = no_fold
    try:
        [d_wrong], _ = train(wg, [lambda: stream_step(wg, trajs, arrival, pad, spec)])
    finally:
        sao_stream.SAOStreamPlanner.finalize = original
    [d_verl], _ = train(wg, [lambda: sync_step(wg, trajs, list(range(n)), pad, spec)])
    assert relative_gap(d_wrong, d_verl) > 1e-3
