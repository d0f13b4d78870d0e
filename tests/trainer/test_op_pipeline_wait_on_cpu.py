"""``OpPipeline.wait``: the driver's pause between two listings ends when the learner's oldest call finishes.

Real Ray (one local CPU): a queued call is a remote task that takes a known time; nothing is mocked but the
worker group around it (its ``*_queued`` method hands back the task's object ref, as verl's non-blocking call does).
"""

from __future__ import annotations

import time

import pytest
import ray

from thundersync_verl.trainer.stream_exec import OpPipeline
from thundersync_verl.trainer.stream_plan import FoldOp

pytestmark = pytest.mark.slow


@ray.remote
def _learner_call(seconds: float) -> dict:
    time.sleep(seconds)
    return {}


class _Group:
    """A worker group of one rank whose fold call takes ``seconds`` on a Ray worker."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def stream_fold_queued(self, folds, seq):
        return [_learner_call.remote(self.seconds)]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_pause_ends_when_the_oldest_call_finishes_and_sleeps_in_full_with_none_in_flight(local_ray):
    ray.get(_learner_call.remote(0.0))  # the worker is up before anything is timed
    done = []
    pipe = OpPipeline(_Group(0.3), pad_token_id=0, temperature=1.0, depth=2, on_done=lambda *a: done.append(a))
    pipe.submit(FoldOp("g", {"b": 1.0}), {})
    t0 = time.time()
    pipe.wait(10.0)
    woke = time.time() - t0
    assert 0.2 < woke < 3.0, f"woke after {woke:.2f}s: the call takes 0.3s, the pause was 10s"
    pipe.collect()
    assert len(done) == 1 and pipe.in_flight == 0  # the finished call is handed back at once
    t0 = time.time()
    pipe.wait(0.2)
    assert time.time() - t0 >= 0.19  # nothing in flight: a plain pause
