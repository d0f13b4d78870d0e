"""The engine-specific half of the streaming learner, behind one small interface.

Why:
1. The streaming worker (``learner/streaming_worker.py``) owns the protocol: batches, buckets in
   a ``BufferPool``, folds, checks, tickets. What differs between verl's engines is only where
   the gradient lives and how one step is finalised: FSDP2 accumulates into ``p.grad`` (DTensor
   shards, reduced at every backward); Megatron accumulates into the DDP grad buffer
   (``main_grad``) and reduces once, in ``finalize_model_grads``. ``StreamLearner`` is that
   difference, and nothing else.
2. The contract every implementation keeps (the equivalence tests check it on the real engines):
   - ``gradient()`` lists the local tensors that hold this rank's share of the batch gradient;
     a bucket is a copy of ``bucket_gradient()`` (the same tensors, or a smaller shard of them);
   - ``isolated()`` sets the accumulated (direct) gradient aside and gives it back on exit, so
     a bucket backward sees a zero gradient and the direct gradient is untouched by it;
   - ``forward_backward(run)`` runs one streamed call: the gradient accumulates, nothing is
     reduced, normalised or zeroed (the step's normaliser is deferred to ``finalize``);
   - ``fold(bucket, coef)`` adds ``coef * bucket`` where ``bucket_gradient`` was read;
   - ``finalize(scale)`` multiplies the gradient by the deferred scale, reduces it ONCE across
     ranks as the engine's own step would, clips the grad norm and steps as verl's engine does,
     steps the LR scheduler and zeroes the gradient.
3. Implementations are chosen by verl's own engine key (``actor.strategy``: ``fsdp``/``fsdp2``
   or ``megatron``, what ``model_engine`` selects) in ``learners.make_learner``.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Callable, Iterator

import torch

from thundersync_verl.core import GradLayout


class StreamLearner(abc.ABC):
    """One rank's view of its engine's gradient and step, as the streaming worker needs it."""

    name = "base"

    def __init__(self, worker):
        self.worker = worker

    # ----- batch lifecycle -------------------------------------------------------------------
    @abc.abstractmethod
    def begin_batch(self) -> None:
        """Check the engine can stream (rule/why/fix errors) and zero the gradient."""

    @abc.abstractmethod
    def bucket_layout(self) -> GradLayout:
        """Shapes of the tensors ``bucket_gradient`` returns (what one bucket costs)."""

    # ----- streamed calls --------------------------------------------------------------------
    @abc.abstractmethod
    def forward_backward(self, run: Callable[[], object]):
        """``run()`` (the worker's forward_backward call) as a streamed call; returns its output."""

    @abc.abstractmethod
    @contextlib.contextmanager
    def isolated(self) -> Iterator[None]:
        """Inside: the gradient holds only what runs inside. On exit: the direct gradient is back."""

    @abc.abstractmethod
    def bucket_gradient(self) -> list[torch.Tensor | None]:
        """The gradient accumulated inside ``isolated()``, in bucket layout (valid until it exits)."""

    @abc.abstractmethod
    def fold(self, bucket: list[torch.Tensor], coef: float) -> None:
        """gradient += coef * bucket, where ``bucket_gradient`` was read."""

    # ----- the barrier -----------------------------------------------------------------------
    @abc.abstractmethod
    def finalize(self, scale: float, lr_step: bool = True) -> dict:
        """gradient *= scale, one reduction, clip, optimizer step, LR step (unless ``lr_step`` is False: a
        mini-batch step before the batch's last), zero: ``{grad_norm, lr}``."""

    def timed_module(self):
        """The module whose entry starts a micro-batch's forward (``forward_clock.py``); None: not timed."""
        return None

    # ----- equivalence checks ----------------------------------------------------------------
    @abc.abstractmethod
    def flat_params(self) -> torch.Tensor:
        """Every parameter of the model, flattened to one float64 CPU vector (a collective)."""

    def applied_gradient(self) -> torch.Tensor | None:
        """The gradient the last optimizer step applied (after the engine's clip), laid out as ``flat_params``:
        an update compared before fp32 parameter storage rounds it. The first call arms the recording (a full
        float64 copy of the gradient at every step: equivalence checks only) and returns None; None where the
        engine records nothing."""
        return None
