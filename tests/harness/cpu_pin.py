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
3. Every mode of a comparison runs pinned the same way, so Sync's learner is the same device.
   Processes are recognised by an environment tag set on the launch, so other runs on the machine
   are never touched.
"""

from __future__ import annotations

import os
import threading
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


class LearnerPin:
    """Context for one verl run: ``prefix()`` goes before the command, ``env()`` into its environment."""

    def __init__(self, learner_cpus: set[int] | None = None, interval_s: float = 0.2, with_driver: bool = False):
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise RuntimeError(f"pinning the learner needs 2+ CPUs; this process may use {cpus}")
        self.learner_cpus = set(learner_cpus or {cpus[-1]})
        self.rollout_cpus = set(cpus) - self.learner_cpus
        self.tag = f"THUNDERSYNC_PIN_TAG={uuid.uuid4().hex}"
        self.interval_s = interval_s
        self.titles = tuple(t.encode() for t in LEARNER_TITLES + (DRIVER_TITLES if with_driver else ()))
        self.with_driver = with_driver
        self.pinned: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def prefix(self) -> list[str]:
        return ["taskset", "-c", ",".join(map(str, sorted(self.rollout_cpus)))]

    def env(self) -> dict[str, str]:
        key, value = self.tag.split("=", 1)
        return {key: value}

    def describe(self) -> dict:
        return {"learner_cpus": sorted(self.learner_cpus), "rollout_side_cpus": sorted(self.rollout_cpus),
                "driver_on_learner_cpus": self.with_driver,
                "learner_processes_pinned": len(self.pinned)}

    def __enter__(self) -> "LearnerPin":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        tag = self.tag.encode()
        while not self._stop.wait(self.interval_s if len(self.pinned) < len(self.titles) else 5 * self.interval_s):
            for name in os.listdir("/proc"):
                if not name.isdigit():
                    continue
                pid = int(name)
                try:
                    if not _cmdline(pid).startswith(self.titles):
                        continue
                    if pid in self.pinned or _tagged(pid, tag):
                        _pin(pid, self.learner_cpus)
                        self.pinned.add(pid)
                except OSError:
                    continue  # gone, or not ours to read
