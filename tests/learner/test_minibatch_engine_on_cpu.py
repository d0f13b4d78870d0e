"""Several optimizer steps per batch on verl's real FSDP2 engine (a 1-process Ray worker group on the CPU).

Needs no GPU. The oracle is verl's OWN ``update_actor`` running K mini-batches for E epochs (its ppo_loss:
ratio and clip against the old log-probs, one optimizer step per mini-batch) on the partition the stream
used; the streamed step (mini-batch 1 at ratio 1, later ones as PPO chunks) must land on the same weights
up to fp32 rounding. Starts Ray once (~20-40 s on 2 cores).
"""

from __future__ import annotations

import pytest

from thundersync_harness.engine_setup import make_trajectories
from thundersync_harness.engine_steps import relative_gap, stream_step, sync_step, train
from thundersync_harness.minibatch_steps import MiniBatchSpec, partition_rows

pytestmark = pytest.mark.slow  # Ray and verl's FSDP2 engine, started once per module, then real steps
GROUPS = 4


@pytest.fixture(scope="module")
def engine(start_engine):
    return start_engine(groups=GROUPS)


@pytest.mark.parametrize("mb_groups, epochs", [(2, 1), (1, 2)])
def test_streamed_mini_batches_equal_verls_sync_loop_on_the_same_partition(engine, mb_groups, epochs):
    wg, pad = engine.wg, engine.pad_id
    trajs, arrival = make_trajectories(31, GROUPS, engine.vocab)
    parts = partition_rows(trajs, arrival, mb_groups)
    order = [i for p in parts for i in p]
    spec = MiniBatchSpec(mb_groups=mb_groups, epochs=epochs)
    [d_stream], [info] = train(wg, [lambda: stream_step(wg, trajs, arrival, pad, spec)])
    [d_verl], _ = train(wg, [lambda: sync_step(wg, trajs, order, pad, spec)])
    [d_one], _ = train(wg, [lambda: stream_step(wg, trajs, arrival, pad)])  # one step per batch
    steps = GROUPS // mb_groups * epochs
    assert info["thundersync/optimizer_steps"] == info["ops/steps"] + 1 == steps
    assert info["ops/ppo"] > 0 and info["thundersync/minibatch_policy_lag/max"] == steps - 1
    assert relative_gap(d_one, d_verl) > 1e-2  # several steps move the weights elsewhere than one step
    assert relative_gap(d_stream, d_verl) < 1e-5  # fp32: the same steps up to rounding
