"""The named mailbox actors of the weight pushes (``cpu_channel``'s ``WeightChannel``, ``sparse_sync``'s channel).

Why:
1. A learner rank and every rollout server find one mailbox by name, whoever asks first creating it; it is
   detached so that it outlives whichever process created it (a restarted rollout server must not take the
   learner's mailbox with it).
2. A Ray name is unique per namespace, and jobs that set one namespace (``ray_kwargs.ray_init.namespace``, a
   shared cluster's convention) would share a mailbox: one job's rollout could load another's weights of the same
   version. The name therefore carries the job's id (``job_scoped``), which the driver and every actor it starts
   share.
"""

from __future__ import annotations

import ray


def job_scoped(name: str) -> str:
    """``name`` made unique to the calling job (``<name>@<job id>``)."""
    return f"{name}@{ray.get_runtime_context().get_job_id()}"


def mailbox(actor_class, name: str):
    """The job's mailbox actor called ``name`` (created on first use)."""
    return actor_class.options(name=job_scoped(name), get_if_exists=True, lifetime="detached").remote()
