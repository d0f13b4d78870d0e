"""Checkpoint engine ``cpu_channel``: learner -> standalone rollout weight sync without NCCL.

1. verl's disaggregated trainers (separate_async, and our ThunderSync trainer with a
   standalone rollout pool) push weights through a registered checkpoint engine; the
   built-in ones need NCCL/NIXL/RDMA. On a CPU machine the object store is the wire.
2. The learner's rank 0 gathers full tensors (every rank iterates: FSDP2 ``full_tensor``
   is a collective) and puts one versioned snapshot into a named mailbox actor; each
   rollout worker awaits that version and yields the tensors to its server adapter.
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

from thundersync_verl import faults
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
        self.named: list = []
        self.total = 0
        self.changed = asyncio.Condition()

    async def put(self, version, named: list, total: int | None = None) -> int:
        """Publish ``named`` as ``version``; ``total``: the tensors of the whole snapshot (default: all sent)."""
        async with self.changed:
            self.version, self.named = version, named
            self.total = len(named) if total is None else int(total)
            self.changed.notify_all()
        return len(named)

    async def get(self, version, timeout_s: float = 600.0) -> list:
        """The complete snapshot of ``version`` (any version when None), waiting up to ``timeout_s`` (point 4)."""
        def complete() -> bool:
            return self.version is not None and (version is None or self.version == version) and len(self.named) == self.total

        async def _ready():
            async with self.changed:
                await self.changed.wait_for(complete)
                return self.named

        try:
            return await asyncio.wait_for(_ready(), timeout_s)
        except asyncio.TimeoutError:
            if self.version is not None and (version is None or self.version == version):
                raise IncompletePushError(rule_message(
                    f"weight version {self.version} holds {len(self.named)} of {self.total} tensors after {timeout_s}s",
                    "the push failed half-way and was not repeated; loading it would leave the rollout on a mix of "
                    "two versions",
                    "nothing was loaded; check the learner's weight push (thundersync.weight_push_retries)")) from None
            raise TimeoutError(
                f"no weights for version {version} arrived within {timeout_s}s (latest: {self.version}); "
                "the learner did not call send_weights for this step"
            ) from None


def channel_handle():
    return WeightChannel.options(name=CHANNEL_NAME, get_if_exists=True, lifetime="detached").remote()


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
                await channel_handle().put.remote(global_steps, named[: len(named) // 2], len(named))
                raise RuntimeError(f"weight push of version {global_steps} failed after {len(named) // 2} of "
                                   f"{len(named)} tensors (injected by {faults.ENV})")
            if self.rank == 0:
                await channel_handle().put.remote(global_steps, named)
            return {}

        async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator:
            named = await channel_handle().get.remote(global_steps)
            for name, tensor in named:
                yield name, tensor

    CpuChannelCheckpointEngine.__name__ = CpuChannelCheckpointEngine.__qualname__ = "CpuChannelCheckpointEngine"
    return CpuChannelCheckpointEngine


def register_checkpoint_engine() -> None:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    if BACKEND_NAME not in getattr(CheckpointEngineRegistry, "_registry", {}):
        CheckpointEngineRegistry.register(BACKEND_NAME)(make_engine_class())
