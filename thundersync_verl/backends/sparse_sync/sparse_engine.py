"""Checkpoint engine ``sparse_sync``: lossless sparse learner -> rollout weight pushes, registered with verl.

Why:
1. verl's disaggregated trainers (ours included) push weights through a registered checkpoint
   engine once per step, on the critical path. This one sends only the elements whose bits changed
   since the last push (``state.ShardEncoder``) and the receiver overwrites its copy with them
   (``state.Mirror``), so the rollout ends bit-identical to the learner at a fraction of the bytes.
2. It is selected by name like any verl backend, in any recipe and mode:
   ``actor_rollout_ref.rollout.checkpoint_engine.backend=sparse_sync``; its options sit in
   ``engine_kwargs.sparse_sync``: ``transport`` (``channel``: Ray's object store, any machine;
   ``nccl``: GPU broadcast, unverified), ``dtype`` (the rollout's dtype, e.g. ``bfloat16``; default:
   the dtype the learner exports), ``chunk_elems``, ``timeout_s``.
3. Every push is checked: the topology step compares each receiver's chain token with the
   sender's and asks for a full push when they differ (a restart on either side); each receiver
   verifies the checksum and the chain before writing, and a refusal is logged, counted and
   repaired within the same push by a full resend of that shard.
4. ``$THUNDERSYNC_SPARSE_SYNC_LOG`` (benchmarks): each sender shard appends its per-push metrics
   (density, bytes, full or not and why) to that file as JSON lines.
5. The receiver hands the server adapter the parameters that changed (all of them after a full
   push) as full tensors in the rollout dtype, so any rollout that loads named tensors (hf_cpu,
   vLLM, SGLang) takes the update unchanged.
6. With the CPU wire the compiled diff/scatter kernels (``native``) are built (once per machine) or
   loaded when the engine is created, so no push waits for a compiler.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, AsyncGenerator

import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.backends.sparse_sync import native, wire as wires
from thundersync_verl.backends.sparse_sync.state import (DEFAULT_BUCKET_BYTES, DEFAULT_CHUNK_ELEMS, Mirror,
                                                         PushRefused, ShardEncoder)

logger = logging.getLogger(__name__)
BACKEND_NAME = "sparse_sync"
PUSH_LOG_ENV = "THUNDERSYNC_SPARSE_SYNC_LOG"  # a file: each sender shard appends one JSON line per push
GROUP_NAME = "thundersync_sparse_sync"


def _dtype(value) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(str(value), str(value)).replace("torch.", "")
    return getattr(torch, name)


async def _as_sync(weights) -> Any:
    if hasattr(weights, "__aiter__"):
        return [item async for item in weights]
    return weights


class SparseSyncCore:
    """The backend without verl's base class: what the checkpoint engine does on either side."""

    def __init__(self, bucket_size: int = 0, is_master: bool = False, *, transport: str = "channel",
                 dtype=None, chunk_elems: int = DEFAULT_CHUNK_ELEMS, timeout_s: float = 600.0,
                 mirror_device: str | None = None, channel_name: str = wires.CHANNEL_NAME, **_ignored) -> None:
        self.transport, self.dtype = str(transport), _dtype(dtype)
        self.chunk_elems, self.timeout_s = int(chunk_elems), float(timeout_s)
        self.bucket_bytes = int(bucket_size) or DEFAULT_BUCKET_BYTES
        self.channel_name = channel_name
        self.rank, self.is_sender, self.n_senders, self.n_receivers = 0, False, 1, 0
        self.force_full = False
        self.encoder: ShardEncoder | None = None
        self.mirror = Mirror(mirror_device or ("cuda" if self.transport == "nccl" else "cpu"))
        self.taken: dict[int, str] = {}  # per shard: the last payload token this receiver took
        self.wire = None
        self.counters = {"pushes": 0, "full_pushes": 0, "resends": 0, "checksum_mismatches": 0,
                         "chain_mismatches": 0}
        if self.mirror.device.type == "cpu":
            native.kernels()  # None (logged once) when they cannot be built: the numpy kernels run

    # -- topology (verl calls these before every push) -------------------------------------
    def prepare(self) -> dict[str, Any]:
        return {"sender_token": self.encoder.token if self.encoder is not None else None,
                "sender_shards": self.encoder.n_shards if self.encoder is not None else None,
                "receiver_tokens": dict(self.mirror.tokens), "channel_name": self.channel_name}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        senders, receivers = metadata[:actor_wg_world_size], metadata[actor_wg_world_size:]
        for name in sorted({m.get("channel_name", wires.CHANNEL_NAME) for m in metadata}):
            wires.claim_channel(name)  # verl's manager's process, before any push: the mailbox ends with the job
        tokens = [m["sender_token"] for m in senders]
        stale = any(m["sender_shards"] not in (None, actor_wg_world_size) for m in senders)
        force = stale or any(r["receiver_tokens"].get(s) != tokens[s] for r in receivers for s in range(len(tokens)))
        common = {"n_senders": actor_wg_world_size, "n_receivers": rollout_world_size, "force_full": force}
        actor = {"rank": list(range(actor_wg_world_size)), "is_sender": [True] * actor_wg_world_size,
                 **{k: [v] * actor_wg_world_size for k, v in common.items()}}
        rollout = {"rank": list(range(rollout_world_size)), "is_sender": [False] * rollout_world_size,
                   **{k: [v] * rollout_world_size for k, v in common.items()}}
        return actor, rollout

    def init_process_group(self, rank: int = 0, is_sender: bool = False, n_senders: int = 1, n_receivers: int = 0,
                           force_full: bool = False, **_ignored) -> None:
        self.rank, self.is_sender = int(rank), bool(is_sender)
        self.n_receivers, self.force_full = int(n_receivers), bool(force_full)
        if self.transport == "nccl":
            n_senders = 1  # one broadcasting rank; the other learner ranks only take part in the gathers
        self.n_senders = int(n_senders)
        if self.is_sender and (self.encoder is None or self.encoder.n_shards != self.n_senders):
            if self.rank < self.n_senders:
                self.encoder = ShardEncoder(self.rank, self.n_senders, dtype=self.dtype, chunk_elems=self.chunk_elems,
                                            bucket_bytes=self.bucket_bytes)
        self.wire = wires.make_wire(self.transport, wires.channel_handle(self.channel_name),
                                    **self._group_args())

    def _group_args(self) -> dict:
        if self.transport != "nccl":
            return {}
        group_rank = (0 if self.rank == 0 else -1) if self.is_sender else self.rank + 1
        return {"group_name": GROUP_NAME, "rank": group_rank, "world_size": self.n_receivers + 1}

    def finalize(self) -> None:
        if self.wire is not None and hasattr(self.wire, "close"):
            self.wire.close()
        self.wire = None

    # -- sender ----------------------------------------------------------------------------
    async def send_weights(self, weights, global_steps: int | None = None) -> dict:
        weights = await _as_sync(weights)
        if self.encoder is None or self.rank >= self.n_senders:  # iterate anyway: the gathers are collectives
            for _name, _tensor in weights:
                pass
            return {}
        payload, stats = self.encoder.encode(weights, force_full=self.force_full)
        await self.wire.publish(payload, global_steps, 0)
        acks = await self.wire.channel.wait_acks.remote(payload.shard, global_steps, 0, self.n_receivers, self.timeout_s)
        refused = [(r, reason) for r, ok, reason in acks if not ok]
        if refused:
            for receiver, reason in refused:
                self.counters[f"{reason}_mismatches"] = self.counters.get(f"{reason}_mismatches", 0) + 1
                logger.warning("sparse_sync: receiver %s refused shard %s for version %s (%s); resending it full",
                               receiver, payload.shard, global_steps, reason)
            await self.wire.channel.decide.remote(payload.shard, global_steps, 0, "resend")
            payload = self.encoder.full_payload("resend")
            self.counters["resends"] += 1
            await self.wire.publish(payload, global_steps, 1)
            acks = await self.wire.channel.wait_acks.remote(payload.shard, global_steps, 1, self.n_receivers,
                                                            self.timeout_s)
            if not all(ok for _r, ok, _reason in acks):
                await self.wire.channel.decide.remote(payload.shard, global_steps, 1, "failed")
                self.encoder.reset()
                raise RuntimeError(f"sparse_sync: a full push of shard {payload.shard} was refused too ({acks}); "
                                   "the receivers cannot hold the learner's weights")
            await self.wire.channel.decide.remote(payload.shard, global_steps, 1, "done")
        else:
            await self.wire.channel.decide.remote(payload.shard, global_steps, 0, "done")
        self.encoder.commit(payload)
        self.counters["pushes"] += 1
        self.counters["full_pushes"] += int(payload.full)
        metrics = self._metrics(stats, payload, bool(refused))
        logger.info("sparse_sync push v=%s shard %s: density %.5f, %d of %d bytes, full=%s %s", global_steps,
                    payload.shard, stats.density, payload.nbytes, stats.dense_bytes, payload.full, payload.reason)
        if os.environ.get(PUSH_LOG_ENV):
            with open(os.environ[PUSH_LOG_ENV], "a") as f:
                f.write(json.dumps({"version": global_steps, "shard": payload.shard, "reason": payload.reason,
                                    **metrics}) + "\n")
        return metrics

    def _metrics(self, stats, payload, resent: bool) -> dict:
        prefix = "checkpoint_engine/sparse_sync"
        out = {f"{prefix}/density": stats.density, f"{prefix}/payload_mbytes": payload.nbytes / (1 << 20),
               f"{prefix}/dense_mbytes": stats.dense_bytes / (1 << 20), f"{prefix}/full_push": float(payload.full),
               f"{prefix}/encode_s": stats.encode_s, f"{prefix}/resent": float(resent)}
        out.update({f"{prefix}/{k}": float(v) for k, v in self.counters.items()})
        return out

    # -- receiver --------------------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator:
        names, full = set(), False
        for shard in range(self.n_senders):
            touched, was_full = await self._receive_shard(shard, global_steps)
            names |= touched
            full = full or was_full
        for name, tensor in self.mirror.named_tensors(sorted(self.mirror.flat) if full else sorted(names)):
            yield name, tensor

    async def _receive_shard(self, shard: int, version) -> tuple[set, bool]:
        names, full = set(), False
        for attempt in (0, 1):
            _v, payload = await self.wire.fetch(shard, version, attempt, self.taken.get(shard), self.timeout_s)
            self.taken[shard] = payload.token
            try:
                names |= self.mirror.apply(payload).names
                full = full or payload.full
                ok, reason = True, ""
            except PushRefused as refusal:
                self.counters[f"{refusal.reason}_mismatches"] += 1
                logger.warning("sparse_sync: refused shard %s for version %s: %s", shard, version, refusal)
                ok, reason = False, refusal.reason
            await self.wire.channel.ack.remote(shard, version, attempt, self.rank, ok, reason)
            decision = await self.wire.channel.decision.remote(shard, version, attempt, self.timeout_s)
            if decision == "done":
                return names, full
            if decision != "resend":
                break
        raise RuntimeError(f"sparse_sync: shard {shard} for version {version} could not be applied")


def make_engine_class():
    """The verl ``CheckpointEngine`` subclass (built on first use: it needs verl)."""
    base = va.checkpoint_engine_base()

    class SparseSyncCheckpointEngine(SparseSyncCore, base):
        def __init__(self, bucket_size: int = 0, is_master: bool = False, **kwargs) -> None:
            SparseSyncCore.__init__(self, bucket_size, is_master, **kwargs)

    SparseSyncCheckpointEngine.__name__ = SparseSyncCheckpointEngine.__qualname__ = "SparseSyncCheckpointEngine"
    return SparseSyncCheckpointEngine


def register_checkpoint_engine() -> None:
    va.register_checkpoint_engine(BACKEND_NAME, make_engine_class)
