"""Checkpoint engine ``sparse_sync``: lossless sparse pushes, checked bit for bit.

1. Codec and state (no Ray): exact round trips in bf16 and fp32 through -0.0/+0.0, NaN payloads and
   denormals; the receiver overwrites (never adds); full pushes first, after a restart on either
   side and above the break-even density; a corrupted payload is refused before anything is
   written; chunking, bucket caps and sender shards change nothing in the result.
2. The engine over Ray's object store: a payload corrupted on the wire is refused, counted and
   repaired by a full resend within the same push.
3. verl's own checkpoint-engine manager moves the weights of a real FSDP2 learner to a real
   ``hf_cpu`` rollout replica (slow: Ray workers), bit-identical after every push.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from thundersync_verl.backends.sparse_sync import codec
from thundersync_verl.backends.sparse_sync.sparse_engine import BACKEND_NAME, SparseSyncCore
from thundersync_verl.backends.sparse_sync.state import Mirror, PushRefused, ShardEncoder, shard_bounds


def _bits(t: torch.Tensor) -> torch.Tensor:
    return codec.bits(t.contiguous()).reshape(-1)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _push(enc: ShardEncoder, mirrors, weights: dict, **kw):
    payload, stats = enc.encode(list(weights.items()), **kw)
    for m in mirrors:
        m.apply(payload)
    enc.commit(payload)
    return payload, stats


def _assert_mirror_equals(mirror: Mirror, weights: dict, dtype=None) -> None:
    for name, t in weights.items():
        want = t.to(dtype) if dtype is not None else t
        assert _same_bits(mirror.tensor(name), want), name


def _set_bits(t: torch.Tensor, index: int, pattern: int) -> None:
    _bits(t)[index] = pattern if pattern < (1 << (8 * t.element_size() - 1)) else pattern - (1 << (8 * t.element_size()))


SPECIALS = {  # dtype: (+0.0, -0.0, NaN payload A, NaN payload B, smallest denormal, another denormal)
    torch.bfloat16: (0x0000, 0x8000, 0x7FC1, 0x7F81, 0x0001, 0x0040),
    torch.float32: (0x00000000, 0x80000000, 0x7FC00001, 0x7F800123, 0x00000001, 0x00400000),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_is_bit_exact_through_signed_zeros_nan_payloads_and_denormals(dtype):
    torch.manual_seed(0)
    w = {"emb": torch.randn(64, 33).to(dtype), "norm": torch.ones(33, dtype=dtype), "odd": torch.randn(7).to(dtype)}
    zero, neg_zero, nan_a, nan_b, den_1, den_2 = SPECIALS[dtype]
    for i, p in enumerate((zero, nan_a, den_1)):
        _set_bits(w["emb"], i, p)
    enc, mirror = ShardEncoder(chunk_elems=64), Mirror()
    first, _ = _push(enc, [mirror], w)
    assert first.full and first.reason == "first"
    _assert_mirror_equals(mirror, w)
    for i, p in enumerate((neg_zero, nan_b, den_2)):  # each a change of bits only: equal as floats or both NaN
        _set_bits(w["emb"], i, p)
    w["odd"][3] = -w["odd"][3]
    payload, stats = _push(enc, [mirror], w)
    assert not payload.full and stats.changed == 4
    _assert_mirror_equals(mirror, w)
    entry = next(e for e in payload.entries if e.name == "emb")
    bucket = payload.buckets[entry.bucket]
    assert bucket.indices[entry.idx_off : entry.idx_off + entry.count].tolist() == [0, 1, 2]


def test_bf16_snapshot_of_fp32_learner_matches_the_dense_cast():
    torch.manual_seed(1)
    w = {"w": torch.randn(300, 41) * 0.02}
    enc, mirror = ShardEncoder(dtype=torch.bfloat16, chunk_elems=1024), Mirror()
    _push(enc, [mirror], w)
    for _ in range(3):
        w["w"].add_(torch.randn_like(w["w"]) * 1e-6)  # most steps stay inside one bf16 rounding step
        payload, stats = _push(enc, [mirror], w)
        _assert_mirror_equals(mirror, w, torch.bfloat16)
        assert not payload.full and 0 < stats.density < 0.1
        assert payload.nbytes == codec.sparse_bytes(stats.changed, 2)


def test_receiver_overwrites_with_the_pushed_value_and_never_adds():
    w = {"w": torch.zeros(256)}
    enc, mirror = ShardEncoder(), Mirror()
    _push(enc, [mirror], w)
    w["w"][10] = 5.0
    payload, _ = enc.encode(list(w.items()))
    mirror.flat["w"][10] = 123.0  # the receiver's element differs: adding a difference would keep it visible
    mirror.apply(payload)
    assert mirror.tensor("w")[10].item() == 5.0
    assert payload.buckets[0].values.view(torch.float32).tolist() == [5.0]  # the wire carries values


def test_full_push_on_sender_restart_receiver_restart_and_above_break_even():
    torch.manual_seed(2)
    w = {"a": torch.randn(512), "b": torch.randn(128)}
    enc, mirror = ShardEncoder(), Mirror()
    _push(enc, [mirror], w)
    w["a"][:3] += 1.0
    fresh_receiver = Mirror()  # a restarted rollout: empty copy, no chain token
    payload, _ = enc.encode(list(w.items()))
    with pytest.raises(PushRefused) as refused:
        fresh_receiver.apply(payload)
    assert refused.value.reason == "chain" and not fresh_receiver.flat  # nothing written
    mirror.apply(payload)
    enc.commit(payload)
    restarted_sender = ShardEncoder()  # a restarted learner: no snapshot
    again, _ = _push(restarted_sender, [mirror, fresh_receiver], w)
    assert again.full and again.reason == "first"
    _assert_mirror_equals(fresh_receiver, w)
    w["a"].add_(1.0)  # every element of "a" changes: 80% density, above fp32's break-even (1/2)
    dense, stats = _push(restarted_sender, [mirror, fresh_receiver], w)
    assert dense.full and stats.reason == "break_even" and stats.density == pytest.approx(512 / 640)
    assert dense.nbytes == (512 + 128) * 4
    _assert_mirror_equals(mirror, w)
    forced, stats = _push(restarted_sender, [mirror], w, force_full=True)
    assert forced.full and stats.reason == "forced"


def test_topology_forces_a_full_push_when_a_receiver_lost_its_copy():
    sender, receiver = SparseSyncCore(), SparseSyncCore()
    sender.encoder = ShardEncoder()
    sender.encoder.token = "t1"
    receiver.mirror.tokens[0] = "t1"
    actor, rollout = SparseSyncCore.build_topology(1, 1, [sender.prepare(), receiver.prepare()])
    assert actor["force_full"] == [False] and rollout["n_senders"] == [1]
    restarted = SparseSyncCore()
    actor, _ = SparseSyncCore.build_topology(1, 2, [sender.prepare(), receiver.prepare(), restarted.prepare()])
    assert actor["force_full"] == [True]


def test_checksum_mismatch_is_refused_before_any_write():
    torch.manual_seed(3)
    w = {"w": torch.randn(1000).to(torch.bfloat16)}
    enc, mirror = ShardEncoder(), Mirror()
    _push(enc, [mirror], w)
    before = mirror.tensor("w").clone()
    w["w"][::50] += 1
    payload, _ = enc.encode(list(w.items()))
    payload.buckets[0].values[0] ^= 1  # one flipped bit on the wire
    with pytest.raises(PushRefused) as refused:
        mirror.apply(payload)
    assert refused.value.reason == "checksum"
    assert _same_bits(mirror.tensor("w"), before)
    repair = enc.full_payload("resend")
    mirror.apply(repair)
    _assert_mirror_equals(mirror, w)


def test_chunks_buckets_dtypes_and_shards_leave_the_result_unchanged():
    torch.manual_seed(4)
    w = {"a": torch.randn(5000), "b": torch.randn(300, 7).to(torch.bfloat16), "c": torch.randn(70).to(torch.bfloat16)}
    encs = [ShardEncoder(s, 3, chunk_elems=128, bucket_bytes=512) for s in range(3)]
    mirror = Mirror()
    for step in range(2):
        for enc in encs:
            payload, _ = _push(enc, [mirror], w)
            assert step or len(payload.buckets) > 2  # the full push of ~2 KB per shard needs several buckets
        w["a"][::37] += 1.0
        w["b"].view(-1)[::11] += 1.0
    for enc in encs:
        payload, _ = _push(enc, [mirror], w)
        assert all(e.length <= 128 for e in payload.entries)  # one chunk per entry at most
        for i, bucket in enumerate(payload.buckets):  # capped: over 512 bytes only when one piece is
            assert bucket.nbytes <= 512 or sum(e.bucket == i for e in payload.entries) == 1
        assert {b.dtype for b in payload.buckets} == {"float32", "bfloat16"}
    _assert_mirror_equals(mirror, w)
    cover = [shard_bounds(5000, s, 3) for s in range(3)]
    assert cover[0][0] == 0 and cover[-1][1] == 5000 and all(a[1] == b[0] for a, b in zip(cover, cover[1:]))
    assert all(lo % codec.ALIGN_ELEMS == 0 for lo, _ in cover)


def test_every_diff_kernel_finds_exactly_the_changed_elements_and_updates_the_snapshot():
    torch.manual_seed(5)
    for dtype, n in ((torch.bfloat16, 4099), (torch.float32, 1001), (torch.float64, 513), (torch.uint8, 77)):
        old = torch.randint(-100, 100, (n,)).to(dtype)
        new = old.clone()
        flip = torch.randperm(n)[: n // 10]
        _bits(new)[flip] ^= 1
        _bits(new)[flip[:3]] ^= 1 << (8 * new.element_size() - 1)  # sign bits too: -0.0 vs +0.0 style flips
        want = torch.sort(flip).values
        for kernel in ("numpy", "torch"):  # the CPU kernel and the one GPUs run
            for words in (False, True):  # element-wise, and eight bytes at a time (odd tails element-wise)
                # a whole-word aligned view (the word kernel runs), an odd size and an odd offset (it cannot)
                for lo, hi in ((64, 64 + (n - 64) // 8 * 8), (0, n), (3, n)):
                    snapshot = old.clone()
                    pos, values = codec.diff_update(_bits(new)[lo:hi], _bits(snapshot)[lo:hi], words=words,
                                                    kernel=kernel)
                    expected = want[(want >= lo) & (want < hi)] - lo
                    assert pos.dtype == codec.INDEX_DTYPE and torch.equal(pos.long(), expected), (dtype, kernel, words)
                    assert torch.equal(values, _bits(new)[lo:hi][expected])
                    assert torch.equal(_bits(snapshot)[lo:hi], _bits(new)[lo:hi])  # updated where it changed
                    assert torch.equal(_bits(snapshot)[:lo], _bits(old)[:lo])  # untouched outside the view
                    assert torch.equal(_bits(snapshot)[hi:], _bits(old)[hi:])


def test_a_diff_with_nothing_changed_is_empty():
    old = torch.randn(4096).to(torch.bfloat16)
    for kernel in ("numpy", "torch"):
        for words in (False, True):
            pos, values = codec.diff_update(_bits(old.clone()), _bits(old), words=words, kernel=kernel)
            assert pos.numel() == 0 and values.numel() == 0


def test_the_digest_is_the_same_on_every_kernel_and_catches_any_single_flipped_bit():
    torch.manual_seed(8)
    for n, dtype in ((3 * 1024 * 4 + 5, torch.int32), (100_003, torch.int16), (7, torch.uint8), (0, torch.int16)):
        t = torch.randint(-(1 << 14), 1 << 14, (n,)).to(dtype)
        digest = codec.block_digest(t, kernel="numpy")
        assert digest == codec.block_digest(t, kernel="torch")  # what a GPU computes: same numbers
        for byte in {0, n // 2, t.element_size() * n - 1} if n else ():
            for bit in (0, 7):
                flipped = t.clone()
                flipped.view(torch.uint8)[byte] ^= 1 << bit
                assert codec.block_digest(flipped, kernel="numpy") != digest, (n, dtype, byte, bit)
        if n > 2 * 1024 * 2:  # two blocks swapped (each keeps its sum): the block positions tell them apart
            words = t[: (t.element_size() * n) // 8 * 8 // t.element_size()].view(torch.int64)
            swapped = t.clone()
            sw = swapped[: words.numel() * 8 // t.element_size()].view(torch.int64)
            sw[:1024], sw[1024:2048] = words[1024:2048].clone(), words[:1024].clone()
            assert codec.block_digest(swapped) != digest


def test_the_word_wide_kernel_is_chosen_for_parameters_that_barely_change():
    torch.manual_seed(7)
    w = {"still": torch.randn(1 << 14), "moving": torch.randn(1 << 14)}
    enc, mirror = ShardEncoder(), Mirror()
    _push(enc, [mirror], w)
    for step in range(3):
        w["still"][step] += 1.0  # 1 of 16384 elements per push
        w["moving"][::4] += 1.0  # 25% per push
        _push(enc, [mirror], w)
        _assert_mirror_equals(mirror, w)
    assert enc.snaps["still"].density < codec.WORDS_BELOW_DENSITY < enc.snaps["moving"].density


def test_sparse_sync_is_registered_with_verl():
    from thundersync_verl import verl_adapter as va
    from verl.checkpoint_engine import CheckpointEngineRegistry

    cls = CheckpointEngineRegistry.get(BACKEND_NAME)
    assert issubclass(cls, va.checkpoint_engine_base()) and issubclass(cls, SparseSyncCore)
    engine = CheckpointEngineRegistry.new(BACKEND_NAME, bucket_size=1 << 20, is_master=True, dtype="bfloat16")
    assert engine.dtype is torch.bfloat16 and engine.bucket_bytes == 1 << 20


# ----- over Ray: the channel wire and verl's manager ------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    """A private Ray cluster with two logical device slots (learner, rollout) on the CPU platform."""
    import ray

    from thundersync_harness import engine_setup as setup

    with setup.ray_session() as ray_tmp:
        env = {k: os.environ[k] for k in ("VERL_PLATFORM", "RAY_AUTH_MODE", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
        ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env},
                 _temp_dir=str(ray_tmp))
        yield ray_tmp


def _connect(cores: list[SparseSyncCore], n_senders: int = 1) -> None:
    actor, rollout = SparseSyncCore.build_topology(n_senders, len(cores) - n_senders, [c.prepare() for c in cores])
    for i, core in enumerate(cores):
        side, j = (actor, i) if i < n_senders else (rollout, i - n_senders)
        core.init_process_group(**{k: v[j] for k, v in side.items()})


@pytest.mark.slow  # starts a Ray cluster
def test_payload_corrupted_on_the_wire_is_refused_counted_and_resent_full(ray_cluster):
    import ray

    from thundersync_verl.backends.sparse_sync import wire

    torch.manual_seed(6)
    w = {"a": torch.randn(4096), "b": torch.randn(64, 8)}
    sender, receiver = SparseSyncCore(channel_name="tamper"), SparseSyncCore(channel_name="tamper")
    channel = wire.channel_handle("tamper")

    async def received(version) -> list[str]:
        return [name async for name, _ in receiver.receive_weights(version)]

    async def scenario():
        _connect([sender, receiver])
        first, names = await asyncio.gather(sender.send_weights(list(w.items()), 0), received(0))
        assert first["checkpoint_engine/sparse_sync/full_push"] == 1.0 and names == ["a", "b"]
        w["a"][::100] += 1.0
        _connect([sender, receiver])
        sending = asyncio.create_task(sender.send_weights(list(w.items()), 1))
        version, token, box = await channel.take.remote(0, 1, 0, None, 60.0)
        payload = await box[0]
        payload.buckets[0].values = payload.buckets[0].values.clone()
        payload.buckets[0].values[3] ^= 1 << 5  # one bit flipped in flight
        await channel.offer.remote(0, 1, 0, token, [ray.put(payload)])
        names = await received(1)
        return await sending, names

    metrics, names = asyncio.run(scenario())
    assert metrics["checkpoint_engine/sparse_sync/resent"] == 1.0
    assert metrics["checkpoint_engine/sparse_sync/checksum_mismatches"] == 1.0
    assert receiver.counters["checksum_mismatches"] == 1 and names == ["a", "b"]  # the resend was full
    _assert_mirror_equals(receiver.mirror, w)


@pytest.mark.slow  # starts a Ray cluster
def test_the_mailbox_ends_with_the_process_of_verls_manager_and_its_workers_find_it(ray_cluster):
    import ray

    from thundersync_verl.backends.mailbox import job_scoped
    from thundersync_verl.backends.sparse_sync import wire

    @ray.remote(num_cpus=0)
    class ManagerProcess:  # where verl's CheckpointEngineManager runs build_topology before every push
        def topology(self) -> str:
            cores = [SparseSyncCore(channel_name="lifetime"), SparseSyncCore(channel_name="lifetime")]
            SparseSyncCore.build_topology(1, 1, [c.prepare() for c in cores])
            return wire.claim_channel("lifetime")._actor_id.hex()

    manager = ManagerProcess.remote()
    claimed = ray.get(manager.topology.remote())
    worker_view = wire.channel_handle("lifetime")  # a learner rank or rollout server asking by name
    assert worker_view._actor_id.hex() == claimed
    ray.get(worker_view.offer.remote(0, 1, 0, "token", []))  # a live mailbox
    ray.kill(manager)
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        try:
            ray.get_actor(job_scoped("lifetime"))
        except ValueError:
            break  # gone with the process that held it
        time.sleep(0.2)
    else:
        pytest.fail("the claimed mailbox outlived the process of verl's manager")


def _learner_weights(worker) -> dict:
    import ray

    def read(self):
        from thundersync_verl import verl_adapter as va

        gen, _ = va.actor_engine(self).get_per_tensor_param()
        return {name: t.detach().to("cpu").clone() for name, t in gen}

    return ray.get(worker.__ray_call__.remote(read))


def _server_weights() -> dict:
    import ray

    from thundersync_verl.backends.cpu.rollout import server_actor_name

    def read(self):
        return {name: t.detach().clone() for name, t in self.engine.model.state_dict().items()}

    return ray.get(ray.get_actor(server_actor_name(0)).__ray_call__.remote(read))


def _assert_rollout_equals_learner(worker, dtype: torch.dtype) -> None:
    learner, server = _learner_weights(worker), _server_weights()
    assert learner and set(learner) <= set(server)
    for name, t in learner.items():
        assert _same_bits(server[name], t.to(dtype)), name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verl_manager_pushes_a_real_learner_to_a_real_rollout_replica(ray_cluster, tmp_path):
    from omegaconf import OmegaConf
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from thundersync_harness import engine_setup as setup
    from thundersync_harness.engine_steps import sync_step
    from thundersync_verl import verl_adapter as va
    from thundersync_verl.learner.streaming_worker import StreamingActorWorker

    model_path, pad_id, vocab = setup.build_tiny_model(tmp_path / "model")
    config = setup.verl_config(model_path, groups=2, micro=4, optimizer="AdamW", lr=1e-6)  # an RL learning rate
    rollout = config.actor_rollout_ref.rollout
    OmegaConf.update(config, "actor_rollout_ref.rollout", {"name": "hf_cpu", "dtype": "bfloat16", "nnodes": 1,
                                                           "n_gpus_per_node": 1})
    OmegaConf.update(config, "actor_rollout_ref.rollout.checkpoint_engine",
                     {"backend": BACKEND_NAME, "engine_kwargs": {BACKEND_NAME: {"dtype": "bfloat16"}}}, force_add=True)
    wg = va.ray_worker_group_with(StreamingActorWorker, config=config.actor_rollout_ref, role="actor", n_workers=1)
    wg.init_model()
    replica = RolloutReplicaRegistry.get("hf_cpu")(replica_rank=0, config=rollout, model_config=config.actor_rollout_ref.model,
                                                   gpus_per_node=1)
    asyncio.run(replica.init_standalone())
    manager = va.checkpoint_engine_manager(rollout.checkpoint_engine, wg, [replica])
    prefix = "checkpoint_engine/sparse_sync"

    first = manager.update_weights(global_steps=0)
    assert first[f"{prefix}/full_push"] == 1.0
    from thundersync_verl.backends import mailbox
    from thundersync_verl.backends.sparse_sync import wire

    assert mailbox.job_scoped(wire.CHANNEL_NAME) in mailbox._claimed  # held by the manager's process (the driver)
    _assert_rollout_equals_learner(wg.workers[0], torch.bfloat16)

    trajs, _arrival = setup.make_trajectories(seed=0, groups=2, vocab=vocab)
    sync_step(wg, trajs, list(range(len(trajs))), pad_id)  # a real AdamW step of verl's update_actor
    second = manager.update_weights(global_steps=1)
    assert second[f"{prefix}/full_push"] == 0.0 and 0.0 < second[f"{prefix}/density"] < 1.0 / 3
    assert second[f"{prefix}/payload_mbytes"] < second[f"{prefix}/dense_mbytes"]
    _assert_rollout_equals_learner(wg.workers[0], torch.bfloat16)

    def restart(self):  # the rollout side's engine as a restarted worker builds it: no copy, no chain
        self.checkpoint_engine = CheckpointEngineRegistry.new(BACKEND_NAME, bucket_size=1 << 20, dtype="bfloat16")

    import ray

    ray.get(replica.workers[0].__ray_call__.remote(restart))
    sync_step(wg, trajs, list(range(len(trajs))), pad_id)
    third = manager.update_weights(global_steps=2)
    assert third[f"{prefix}/full_push"] == 1.0 and third[f"{prefix}/full_pushes"] == 2.0
    _assert_rollout_equals_learner(wg.workers[0], torch.bfloat16)


def test_gpu_check_codec_part_runs_on_the_cpu_too():
    from thundersync_verl.backends.sparse_sync.gpu_check import codec_on_device

    out = codec_on_device(n_params=1 << 20, pushes=2, density=0.05, device="cpu")
    assert out["bitwise_equal"] and out["encode_apply_gbps"] > 0


def test_plan_predicts_the_push_time_from_the_measured_density(tmp_path, capsys):
    import json

    from thundersync_verl.sim import sim_cli as cli
    from thundersync_verl.sim.hardware import ModelSpec, weight_sync_seconds
    from thundersync_verl.sim.presets import PAPER_WEIGHT_SYNC_FIXED_S

    measured = tmp_path / "weight_sync.json"
    measured.write_text(json.dumps({"density": 0.025}))
    cli.main(["plan", "--params", "8B", "--layers", "36", "--hidden", "4096", "--gpus", "16", "--steps", "3",
              "--changed-fraction-from", str(measured)])
    line = capsys.readouterr().out.splitlines()[0]
    model = ModelSpec("custom", 8e9, 36, 4096)
    dense = weight_sync_seconds(model, 10.0, PAPER_WEIGHT_SYNC_FIXED_S)
    sparse = weight_sync_seconds(model, 10.0, PAPER_WEIGHT_SYNC_FIXED_S, 0.025)
    assert line == f"weight push at 10 GB/s: dense {dense:.2f} s, sparse at density 0.0250 (measured): {sparse:.2f} s"
    assert sparse < dense
