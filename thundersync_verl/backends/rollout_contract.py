"""verl's rollout replica / server / adapter contract for one-actor-per-replica backends (``hf_cpu``, ``replay``).

Both backends run each replica as one named Ray actor (the server) and differ only in the server
class, the actor's name, its extra constructor arguments and what the learner ships it after an
optimizer step; everything else is built here once:
1. ``make_replica_class`` builds the verl ``RolloutReplica``: ``launch_servers`` starts the server
   actor (high max_concurrency, no CPU/GPU reservation, on the node of the replica's rollout slot) and waits for its ``stats()``, so a model
   or recording that cannot be loaded fails at launch rather than at the first generate; rollout
   workers use no GPU.
2. ``make_server_adapter_class`` builds the learner-side ``BaseRollout``: every rank iterates the
   pushed weights (FSDP2 ``full_tensor()`` is a collective), ``collect`` turns them into the
   server's payload, and the leader rank of each replica calls
   ``server.update_weights(payload, global_steps, peft_config=...)`` (the peft config verl passes with a LoRA
   actor's naive push, else None: ``backends/lora_weights.py``). resume / release are no-ops: the servers keep
   their weights and per-request state in host memory.
3. ``ServerControl`` answers the verl control calls that are the same on both servers (wake_up,
   sleep, kv-cache release, profiling, drain); a server supplies ``_in_flight()`` and
   ``resume_generation()``.
The classes are built on first use (they subclass verl's) and carry the calling module's name, so
verl's dotted-path lookup and pickling by reference find them where they are registered.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, AsyncIterator, Awaitable, Callable

import ray

from thundersync_verl import verl_adapter as va


async def iterate_weights(weights) -> AsyncIterator:
    """The checkpoint engine's ``(name, tensor)`` pairs: a plain iterable (hybrid) or an async one (standalone)."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


class ServerControl:
    """verl's control calls that mean the same on every server here (a mixin for the server actors)."""

    def _in_flight(self) -> int:
        raise NotImplementedError

    async def resume_generation(self):
        raise NotImplementedError

    async def resume_engine_generation(self):
        await self.resume_generation()

    async def open_submission_gate(self):
        await self.resume_generation()

    async def wake_up(self, tags=None):
        return None  # weights stay resident in host memory

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None  # no shared KV pool: caches (if any) are per request and die with it

    release_kv_cache = resume_kv_cache = clear_kv_cache

    async def wait_for_requests_to_drain(self):
        while self._in_flight():
            await asyncio.sleep(0.01)

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None


def _named(cls: type, name: str, module: str) -> type:
    cls.__name__ = cls.__qualname__ = name
    cls.__module__ = module
    return cls


def make_replica_class(name: str, module: str, server_cls: type, actor_name: Callable[[int, str], str],
                       server_args: Callable[[], tuple] = tuple) -> type:
    """A ``RolloutReplica`` subclass whose ``launch_servers`` starts the Ray actor ``actor_name(replica_rank, name_suffix)``
    as ``server_cls(config, model_config, rollout_mode, replica_rank, *server_args())``."""

    class Replica(va.rollout_replica_base()):
        async def launch_servers(self):
            actor = actor_name(self.replica_rank, self.name_suffix)
            server = (
                ray.remote(server_cls)
                .options(name=actor, max_concurrency=self.max_concurrency, num_cpus=0, num_gpus=0,
                         **await _on_workers_node(self.workers))
                .remote(self.config, self.model_config, self.rollout_mode, self.replica_rank, *server_args())
            )
            await server.stats.remote()  # load errors surface here, not at the first generate
            self.servers = [server]
            self._server_handle = server
            self._server_address = actor

        def rollout_worker_use_gpu(self) -> bool:
            return False

    return _named(Replica, name, module)


async def _on_workers_node(workers: list) -> dict:
    """Ray options that start a replica's server on the node of its rollout slot (its first worker), as verl's own
    servers are: with no reservation Ray would otherwise place it on any node, e.g. the driver's."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not workers:
        return {}
    node_id = await workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def make_server_adapter_class(name: str, module: str, actor_name: Callable[[int], str],
                              collect: Callable[[Any, str], Awaitable[Any]]) -> type:
    """A ``BaseRollout`` subclass shipping ``await collect(weights, wire_format)`` to its replica's server."""

    class ServerAdapter(va.base_rollout_cls()):
        def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **kwargs):
            super().__init__(config, model_config, device_mesh)
            rank = int(os.environ.get("RANK", "0"))
            world = self.config.tensor_model_parallel_size * self.config.data_parallel_size * self.config.pipeline_model_parallel_size
            self.replica_rank = rank // world if replica_rank == -1 else replica_rank
            self.is_leader_rank = rank % world == 0
            self._server = None

        def _server_handle(self):
            if self._server is None:
                self._server = ray.get_actor(actor_name(self.replica_rank))
            return self._server

        async def resume(self, tags: list[str]):
            return None

        async def release(self):
            return None

        async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps=None, **kwargs):
            payload = await collect(weights, wire_format)  # on every rank: the gathers are collectives
            if self.is_leader_rank:
                await self._server_handle().update_weights.remote(payload, global_steps,
                                                                  peft_config=kwargs.get("peft_config"))

    return _named(ServerAdapter, name, module)


def lazy_classes(module_globals: dict, factories: dict[str, Callable[[], type]]) -> Callable[[str], type]:
    """A module ``__getattr__`` building each class on first use, once (verl resolves adapters by dotted path)."""
    pending = dict(factories)

    def __getattr__(name: str) -> type:
        if name in pending:
            cls = pending.pop(name)()
            module_globals[name] = cls
            return cls
        raise AttributeError(name)

    return __getattr__
