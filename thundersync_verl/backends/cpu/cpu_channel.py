"""Checkpoint engine ``cpu_channel``: learner -> standalone rollout weight sync without NCCL.

1. verl's disaggregated trainers (separate_async, and our ThunderSync trainer with a
   standalone rollout pool) push weights through a registered checkpoint engine; the
   built-in ones need NCCL/NIXL/RDMA. On a CPU machine the object store is the wire.
2. The learner's rank 0 gathers full tensors (every rank iterates: FSDP2 ``full_tensor``
   is a collective), puts them into the object store once and hands the reference (boxed in a
   list, so Ray does not resolve it) to a named mailbox actor; each rollout worker awaits that
   version and fetches the tensors straight from the object store. The mailbox never holds the
   tensors themselves: passed by value, they were deserialised into it and serialised out again on
   every push, host work on the rollout side's cores (about 0.1 s per 1.9 M-parameter push).
3. Full tensors, overwritten on the receiver: lossless, like verl's NCCL engine.
4. A push that fails half-way (the sender dies or raises after part of the snapshot) must not leave the
   rollout on a mix of two versions: the mailbox records how many tensors the snapshot has, and a
   receiver waits for a COMPLETE snapshot of its version; none of a partial one is ever handed out. The
   trainer pushes the whole version again (``thundersync.weight_push_retries``), which completes every
   waiting receiver; one still partial when the wait times out fails with ``IncompletePushError``.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator

import ray

from thundersync_verl.backends.mailbox import claim, mailbox
from thundersync_verl.run import faults
from thundersync_verl.core.errors import rule_message

BACKEND_NAME = "cpu_channel"
CHANNEL_NAME = "thundersync_weight_channel"


class IncompletePushError(RuntimeError):
    """A weight snapshot holds fewer tensors than its sender announced (point 4)."""


@ray.remote(num_cpus=0)
class WeightChannel:
    """A mailbox holding the latest weight snapshot and its version."""

    def __init__(self) -> None:
        self.version = None
        self.box: list = []  # [ObjectRef of the snapshot's (name, tensor) list]: the tensors stay in the object store
        self.count = self.total = 0
        self.changed = asyncio.Condition()

    async def put(self, version, box: list, count: int, total: int | None = None) -> int:
        """Publish ``box`` (``[ref]`` to ``count`` named tensors) as ``version``; ``total``: the tensors of the whole
        snapshot (default: ``count``)."""
        async with self.changed:
            self.version, self.box, self.count = version, list(box), int(count)
            self.total = self.count if total is None else int(total)
            self.changed.notify_all()
        return self.count

    async def get(self, version, timeout_s: float = 600.0) -> list:
        """``[ref]`` of the complete snapshot of ``version`` (any version when None), waiting up to ``timeout_s``
        (point 4)."""
        def complete() -> bool:
            return self.version is not None and (version is None or self.version == version) and self.count == self.total

        async def _ready():
            async with self.changed:
                await self.changed.wait_for(complete)
                return self.box

        try:
            return await asyncio.wait_for(_ready(), timeout_s)
        except asyncio.TimeoutError:
            if self.version is not None and (version is None or self.version == version):
                raise IncompletePushError(rule_message(
                    f"weight version {self.version} holds {self.count} of {self.total} tensors after {timeout_s}s",
                    "the push failed half-way and was not repeated; loading it would leave the rollout on a mix of "
                    "two versions",
                    "nothing was loaded; check the learner's weight push (thundersync.weight_push_retries)")) from None
            raise TimeoutError(
                f"no weights for version {version} arrived within {timeout_s}s (latest: {self.version}); "
                "the learner did not call send_weights for this step"
            ) from None


def channel_handle():
    return mailbox(WeightChannel, CHANNEL_NAME)


def claim_channel():
    """The job's mailbox, held by the process of verl's manager so that it ends with the job (``mailbox.py``)."""
    return claim(WeightChannel, CHANNEL_NAME)


def make_engine_class():
    from verl.checkpoint_engine.base import CheckpointEngine

    class CpuChannelCheckpointEngine(CheckpointEngine):
        def __init__(self, bucket_size: int = 0, is_master: bool = False, **kwargs) -> None:
            self.rank = 0
            self.is_sender = False

        def prepare(self) -> dict[str, Any]:
            return {}

        @classmethod
        def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
            claim_channel()  # verl's manager's process, before any push: the mailbox ends with the job
            actor = {"rank": list(range(actor_wg_world_size)), "is_sender": [True] * actor_wg_world_size}
            rollout = {"rank": list(range(rollout_world_size)), "is_sender": [False] * rollout_world_size}
            return actor, rollout

        def init_process_group(self, rank: int = 0, is_sender: bool = False, **kwargs):
            self.rank, self.is_sender = int(rank), bool(is_sender)

        def finalize(self):
            return None

        async def send_weights(self, weights, global_steps: int | None = None):
            named = [(name, t.detach().to("cpu").clone()) for name, t in weights]  # all ranks: collective
            if self.rank == 0 and faults.ACTIVE and faults.push_cut(global_steps):  # $THUNDERSYNC_FAULTS: push_fail
                half = named[: len(named) // 2]
                await channel_handle().put.remote(global_steps, [ray.put(half)], len(half), len(named))
                raise RuntimeError(f"weight push of version {global_steps} failed after {len(named) // 2} of "
                                   f"{len(named)} tensors (injected by {faults.ENV})")
            if self.rank == 0:
                await channel_handle().put.remote(global_steps, [ray.put(named)], len(named))
            return {}

        async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator:
            box = await channel_handle().get.remote(global_steps)
            for name, tensor in await box[0]:
                yield name, tensor

    CpuChannelCheckpointEngine.__name__ = CpuChannelCheckpointEngine.__qualname__ = "CpuChannelCheckpointEngine"
    return CpuChannelCheckpointEngine


def register_checkpoint_engine() -> None:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    if BACKEND_NAME not in getattr(CheckpointEngineRegistry, "_registry", {}):
        CheckpointEngineRegistry.register(BACKEND_NAME)(make_engine_class())
