"""``thundersync_harness.cpu_pin.CoreLoad``: the per-core busy seconds the emulated-device benchmark reports."""

from __future__ import annotations

import os
import time

from thundersync_harness.cpu_pin import CoreLoad, cpu_ticks


def test_busy_seconds_of_a_core_kept_busy_count_that_work():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    before = os.sched_getaffinity(0)
    with CoreLoad(interval_s=0.05) as load:
        time.sleep(0.2)
        t0 = time.time()
        os.sched_setaffinity(0, {cpu})
        try:
            while time.time() - t0 < 0.8:  # one core busy for 0.8 s
                pass
        finally:
            os.sched_setaffinity(0, before)
        t1 = time.time()
        time.sleep(0.2)
    busy = load.busy_s(t0, t1)
    assert set(busy) == set(cpu_ticks()), busy
    assert 0.5 <= busy[cpu] <= (t1 - t0) + 0.2, busy  # other jobs on the machine may add, never past the window


def test_an_unsampled_load_reports_nothing():
    assert CoreLoad().busy_s(0.0, 1.0) == {}
