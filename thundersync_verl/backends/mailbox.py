"""The named mailbox actors of the weight pushes (``cpu_channel``'s ``WeightChannel``, ``sparse_sync``'s channel).

Why:
1. A learner rank and every rollout server find one mailbox by name; no rank or server may own it, as a restarted
   rollout server must not take the learner's mailbox (and a push in flight) with it.
2. A Ray name is unique per namespace, and jobs that set one namespace (``ray_kwargs.ray_init.namespace``, a
   shared cluster's convention) would share a mailbox: one job's rollout could load another's weights of the same
   version. The name therefore carries the job's id (``job_scoped``), which the driver and every actor it starts
   share.
3. The mailbox ends with its job. verl's ``CheckpointEngineManager`` calls the engine's ``build_topology`` in its
   own process (the trainer's driver) before the workers send or receive, at every push, so the engines ``claim``
   the mailbox there: created by that process, held by it (a named actor with no handle left is collected) and
   gone when it ends. Detached, as it was, each finished job left one idle actor process on a long-lived cluster.
   A worker that asks first (an engine driven without verl's manager) still creates a detached one (``mailbox``).
"""

from __future__ import annotations

import ray

_claimed: dict[str, object] = {}  # job-scoped name -> the handle this process holds (point 3)


def job_scoped(name: str) -> str:
    """``name`` made unique to the calling job (``<name>@<job id>``)."""
    return f"{name}@{ray.get_runtime_context().get_job_id()}"


def mailbox(actor_class, name: str):
    """The job's mailbox actor called ``name``: the claimed one, or a detached one made now (point 3)."""
    return actor_class.options(name=job_scoped(name), get_if_exists=True, lifetime="detached").remote()


def claim(actor_class, name: str):
    """The job's mailbox ``name``, created if missing by this process and held by it, so that it ends with this
    process (point 3). Called where verl's manager runs, before any push; later calls return the held handle.
    None in a process without Ray (a topology computed alone, as in tests): there is no job whose mailbox to hold."""
    if not ray.is_initialized():
        return None
    scoped = job_scoped(name)
    if scoped not in _claimed:
        _claimed[scoped] = actor_class.options(name=scoped, get_if_exists=True).remote()
    return _claimed[scoped]
