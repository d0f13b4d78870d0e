"""How a sparse push travels: a rendezvous actor for manifests and acks, and two ways to move buckets.

Why:
1. Every push is a small conversation per sender shard: the sender offers a payload for a version,
   each receiver answers ok or refused (checksum / chain), and the sender decides "done" or
   "resend" (a full push of that shard). ``SparseChannel`` (a named Ray actor, no CPU reserved)
   carries that conversation on any Ray cluster, CPU or GPU.
2. ``ChannelWire`` moves the buckets through Ray's object store (the payload is ``ray.put`` once
   and each receiver fetches it): the CPU path, and the same wire as the ``cpu_channel`` engine.
3. ``CollectiveWire`` moves the buckets by NCCL broadcast (``ray.util.collective``, as verl's own
   NCCL engine does) from the one sender rank, while only the manifest goes through the channel.
   It needs CUDA and cupy and is UNVERIFIED until ``ci/gpu_check.sh`` has run it on a GPU machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import ray
import torch

from thundersync_verl.backends.mailbox import claim, mailbox
from thundersync_verl.backends.sparse_sync import codec

CHANNEL_NAME = "thundersync_sparse_sync_channel"


@ray.remote(num_cpus=0)
class SparseChannel:
    """Per shard: the latest offer (version, attempt, token, payload box), acks and decisions."""

    def __init__(self) -> None:
        self.offers: dict[int, dict] = {}
        self.acks: dict[tuple, list] = {}
        self.decisions: dict[tuple, str] = {}
        self.changed = asyncio.Condition()

    async def offer(self, shard: int, version, attempt: int, token: str, box: list) -> None:
        async with self.changed:
            if attempt == 0:  # a new push: forget the conversation about older ones
                self.acks = {k: v for k, v in self.acks.items() if k[0] != shard}
                self.decisions = {k: v for k, v in self.decisions.items() if k[0] != shard}
            self.offers[shard] = {"version": version, "attempt": attempt, "token": token, "box": box}
            self.changed.notify_all()

    async def take(self, shard: int, version, attempt: int, not_token: str | None, timeout_s: float):
        """The offer of ``shard`` for ``version`` (any when None) at ``attempt``, not the one already taken."""
        def ready():
            o = self.offers.get(shard)
            return o is not None and (version is None or o["version"] == version) and o["attempt"] == attempt \
                and o["token"] != not_token

        await self._wait(ready, timeout_s, f"no push of shard {shard} for version {version} (attempt {attempt})")
        o = self.offers[shard]
        return o["version"], o["token"], o["box"]

    async def ack(self, shard: int, version, attempt: int, receiver: int, ok: bool, reason: str) -> None:
        async with self.changed:
            self.acks.setdefault((shard, version, attempt), []).append((receiver, ok, reason))
            self.changed.notify_all()

    async def wait_acks(self, shard: int, version, attempt: int, n: int, timeout_s: float) -> list:
        key = (shard, version, attempt)
        await self._wait(lambda: len(self.acks.get(key, [])) >= n, timeout_s,
                         f"{n} receivers did not all answer push of shard {shard} for version {version}")
        return list(self.acks[key])

    async def decide(self, shard: int, version, attempt: int, decision: str) -> None:
        async with self.changed:
            self.decisions[(shard, version, attempt)] = decision
            self.changed.notify_all()

    async def decision(self, shard: int, version, attempt: int, timeout_s: float) -> str:
        key = (shard, version, attempt)
        await self._wait(lambda: key in self.decisions, timeout_s, f"the sender of shard {shard} did not decide")
        return self.decisions[key]

    async def _wait(self, predicate, timeout_s: float, what: str) -> None:
        async def waiting():
            async with self.changed:
                await self.changed.wait_for(predicate)

        try:
            await asyncio.wait_for(waiting(), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what} within {timeout_s}s; the other side of the weight push stopped") from None


def channel_handle(name: str = CHANNEL_NAME):
    return mailbox(SparseChannel, name)


def claim_channel(name: str = CHANNEL_NAME):
    """The job's mailbox, held by the process of verl's manager so that it ends with the job (``mailbox.py``)."""
    return claim(SparseChannel, name)


class ChannelWire:
    """Buckets through Ray's object store: the sender puts the payload once, receivers fetch it."""

    name = "channel"

    def __init__(self, channel) -> None:
        self.channel = channel

    async def publish(self, payload: codec.Payload, version, attempt: int) -> None:
        ref = ray.put(payload)
        await self.channel.offer.remote(payload.shard, version, attempt, payload.token, [ref])

    async def fetch(self, shard: int, version, attempt: int, not_token: str | None, timeout_s: float):
        version, _token, box = await self.channel.take.remote(shard, version, attempt, not_token, timeout_s)
        return version, await box[0]


def _manifest(payload: codec.Payload) -> codec.Payload:
    """The payload with each bucket's tensors replaced by empty ones of the right dtype (sizes kept apart)."""
    empty = [codec.Bucket(b.dtype, b.indices[:0].cpu(), b.values[:0].cpu()) for b in payload.buckets]
    return dataclasses.replace(payload, buckets=empty)


class CollectiveWire:
    """Buckets by NCCL broadcast from group rank 0 (the one sender); manifests through the channel.

    UNVERIFIED: written against ``ray.util.collective`` as verl's NCCL engine uses it; not yet run.
    """

    name = "nccl"

    def __init__(self, channel, group_name: str, rank: int, world_size: int, device: str = "cuda") -> None:
        from ray.util import collective

        self.collective, self.channel = collective, channel
        self.group_name, self.rank, self.world_size, self.device = group_name, rank, world_size, device
        if rank >= 0 and not collective.is_group_initialized(group_name):
            collective.init_collective_group(world_size, rank, "nccl", group_name)

    async def publish(self, payload: codec.Payload, version, attempt: int) -> None:
        sizes = [(b.indices.numel(), b.values.numel()) for b in payload.buckets]
        await self.channel.offer.remote(payload.shard, version, attempt, payload.token, [_manifest(payload), sizes])
        for b in payload.buckets:
            self._broadcast(b.indices.to(self.device))
            self._broadcast(b.values.to(self.device))
        torch.cuda.synchronize()

    async def fetch(self, shard: int, version, attempt: int, not_token: str | None, timeout_s: float):
        version, _token, box = await self.channel.take.remote(shard, version, attempt, not_token, timeout_s)
        manifest, sizes = box
        buckets = []
        for b, (n_idx, n_val) in zip(manifest.buckets, sizes):
            indices = torch.empty(n_idx, dtype=b.indices.dtype, device=self.device)
            values = torch.empty(n_val, dtype=b.values.dtype, device=self.device)
            self._broadcast(indices)
            self._broadcast(values)
            buckets.append(codec.Bucket(b.dtype, indices, values))
        torch.cuda.synchronize()
        return version, dataclasses.replace(manifest, buckets=buckets)

    def _broadcast(self, t: torch.Tensor) -> None:
        if t.numel():
            self.collective.broadcast(t, src_rank=0, group_name=self.group_name)

    def close(self) -> None:
        if self.rank >= 0 and self.collective.is_group_initialized(self.group_name):
            self.collective.destroy_collective_group(self.group_name)


def make_wire(kind: str, channel, **group: Any):
    if kind == ChannelWire.name:
        return ChannelWire(channel)
    if kind == CollectiveWire.name:
        return CollectiveWire(channel, **group)
    from thundersync_verl.core.errors import rule_message

    raise ValueError(rule_message(
        f"sparse_sync transport {kind!r} is unknown",
        "the payload needs a wire: Ray's object store (any machine) or NCCL (GPU machines)",
        "set actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.sparse_sync.transport to channel or nccl"))
