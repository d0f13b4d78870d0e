"""ForwardClock: a streamed call's forwards (model entry to loss), not its input preparation or backward."""

from __future__ import annotations

import math
import time

import torch

from thundersync_verl.learner.forward_clock import ForwardClock

FORWARD_S, PREP_S, BACKWARD_S = 0.03, 0.02, 0.02


class SlowModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        time.sleep(FORWARD_S)
        return self.linear(x)


def engine_call(model, loss_fn, micro_batches: int) -> None:
    """What verl's forward_backward does per micro-batch: prepare inputs, forward, loss, backward."""
    for _ in range(micro_batches):
        time.sleep(PREP_S)
        loss = loss_fn(model(torch.ones(2, 4)))
        loss.backward()
        time.sleep(BACKWARD_S)


def test_the_clock_sums_each_micro_batchs_forward_and_nothing_around_it():
    model, clock = SlowModel(), ForwardClock()
    clock.attach(model)
    clock.begin()
    engine_call(model, clock.wrap(lambda out: out.sum()), micro_batches=3)
    got = clock.seconds()
    assert 3 * FORWARD_S <= got < 3 * FORWARD_S + 0.04  # preparation and backward would add 0.12 s
    clock.begin()  # the next call starts from zero
    engine_call(model, clock.wrap(lambda out: out.sum()), micro_batches=1)
    assert FORWARD_S <= clock.seconds() < FORWARD_S + 0.03


def test_a_forward_that_reaches_no_loss_is_not_counted():
    model, clock = SlowModel(), ForwardClock()
    clock.attach(model)
    clock.begin()
    with torch.no_grad():
        model(torch.ones(2, 4))  # e.g. a log-prob forward of another call: never reaches the wrapped loss
    time.sleep(0.05)
    engine_call(model, clock.wrap(lambda out: out.sum()), micro_batches=1)
    assert FORWARD_S <= clock.seconds() < FORWARD_S + 0.03


def test_without_a_timed_module_the_call_reports_nan_and_the_loss_is_untouched():
    clock = ForwardClock()
    loss = lambda out: out.sum()  # noqa: E731
    assert clock.wrap(loss) is loss
    clock.begin()
    assert math.isnan(clock.seconds())
    model = SlowModel()
    clock.attach(model)
    clock.attach(None)  # e.g. a learner with pipeline stages: the hook goes away
    clock.begin()
    engine_call(model, loss, micro_batches=1)
    assert math.isnan(clock.seconds())
    assert not model._forward_pre_hooks
