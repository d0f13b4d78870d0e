"""``thundersync_harness.cpu_pin.CoreLoad``: the per-core busy seconds the emulated-device benchmark reports."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from thundersync_harness.cpu_pin import CoreLoad, cpu_ticks, process_ticks


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


def test_per_process_seconds_name_the_process_that_did_the_work(tmp_path):
    # one process spends 0.8 s of CPU, then idles, still alive at the window's end (an exited one is not read);
    # the window closes once it has spent them, however long a loaded machine takes to give them
    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.8:\n    pass\ntime.sleep(300)\n"
    with CoreLoad(interval_s=0.05, process_every=1) as load:
        time.sleep(0.2)
        t0 = time.time()
        script = tmp_path / f"spinner_{os.getpid()}.py"  # a title no other process on the machine has
        script.write_text(code)
        child = subprocess.Popen([sys.executable, str(script)])
        try:
            while _cpu_s(child.pid) < 0.8:  # a real wait on the condition (the test's timeout guards a hang)
                time.sleep(0.05)
            time.sleep(0.2)  # one more sample after it
            t1 = time.time()
            time.sleep(0.2)
        finally:
            child.kill()
            child.wait()
    by = load.by_process_s(t0, t1)
    assert 0.4 <= by.get(script.name, 0.0) <= (t1 - t0) + 0.2, by
    assert list(by.values()) == sorted(by.values(), reverse=True), by


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_process_titles_name_scripts_modules_and_ray_actors():
    sleep = "import time; time.sleep(30)"
    children = {
        "ray::Learner": subprocess.Popen(["ray::Learner.update_actor", "-c", sleep], executable=sys.executable),
        "timeit": subprocess.Popen([sys.executable, "-m", "timeit", "-n", "1", "-r", "1", "import time; time.sleep(30)"]),
        "python -c": subprocess.Popen([sys.executable, "-c", sleep]),
    }
    try:
        time.sleep(0.3)
        ticks = process_ticks()
    finally:
        for child in children.values():
            child.kill()
            child.wait()
    for want, child in children.items():  # a Ray actor's running method is not part of its name
        assert ticks[child.pid][0] == want, ticks[child.pid]
    title, used = ticks[os.getpid()]
    assert used >= 0 and title and "/" not in title, ticks[os.getpid()]
    assert CoreLoad().by_process_s(0.0, 1.0) == {}
