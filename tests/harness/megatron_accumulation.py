"""An experiment on the Megatron streamed step: the batch gradient summed in float64 across streamed calls.

Why:
1. The Megatron streamed step sums its chunks, folds and the deferred normaliser in the fp32 grad
   buffer: per element, one rounding per streamed call, two per fold (product, sum) and one for the
   scale. verl's own update rounds per micro-batch in the same buffer. ``Float64SumLearner`` moves the
   stream's summation out of fp32: after every direct call the buffer is added to a float64 copy and
   zeroed, a fold adds ``coef * bucket`` in float64, and the barrier writes ``scale * sum`` back to
   the buffer with ONE rounding before Megatron's finalize and step. Each chunk's own backward is
   unchanged (fp32, as verl's).
2. What it tells: how much of the streamed step's distance to verl's update (over the noise floor)
   comes from summing the streamed pieces in fp32, rather than from the per-row rounding inside each
   backward (a row's gradient seeded with A_i or 1 instead of verl's fl(A_i / N)).
3. Not sharded (no distributed optimizer): a bucket then is the whole local buffer, as the fold needs.
"""

from __future__ import annotations

import contextlib

import torch


def _learner_class():
    from thundersync_verl.backends.megatron import grads as mg
    from thundersync_verl.learner.engines.megatron import MegatronLearner

    class Float64SumLearner(MegatronLearner):
        """``MegatronLearner`` whose batch gradient lives in a float64 copy between streamed calls."""

        name = "megatron_fp64_sum"

        def begin_batch(self) -> None:
            super().begin_batch()
            if self._sharded():
                raise RuntimeError("the float64-sum experiment runs without the distributed optimizer")
            self._sum = [torch.zeros_like(b, dtype=torch.float64) for b in mg.grad_buffers(self._chunks())]

        def forward_backward(self, run):
            with mg.no_finalize(self._chunks()):
                output = run()
            if not self._isolating:  # move the direct call's gradient out of the fp32 buffer
                for acc, b in zip(self._sum, mg.grad_buffers(self._chunks())):
                    acc.add_(b.double())
                    b.zero_()
            return output

        @contextlib.contextmanager
        def isolated(self):
            buffers = mg.grad_buffers(self._chunks())  # zero here: the direct gradient is in the float64 sum
            self._isolating = True
            try:
                yield
            finally:
                self._isolating = False
                for b in buffers:
                    b.zero_()

        def fold(self, bucket, coef: float) -> None:
            for acc, b in zip(self._sum, bucket):
                acc.add_(b.double(), alpha=float(coef))

        def finalize(self, scale: float, lr_step: bool = True) -> dict:
            for acc, b in zip(self._sum, mg.grad_buffers(self._chunks())):
                b.copy_(acc * float(scale))  # one rounding to fp32
            self._sum = None
            return super().finalize(1.0, lr_step)  # x 1.0 is exact; then Megatron's finalize and step as usual

    return Float64SumLearner


def probe_worker_class():
    """The streaming worker plus ``probe_float64_sum(on)``: on, its learner is ``Float64SumLearner``."""
    from thundersync_verl.learner.streaming_worker import Dispatch, StreamingActorWorker, register

    class Float64SumProbeWorker(StreamingActorWorker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def probe_float64_sum(self, on: bool) -> None:
            self._ts_learner = _learner_class()(self) if on else None

    return Float64SumProbeWorker


def start_probe_workers(config, world: int):
    """ray.init with ``world`` device slots, then a group of ``Float64SumProbeWorker`` (one per rank)."""
    from thundersync_harness.engine_setup import start_group

    return start_group(probe_worker_class(), config.actor_rollout_ref, world)
