"""Fault injection for the real stack, switched on by one environment variable and off by default.

Why:
1. A fault must hit the real component (the sandboxed tool process, the verifier program, the
   learner's gradient, the learner process itself, the checkpoint write) to show what the run does
   about it; a mock would only show what the mock does. So each hook sits at the one place where the
   component runs and changes what it runs, never how the surrounding code handles the outcome.
2. Faults are chosen by ``$THUNDERSYNC_FAULTS`` alone (never by editing code): every process of a run
   (the driver, Ray workers, reward and agent-loop workers) inherits it. Off, every hook is one
   module-level boolean test (``ACTIVE``): zero cost for a normal run.
3. The spec is ``name@key=value,key=value;name2@...``. Where a fault fires is counted per process, so a
   resumed run (a new process) counts again from 1:
       sandbox_kill@every=N    every N-th tool call's sandbox process is SIGKILLed while it runs
       verifier_raise@every=N  every N-th verifier program raises instead of checking
       verifier_hang@after=N   every verifier program after the N-th hangs (300 s; its timeout decides)
       nan_grad@batch=B,chunk=C  the C-th streamed backward of the B-th batch leaves a NaN in the gradient
       learner_kill@batch=B,chunk=C  the learner process SIGKILLs itself after that backward
       disk_full@step=S        the checkpoint of step S is written to a full disk (``/dev/full``: ENOSPC)
       push_fail@step=S        the first push of weight version S fails half-way: the learner sends half
                               of the tensors, then raises (the receiver must refuse the partial snapshot)
       rollout_kill@call=N     a rollout server process (``replay`` / ``hf_cpu`` policy replica) SIGKILLs
                               itself at its N-th generate call: the replica dies mid-batch
       teacher_hang@every=N    every N-th teacher request of an agent loop (OPD) never answers: the
                               per-attempt ``thundersync.opd.teacher_timeout_s`` must cut it and retry
       rollout_node_kill@call=N  at its N-th generate call a rollout server SIGKILLs the raylet of its
                               node (a lost machine: Ray ends every process of that node)
       learner_node_kill@batch=B,chunk=C  after that backward the learner SIGKILLs its node's raylet
   ``every``/``after``/``call`` count calls; ``batch``/``chunk``/``step`` name the place.
4. Every fault that fires appends one JSON line to ``$THUNDERSYNC_FAULTS_LOG`` (when set), so a
   benchmark counts what was injected across processes (``benchmarks/faults.py``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from thundersync_verl.core.errors import rule_message

ENV = "THUNDERSYNC_FAULTS"
LOG_ENV = "THUNDERSYNC_FAULTS_LOG"
FULL_DISK = "/dev/full"  # every write fails with ENOSPC, as on a full disk
KNOWN = {
    "sandbox_kill": ("every", "call", "after"),
    "verifier_raise": ("every", "call", "after"),
    "verifier_hang": ("every", "call", "after"),
    "nan_grad": ("batch", "chunk"),
    "learner_kill": ("batch", "chunk"),
    "disk_full": ("step",),
    "push_fail": ("step",),
    "rollout_kill": ("every", "call", "after"),
    "teacher_hang": ("every", "call", "after"),
    "rollout_node_kill": ("every", "call", "after"),
    "learner_node_kill": ("batch", "chunk"),
}
# Tool code that kills its own sandbox process: the sandbox sees SIGKILL, as from an OOM killer.
KILL_CODE = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
RAISE_CODE = "raise RuntimeError('verifier crashed (injected by THUNDERSYNC_FAULTS)')\n"
HANG_S = 300  # a hang: far past any step or teacher timeout, yet an orphan still ends
HANG_CODE = f"import time\ntime.sleep({HANG_S})\n"


class FaultSpecError(ValueError):
    """``$THUNDERSYNC_FAULTS`` names an unknown fault or key."""


@dataclass
class Fault:
    name: str
    where: dict[str, int]
    calls: int = 0  # calls of this fault's site seen in this process
    fired: int = 0


@dataclass
class FaultPlan:
    faults: dict[str, Fault] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str | None) -> "FaultPlan":
        plan = cls()
        for part in (p.strip() for p in (spec or "").split(";")):
            if not part:
                continue
            name, _, args = part.partition("@")
            if name not in KNOWN:
                raise FaultSpecError(rule_message(
                    f"{ENV}: unknown fault {name!r}", "a misspelt fault would silently inject nothing",
                    f"use one of {sorted(KNOWN)} (thundersync_verl/run/faults.py documents each)"))
            where = {}
            for item in (a for a in args.split(",") if a.strip()):
                key, _, value = item.partition("=")
                if key.strip() not in KNOWN[name] or not value.strip().isdigit():
                    raise FaultSpecError(rule_message(
                        f"{ENV}: {name} takes {', '.join(k + '=<int>' for k in KNOWN[name])}, got {item!r}",
                        "the keys say where the fault fires", f"write e.g. {name}@{KNOWN[name][0]}=1"))
                where[key.strip()] = int(value)
            plan.faults[name] = Fault(name, where)
        return plan


_PLAN = FaultPlan.parse(os.environ.get(ENV))
ACTIVE = bool(_PLAN.faults)  # the one test every hook makes when faults are off
_LOCK = threading.Lock()
_BATCH = {"batch": 0, "chunk": 0}  # learner-side place: this process's batch and chunk counters


def reload(spec: str | None = None) -> FaultPlan:
    """Re-read the plan (``spec``, else the environment); tests and benchmarks in one process use it."""
    global _PLAN, ACTIVE
    _PLAN = FaultPlan.parse(os.environ.get(ENV) if spec is None else spec)
    ACTIVE = bool(_PLAN.faults)
    _BATCH.update(batch=0, chunk=0)
    return _PLAN


def _count_call(name: str) -> bool:
    """One call of ``name``'s site: whether the fault fires on it (``every`` / ``call`` / ``after``)."""
    fault = _PLAN.faults.get(name)
    if fault is None:
        return False
    with _LOCK:
        fault.calls += 1
        n, w = fault.calls, fault.where
        fires = (("every" in w and w["every"] > 0 and n % w["every"] == 0) or ("call" in w and n == w["call"])
                 or ("after" in w and n > w["after"]))
        if fires:
            fault.fired += 1
    if fires:
        record(name, call=n)
    return fires


def _at_place(name: str, **place: int) -> bool:
    fault = _PLAN.faults.get(name)
    if fault is None or any(fault.where.get(k, v) != v for k, v in place.items()):
        return False
    fault.fired += 1
    record(name, **place)
    return True


def record(name: str, **detail) -> None:
    """One JSON line per fired fault to ``$THUNDERSYNC_FAULTS_LOG`` (one ``write``: lines never interleave)."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    line = json.dumps({"fault": name, "pid": os.getpid(), "t": time.time(), **detail}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_log(path: str | os.PathLike) -> list[dict]:
    """The fired faults a log holds (``record``), in order."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ----- hooks: each is called only when ACTIVE ---------------------------------------------------
def tool_code(code: str) -> str:
    """The code a tool call runs in its sandbox: ``sandbox_kill`` replaces it with one that is killed."""
    return KILL_CODE if _count_call("sandbox_kill") else code


def rollout_generate() -> None:
    """A rollout server's generate call: ``rollout_kill`` kills the replica's process here, ``rollout_node_kill``
    the raylet of its node."""
    if _count_call("rollout_kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    if _count_call("rollout_node_kill"):
        kill_node_of_this_process()


def kill_node_of_this_process() -> None:
    """SIGKILL this Ray worker's raylet (its parent process), then the worker: the node is lost, as when its machine
    fails (Ray then ends the node's other processes; this one must not run on after the place it was killed at)."""
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def teacher_hangs() -> bool:
    """An agent loop's teacher request: whether ``teacher_hang`` makes it never answer."""
    return _count_call("teacher_hang")


def verifier_program(program: str) -> str:
    """The verifier program: ``verifier_raise`` makes it crash, ``verifier_hang`` makes it never return."""
    if _count_call("verifier_hang"):
        return HANG_CODE
    return RAISE_CODE if _count_call("verifier_raise") else program


def after_backward(batch_state, params) -> None:
    """Learner, after a streamed backward: ``nan_grad`` poisons one gradient, ``learner_kill`` kills the process.

    ``batch_state`` identifies the open batch (a new object per ``stream_begin_batch``); ``params``
    are the learner's parameters, whose ``.grad`` hold the batch gradient.
    """
    if getattr(batch_state, "_fault_batch", None) is None:  # a batch not seen yet (ids are reused: mark it)
        _BATCH.update(batch=_BATCH["batch"] + 1, chunk=0)
        batch_state._fault_batch = _BATCH["batch"]
    _BATCH["chunk"] += 1
    place = {"batch": _BATCH["batch"], "chunk": _BATCH["chunk"]}
    if _at_place("nan_grad", **place):  # the batch gradient (a bucket could be folded with coefficient 0)
        import torch

        first = next(iter(params))
        if first.grad is None:
            first.grad = torch.zeros_like(first)  # as the learner's fold does before its first add
        _local(first.grad).view(-1)[0] = float("nan")
    if _at_place("learner_kill", **place):
        os.kill(os.getpid(), signal.SIGKILL)
    if _at_place("learner_node_kill", **place):
        kill_node_of_this_process()


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def checkpoint_disk(step: int) -> None:
    """Before a checkpoint of ``step`` is written: ``disk_full`` makes the write fail as a full disk does."""
    if _at_place("disk_full", step=int(step)):
        with open(FULL_DISK, "wb") as full:  # the kernel answers ENOSPC, as a full filesystem does
            full.write(b"\0" * (1 << 20))
            full.flush()


def push_cut(version) -> bool:
    """Before the learner sends weight version ``version``: whether ``push_fail`` cuts this push half-way
    (the first push of the named version only: the repeated push is what recovers)."""
    fault = _PLAN.faults.get("push_fail")
    return fault is not None and fault.fired == 0 and version is not None and _at_place("push_fail", step=int(version))
