"""Give the learner a core of its own: the closest a 2-core machine gets to a learner on its own device.

Why:
1. With the rollout's generation emulated (slept by the replay backend), what still competes for the
   CPU is the rollout SIDE (agent loop, tools, verifier, TransferQueue, Ray, the driver) and the
   learner. Unpinned, a learner running its backward takes both cores and slows the rollout side,
   which on a real cluster runs on host CPUs the GPU learner does not touch. Overlap then only moves
   CPU time around, whatever the mode.
2. ``LearnerPin`` runs the whole verl process tree on the rollout cores (``taskset`` at launch, so
   every process, torch's thread pools included, sizes itself to them) and moves each learner worker
   process (Ray's ``WorkerDict`` actor, every thread of it) to the learner cores as soon as it exists.
   torch inside the learner keeps the single thread it sized at start: one core, one thread.
   ``with_driver=True`` moves verl's trainer loop (the ``TaskRunner`` actor: it builds and dispatches
   every learner call, fetches rows from the TransferQueue) to the learner cores too: on a cluster it
   runs on the head node's own CPUs, not on the host cores that serve the agent loops and sandboxes.
   ``driver_nice`` (with ``with_driver``) runs every thread of the learner at nice 0 and every thread of the
   driver at ``driver_nice``: on the shared core the learner's compute then goes first and the driver takes
   the time the learner leaves, as a GPU learner's kernels never wait for the head node's CPU (the driver's
   own replies are what may wait). Without it both keep the nice Ray starts its workers' Python threads at
   (15): they share the core as equals, so the driver's work stretches the learner's calls.
3. Every mode of a comparison runs pinned the same way, so Sync's learner is the same device.
   Processes are recognised by an environment tag set on the launch, so other runs on the machine
   are never touched.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

LEARNER_TITLES = ("ray::WorkerDict",)  # verl's colocated actor/rollout/ref worker: the learner
DRIVER_TITLES = ("ray::TaskRunner",)  # verl's trainer loop: prepares and dispatches every learner call


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _tagged(pid: int, tag: bytes) -> bool:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return tag in f.read().split(b"\0")


def _pin(pid: int, cpus: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if os.sched_getaffinity(int(tid)) != cpus:
                os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # the thread ended


def _renice(pid: int, nice: int) -> int:
    """Every thread of ``pid`` at ``nice`` (Linux keeps a nice value per thread); returns the threads refused (raising
    a priority needs root or CAP_SYS_NICE)."""
    refused = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) != nice:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except PermissionError:
            refused += 1
        except OSError:
            pass  # the thread ended
    return refused


def cpu_ticks() -> dict[int, tuple[int, int]]:
    """Per CPU: (busy, total) clock ticks since boot, from ``/proc/stat`` (busy: all but idle and iowait)."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                name, *values = line.split()
                v = [int(x) for x in values]
                out[int(name[3:])] = (sum(v) - v[3] - v[4], sum(v))
    return out


def process_ticks() -> dict[int, tuple[str, int]]:
    """Per live process: (its title, user + system clock ticks so far). The title is the command line's first word
    without its folder (``raylet``), a Ray actor's class (``ray::WorkerDict``, whatever method it runs), or, for a
    Python interpreter, its script, its ``-m`` module, or ``python -c``."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            words = _cmdline(int(name)).split(b"\0")
        except OSError:
            continue  # gone, or not ours to read
        title = words[0].decode(errors="replace").split(" ")[0].rsplit("/", 1)[-1]
        title = title or stat[stat.find("(") + 1:stat.rfind(")")]  # a kernel thread has no command line
        if title.startswith("python") and len(words) > 1:  # the script or module, not the interpreter (python3.11)
            args = [w for w in words[1:] if w]
            if b"-c" in args:
                title = "python -c"  # a sandbox's guard or server: its source is not a name
            elif b"-m" in args and args.index(b"-m") + 1 < len(args):
                title = args[args.index(b"-m") + 1].decode(errors="replace")
            else:
                title = next((w.decode(errors="replace").rsplit("/", 1)[-1] for w in args if not w.startswith(b"-")), title)
        if title.startswith("ray::"):  # a Ray actor titles itself ray::Class.method while a method runs
            title = title.split(".", 1)[0]
        fields = stat[stat.rfind(")") + 2:].split()
        out[int(name)] = (title, int(fields[11]) + int(fields[12]))
    return out


class CoreLoad:
    """Every CPU's busy ticks, sampled in the background: which side of the pinned run was the busy one.

    ``busy_s(t0, t1)``: CPU seconds each core spent busy between two moments (nearest samples). It counts every
    process on the core, other jobs on the machine included, so it is read beside the load average.
    ``by_process_s(t0, t1)``: the same window's CPU seconds per process title (``process_ticks``, read every
    ``process_every`` samples: a read of every process costs a few ms). A process that started and ended between
    two reads (a sandbox's child) is not in it; one that started inside the window counts from zero."""

    def __init__(self, interval_s: float = 0.25, process_every: int = 4):
        self.interval_s, self.process_every = interval_s, process_every
        self.samples: list[tuple[float, dict[int, tuple[int, int]]]] = []
        self.process_samples: list[tuple[float, dict[int, tuple[str, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "CoreLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            if self.process_every and len(self.samples) % self.process_every == 0:
                self.process_samples.append((time.time(), process_ticks()))
            self.samples.append((time.time(), cpu_ticks()))
            if self._stop.wait(self.interval_s):
                return

    def busy_s(self, t0: float, t1: float) -> dict[int, float]:
        window = _window(self.samples, t0, t1)
        if window is None:
            return {}
        (a, b), hz = window, os.sysconf("SC_CLK_TCK")
        return {cpu: (b[cpu][0] - a[cpu][0]) / hz for cpu in b if cpu in a}

    def by_process_s(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds per process title between two moments (nearest process reads), largest first."""
        window = _window(self.process_samples, t0, t1)
        if window is None:
            return {}
        (a, b), hz = window, os.sysconf("SC_CLK_TCK")
        out: dict[str, float] = {}
        for pid, (title, ticks) in b.items():
            before = a.get(pid)
            used = ticks - (before[1] if before is not None else 0)  # a Ray worker renamed itself: still one process
            if used > 0:
                out[title] = out.get(title, 0.0) + used / hz
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _window(samples: list, t0: float, t1: float) -> tuple | None:
    """The readings nearest to ``t0`` and to ``t1`` of ``(time, reading)`` samples; None with no samples."""
    if not samples:
        return None
    return tuple(min(samples, key=lambda s, t=t: abs(s[0] - t))[1] for t in (t0, t1))


class LearnerPin:
    """Context for one verl run: ``prefix()`` goes before the command, ``env()`` into its environment."""

    def __init__(self, learner_cpus: set[int] | None = None, interval_s: float = 0.2, with_driver: bool = False,
                 driver_nice: int = 0):
        if driver_nice and not with_driver:
            raise ValueError("driver_nice only applies with with_driver=True (the driver on the learner's cores)")
        if not 0 <= driver_nice <= 19:
            raise ValueError(f"driver_nice must be 0..19 (a lower priority than the learner's), got {driver_nice}")
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise RuntimeError(f"pinning the learner needs 2+ CPUs; this process may use {cpus}")
        self.learner_cpus = set(learner_cpus or {cpus[-1]})
        self.rollout_cpus = set(cpus) - self.learner_cpus
        self.tag = f"THUNDERSYNC_PIN_TAG={uuid.uuid4().hex}"
        self.interval_s = interval_s
        self.titles = tuple(t.encode() for t in LEARNER_TITLES + (DRIVER_TITLES if with_driver else ()))
        self.with_driver = with_driver
        self.driver_nice = driver_nice
        self._driver_titles = tuple(t.encode() for t in DRIVER_TITLES)
        self.renice_refused = 0  # threads whose nice could not be set (describe() reports it)
        self.pinned: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.load = CoreLoad()  # the busy share of each side while the run goes

    def prefix(self) -> list[str]:
        return ["taskset", "-c", ",".join(map(str, sorted(self.rollout_cpus)))]

    def env(self) -> dict[str, str]:
        key, value = self.tag.split("=", 1)
        return {key: value}

    def describe(self) -> dict:
        return {"learner_cpus": sorted(self.learner_cpus), "rollout_side_cpus": sorted(self.rollout_cpus),
                "driver_on_learner_cpus": self.with_driver, "driver_nice": self.driver_nice,
                "learner_nice": 0 if self.driver_nice else "ray's", "renice_refused": self.renice_refused,
                "learner_processes_pinned": len(self.pinned)}

    def __enter__(self) -> "LearnerPin":
        self._thread.start()
        self.load.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.load.__exit__()

    def _loop(self) -> None:
        tag = self.tag.encode()
        while not self._stop.wait(self.interval_s if len(self.pinned) < len(self.titles) else 5 * self.interval_s):
            for name in os.listdir("/proc"):
                if not name.isdigit():
                    continue
                pid = int(name)
                try:
                    cmdline = _cmdline(pid)
                    if not cmdline.startswith(self.titles):
                        continue
                    if pid in self.pinned or _tagged(pid, tag):
                        _pin(pid, self.learner_cpus)
                        if self.driver_nice:
                            self.renice_refused += _renice(
                                pid, self.driver_nice if cmdline.startswith(self._driver_titles) else 0)
                        self.pinned.add(pid)
                except OSError:
                    continue  # gone, or not ours to read
