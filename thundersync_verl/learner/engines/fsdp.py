"""The streaming learner on verl's FSDP/FSDP2 engine: the gradient is ``p.grad`` (local DTensor shards).

Why:
1. FSDP2 reduce-scatters every backward into the sharded ``p.grad``, and its loss is multiplied by
   ``dp_size`` (``stream_loss.py``), so each call's contribution is already the SUM over ranks: a
   streamed call is verl's plain forward_backward with ``zero_grad_on_exit=False``.
2. A bucket backward sets ``p.grad`` aside by reference (no copy), lets the chunk's gradient land
   in fresh ``.grad`` tensors, reads them, and puts the direct gradient back.
3. ``finalize`` scales the shards, then runs verl's engine step inside its train mode with
   ``zero_grad_on_exit=True``: the engine clips the full batch gradient and steps exactly as in
   verl's own ``update_actor``.
4. Only trainable parameters carry a gradient: with LoRA (``model.lora_rank > 0``) the frozen base
   weights never get a ``.grad``, so buckets, folds and the deferred scale cover the adapter's
   parameters alone (a bucket costs the adapter's size, not the model's); ``flat_params`` still
   lists every parameter, so an update is compared on the whole model.
5. ``applied_gradient`` (equivalence checks): a pre-step hook on verl's optimizer copies the clipped gradient as
   the step applies it. A parameter near 1 (a norm weight) is stored to 1.2e-7, so one rounding flip of one
   element moves a 0.04-norm update by 3e-6 relative: the update's gap then measures storage, not the gradient.
"""

from __future__ import annotations

import contextlib

import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import GradLayout
from thundersync_verl.core.buffers import axpy_
from thundersync_verl.learner.engines.base import StreamLearner


class FSDPLearner(StreamLearner):
    name = "fsdp"

    def __init__(self, worker):
        super().__init__(worker)
        self._stash: list | None = None
        self._recorded_optimizer = None  # point 5
        self._applied: torch.Tensor | None = None

    def _engine(self):
        return va.actor_engine(self.worker)

    def _params(self) -> list[torch.Tensor]:
        """The parameters that carry a gradient (point 4)."""
        return [p for p in va.actor_parameters(self._engine()) if p.requires_grad]

    def timed_module(self):
        return self._engine().module

    def begin_batch(self) -> None:
        self._engine().optimizer_zero_grad()
        self._stash = None

    def bucket_layout(self) -> GradLayout:
        return GradLayout.from_tensors([va.local_view(p) for p in self._params()])

    def forward_backward(self, run):
        return run()

    @contextlib.contextmanager
    def isolated(self):
        params = self._params()
        self._stash = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            for p, g in zip(params, self._stash):
                p.grad = g
            self._stash = None

    def bucket_gradient(self):
        return [None if p.grad is None else va.local_view(p.grad) for p in self._params()]

    def fold(self, bucket, coef: float) -> None:
        params = self._params()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        axpy_([va.local_view(p.grad) for p in params], bucket, coef)

    def finalize(self, scale: float, lr_step: bool = True) -> dict:
        engine = self._engine()
        grads = [va.local_view(p.grad) for p in self._params() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale)
        with engine.train_mode(zero_grad_on_exit=True):
            grad_norm = engine.optimizer_step()  # clips the full batch gradient, steps (skips if non-finite)
        lr = engine.lr_scheduler_step() if lr_step else float("nan")  # mini-batch steps before the last: no LR step
        return {"grad_norm": float(grad_norm), "lr": float(lr)}

    def flat_params(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([_full_flat(p) for p in va.actor_parameters(self._engine())])

    def applied_gradient(self) -> torch.Tensor | None:
        optimizer = self._engine().optimizer
        if self._recorded_optimizer is not optimizer:  # armed once per optimizer (reset_actor builds a new one)
            optimizer.register_step_pre_hook(self._record_step)
            self._recorded_optimizer, self._applied = optimizer, None
        return self._applied

    def _record_step(self, *_) -> None:
        """Every rank steps at once, so the all-gather of each shard is a collective all ranks reach."""
        with torch.no_grad():
            self._applied = torch.cat([torch.zeros(p.numel(), dtype=torch.float64) if p.grad is None else _full_flat(p.grad)
                                       for p in va.actor_parameters(self._engine())])


def _full_flat(tensor) -> torch.Tensor:
    """The all-gathered value of a (DTensor) shard as one float64 CPU vector (a collective)."""
    return va.full_tensor(tensor).detach().reshape(-1).to("cpu", torch.float64)
