"""Every verl internal the streaming learner reaches for resolves in the pinned verl. No GPU, no Ray."""

from __future__ import annotations

import inspect

import pytest
import torch

from thundersync_verl import verl_adapter as va


def test_worker_base_and_registration_seams_exist():
    base = va.tinker_actor_worker_base()
    assert inspect.isclass(base) and all(hasattr(base, m) for m in ("forward_backward", "optimizer_step", "update_actor"))
    register, dispatch, actor_mesh = va.worker_register_api()
    assert callable(register) and hasattr(dispatch, "ONE_TO_ALL") and {"dispatch_fn", "collect_fn"} <= set(actor_mesh)


def test_streaming_worker_adds_its_methods_to_verls_worker():
    from thundersync_verl.learner.streaming_worker import StreamingActorWorker

    assert issubclass(StreamingActorWorker, va.tinker_actor_worker_base())
    for name in ("stream_begin_batch", "stream_backward", "stream_fold", "finalize_step", "stream_memory"):
        attrs = va.registration_of(getattr(StreamingActorWorker, name))
        assert attrs is not None and attrs["blocking"], name  # registered, and each call waits for its result


def test_engine_precisions_fp32_yes_fp64_no():
    assert va.precision_dtype("fp32") == torch.float32
    with pytest.raises(RuntimeError, match="unexpected precision"):
        va.precision_dtype("fp64")  # if this starts passing, run benchmarks/equivalence.py in float64
