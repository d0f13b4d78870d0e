"""How long a streamed call's forwards took: from entering the model to its loss, per micro-batch.

Why:
1. A streamed call is verl's forward_backward over its micro-batches, forward and backward in one
   engine call, so the call's duration alone cannot say what its forwards cost. The learner
   records carry this measurement (``forward_s``); the simulator reports it beside its price of a
   separate old-log-prob forward (verl's Sync as configured, one-step-off Async, Fully Async), which
   it does not replace: verl's own forward calls take 1.3-2x these forwards, their host work lying
   outside the model (``sim/transfer.py``, point 3).
2. A micro-batch's forward starts when the model's top module is entered (a forward pre-hook) and
   ends when the loss function is called (the worker's loss, wrapped): the model forward and verl's
   log-probs from its logits. Input preparation before the model and the backward are not counted.
   A call that runs two forward_backwards (policy loss and independent KL/entropy terms apart)
   counts both.
3. A learner names the module (``StreamLearner.timed_module``); under pipeline parallelism a stage's
   forwards and backwards interleave across micro-batches, so none is named and the call reports
   NaN (not measured).
4. On an accelerator the host runs ahead of the kernels: each end is a timing event on the device's
   stream, read once the call is over (unverified until the GPU check has run).
"""

from __future__ import annotations

import math
import time

import torch


class ForwardClock:
    """Sums (loss called - model entered) over the micro-batches of one call (``begin`` .. ``seconds``)."""

    def __init__(self):
        self._module = None
        self._handle = None
        self._cuda = False
        self._open = None
        self._spans: list = []

    def attach(self, module) -> None:
        """Time forwards of ``module`` (None: stop timing). Re-attaching the same module is free."""
        if module is self._module:
            return
        if self._handle is not None:
            self._handle.remove()
        self._module, self._handle = module, None
        if module is not None:
            self._handle = module.register_forward_pre_hook(self._entered)
            first = next(module.parameters(), None)
            self._cuda = first is not None and first.is_cuda

    def begin(self) -> None:
        self._open, self._spans = None, []

    def wrap(self, loss_fn):
        """``loss_fn`` that closes the forward opened by the model's entry before it computes the loss."""
        if loss_fn is None or self._module is None:
            return loss_fn

        def timed(*args, **kwargs):
            if self._open is not None:
                self._spans.append((self._open, self._mark()))
                self._open = None
            return loss_fn(*args, **kwargs)

        return timed

    def seconds(self) -> float:
        """The forwards of the call since ``begin``; NaN when no module is timed or no forward reached a loss."""
        if self._module is None or not self._spans:
            return float("nan")
        if self._cuda:
            self._spans[-1][1].synchronize()
            return sum(a.elapsed_time(b) for a, b in self._spans) / 1000.0
        return math.fsum(b - a for a, b in self._spans)

    def _entered(self, module, args) -> None:
        self._open = self._mark()

    def _mark(self):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()
