"""``thundersync_harness.cpu_pin.LearnerPin(driver_nice=...)``: the driver behind the learner on their shared core."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from thundersync_harness.cpu_pin import LearnerPin

# a Ray worker's Python threads run at nice 15 (Ray's default); a second thread started after it inherits it
CHILD = "import os, threading, time\nos.nice(15)\nthreading.Thread(target=time.sleep, args=(30,)).start()\ntime.sleep(30)\n"


def _threads(pid: int) -> list[tuple[int, set[int]]]:
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    return [(os.getpriority(os.PRIO_PROCESS, t), os.sched_getaffinity(t)) for t in tids]


def _spawn(title: str, env: dict | None) -> subprocess.Popen:
    return subprocess.Popen([title, "-c", CHILD], executable=sys.executable, env={**os.environ, **(env or {})})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")
@pytest.mark.skipif(os.geteuid() != 0, reason="raising a thread's priority back to nice 0 needs root")
def test_driver_low_puts_the_learner_first_and_leaves_untagged_processes_alone():
    pin = LearnerPin(interval_s=0.05, with_driver=True, driver_nice=10)
    with pin:
        children = {"learner": _spawn("ray::WorkerDict", pin.env()), "driver": _spawn("ray::TaskRunnerV1.run", pin.env()),
                    "other run": _spawn("ray::WorkerDict", None)}
        try:
            deadline = time.time() + 10
            while time.time() < deadline and len(pin.pinned) < 2:
                time.sleep(0.05)
            time.sleep(0.3)  # one more pass: the second thread of each
            seen = {name: _threads(child.pid) for name, child in children.items()}
        finally:
            for child in children.values():
                child.kill()
                child.wait()
    assert pin.pinned == {children["learner"].pid, children["driver"].pid}, pin.pinned
    assert len(seen["learner"]) >= 2 and all(t == (0, pin.learner_cpus) for t in seen["learner"]), seen["learner"]
    assert len(seen["driver"]) >= 2 and all(t == (10, pin.learner_cpus) for t in seen["driver"]), seen["driver"]
    assert all(nice == 15 for nice, _ in seen["other run"]), seen["other run"]  # not this run's: untouched
    assert pin.describe()["driver_nice"] == 10 and pin.describe()["learner_nice"] == 0
    assert pin.describe()["renice_refused"] == 0


def test_driver_nice_without_the_driver_or_out_of_range_is_refused():
    with pytest.raises(ValueError, match="with_driver"):
        LearnerPin(driver_nice=10)
    with pytest.raises(ValueError, match="0..19"):
        LearnerPin(with_driver=True, driver_nice=-5)
