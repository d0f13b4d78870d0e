"""KL loss and entropy bonus through the real streaming worker on verl's FSDP2 engine (CPU, no GPU).

Two 1-process Ray worker groups: the streaming learner (role actor) and verl's reference worker
(role ref, the start policy plus seeded noise), as verl's trainer lays them out for a learner on its
own pool. A streamed step with buckets and folds must equal verl's own ``update_actor`` with the
same ``use_kl_loss`` / ``entropy_coeff``: a KL or entropy gradient multiplied by a bucket's A(r)
at the fold would move the update far beyond fp32 summation noise.
"""

from __future__ import annotations


import pytest

from thundersync_harness import engine_setup as setup
from thundersync_harness import kl_entropy_steps as kle
from thundersync_harness import minibatch_steps as mb
from thundersync_harness.engine_steps import relative_gap, stream_step, sync_step, train

pytestmark = pytest.mark.slow  # Ray, verl's FSDP2 engine and a reference worker group (~1 min on 2 cores)
GROUPS = 2
LR = 0.05  # engine_setup.verl_config's SGD learning rate


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    work = tmp_path_factory.mktemp("kl_engine")
    with setup.ray_session():
        model_path, pad_id, vocab = setup.build_tiny_model(work / "model")
        ref_path = kle.build_reference(model_path, work / "ref")
        config = kle.kl_entropy_config(model_path, groups=GROUPS, micro=4, kl_type="low_var_kl", entropy=True)
        wg, ref_wg = kle.start_kl_workers(config, 1, ref_path)
        yield {"wg": wg, "ref": ref_wg, "pad": pad_id, "vocab": vocab}


def test_streamed_step_with_kl_and_entropy_equals_verls_update_actor(engine):
    wg, ref, pad = engine["wg"], engine["ref"], engine["pad"]
    trajs, arrival = setup.make_trajectories(5, GROUPS, engine["vocab"])
    rows = list(range(len(trajs)))
    # two steps: at the second the policy has moved, so every KL type's gradient is away from its start value
    spec = kle.kl_spec(ref, entropy=True)
    d_sync, info_sync = train(wg, [lambda: sync_step(wg, trajs, rows, pad, spec)] * 2)
    d_stream, info = train(wg, [lambda: stream_step(wg, trajs, arrival, pad, spec)] * 2)
    for a, b in zip(d_stream, d_sync):
        assert float(b.norm()) > 1e-4
        assert relative_gap(a, b) < 2e-5  # fp32 summation order only
    assert info[0]["ops/bucket"] > 0 and info[0]["ops/fold"] > 0  # bucket rows ran: their KL/entropy went direct
    assert info[0]["ref_calls"] == info[0]["ops/bucket"] + info[0]["ops/direct"]  # every chunk scored on arrival
    assert info[1]["grad_norm"] == pytest.approx(info_sync[1]["grad_norm"], rel=1e-4)
    # the applied gradient (engines/fsdp.py point 5): SGD's update before fp32 storage rounds it, each path's own
    for d, step in zip(d_stream + d_sync, info + info_sync):
        applied = step["applied"]
        assert float(applied.norm()) > 1e-3
        assert float((d + LR * applied).abs().max()) <= 2.4e-7  # half an ulp of a stored weight below 4
    for step, step_sync in zip(info, info_sync):
        assert relative_gap(step["applied"], step_sync["applied"]) < 2e-5


def test_a_kl_chunk_without_reference_log_probs_is_refused_before_its_backward(engine):
    assert kle.refuses_kl_chunk_without_reference(engine["wg"], engine["pad"], GROUPS)


def test_mini_batches_with_kl_and_entropy_equal_verls_sync_loop(engine):
    """Two optimizer steps per batch (one group each): mini-batch 2 runs as PPO chunks at the weights after
    step 1, and verl's KL and entropy terms ride in every chunk, as in verl's ``update_actor``."""
    wg, ref, pad = engine["wg"], engine["ref"], engine["pad"]
    trajs, arrival = setup.make_trajectories(7, GROUPS, engine["vocab"])
    parts = mb.partition_rows(trajs, arrival, 1)
    order = [i for p in parts for i in p]
    spec = mb.MiniBatchSpec(mb_groups=1, epochs=1, ref_wg=ref, entropy=True)
    no_entropy = mb.MiniBatchSpec(mb_groups=1, epochs=1, ref_wg=ref, entropy=False)
    d_sync, _ = train(wg, [lambda: sync_step(wg, trajs, order, pad, spec)])
    d_no_entropy, _ = train(wg, [lambda: sync_step(wg, trajs, order, pad, no_entropy)])
    d_stream, info = train(wg, [lambda: stream_step(wg, trajs, arrival, pad, spec)])
    assert info[0]["thundersync/optimizer_steps"] == GROUPS and info[0]["ops/ppo"] > 0
    assert info[0]["thundersync/minibatch_rerun_rows"] > 0  # bucketed rows whose group missed mini-batch 1
    assert info[0]["ref_calls"] == info[0]["ops/ppo"] + info[0]["ops/bucket"] + info[0]["ops/direct"]
    assert relative_gap(d_no_entropy[0], d_sync[0]) > 1e-4  # the entropy term moves this update (fp32 noise ~1e-6)
    assert relative_gap(d_stream[0], d_sync[0]) < 2e-5  # fp32 summation order only
