"""Per-step utilisation timeline: rollout slots above, learner lanes below, idle time hatched.

1. Input is plain event records (seconds on one clock): trajectories with their generation
   and tool intervals and the moment the reward landed, and learner operations. The same
   records feed the simulator, so what is drawn is what was measured.
2. Trajectories are packed onto slots greedily (a slot holds one trajectory at a time), the
   way a rollout engine with N concurrent sequences is drawn in utilisation figures.
3. Drawing is reporting, not training: a PNG costs about a second of CPU, and a step timer must
   not pay it. ``TimelineDrawer`` writes each step's records to a job file and hands its path to
   one niced child process (``python -m thundersync_verl.run.timeline``) that draws in the
   background. The child logs each drawing's CPU seconds to ``draw_cost.jsonl`` beside the PNGs,
   so the cost that moved off the step stays measured. A child draws at most ``JOBS_PER_CHILD``
   PNGs, then finishes its queue and exits while a fresh one takes the next jobs: one long-lived
   matplotlib process grew by 76 MB over 129 steps of a 10-minute soak (``benchmarks/soak.py``).
4. That log line is also the "finished" signal: ``TimelineFeed`` reads it to hand each finished
   PNG, once, to verl's loggers (tensorboard, wandb) as an image, never a half-written file.
5. Low priority has to cover the autogroup: the child starts its own session (to outlive a killed
   trainer), and where the kernel groups sessions (``kernel.sched_autogroup_enabled=1``, the default
   of many distributions) the CPU is shared between autogroups first, so ``nice 19`` alone left the
   drawer about 40% of a core taken from the process beside it (measured: a busy loop kept 59% of its
   core beside a niced child in another session, 96% once the child's autogroup was niced too). On the
   emulated-device runs that process is the learner; on a cluster it is the trainer loop.
6. Even niced, drawing is not free where the trainer loop's core is busy: on the emulated device (learner
   and trainer loop on one core) a ThunderSync step took 6.83 s drawing every step and 6.35 s drawing none
   (two runs each, interleaved), the drawer adding ~1.4 CPU-s per step to that core. So
   ``thundersync.timeline_every`` sets the cadence (0: never), and ``draw_trace`` draws any step from the
   trace afterwards: the traces are written every step.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterable

OP_COLOURS = {"backward": "#2b8cbe", "fold": "#7bccc4", "optimizer": "#e34a33", "weight_sync": "#fdbb84",
              "forward": "#a6bddb", "critic_update": "#756bb1", "other": "#bdbdbd"}


def pack_slots(trajectories: list[dict]) -> list[int]:
    """Greedy slot assignment by start time; returns the slot index of each trajectory."""
    order = sorted(range(len(trajectories)), key=lambda i: trajectories[i]["t_submit"])
    slot_free: list[float] = []
    slots = [0] * len(trajectories)
    for i in order:
        t0, t1 = trajectories[i]["t_submit"], trajectories[i]["t_done"]
        for s, free_at in enumerate(slot_free):
            if free_at <= t0:
                slots[i], slot_free[s] = s, t1
                break
        else:
            slots[i] = len(slot_free)
            slot_free.append(t1)
    return slots


def busy_fraction(ops: Iterable[dict], t_start: float, t_end: float) -> float:
    """Share of [t_start, t_end] covered by learner operations (overlaps merged)."""
    spans = sorted((max(o["t0"], t_start), min(o["t1"], t_end)) for o in ops if o["t1"] > t_start and o["t0"] < t_end)
    covered, cursor = 0.0, t_start
    for a, b in spans:
        a = max(a, cursor)
        if b > a:
            covered += b - a
            cursor = b
    return covered / max(t_end - t_start, 1e-9)


def draw_timeline(trajectories: list[dict], ops: list[dict], t_start: float, t_end: float, png: str | Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    slots = pack_slots(trajectories)
    n_slots = max(slots, default=-1) + 1
    fig, ax = plt.subplots(figsize=(10, 0.25 * n_slots + 2.2))
    for traj, slot in zip(trajectories, slots):
        y = 1.5 + slot
        cursor = traj["t_submit"]
        for turn in traj.get("turns", []):
            ax.barh(y, turn["gen_s"], left=cursor - t_start, height=0.8, color="#74c476")
            cursor += turn["gen_s"]
            if turn.get("tool_s", 0) > 0:
                ax.barh(y, turn["tool_s"], left=cursor - t_start, height=0.8, color="#fee391")
                cursor += turn["tool_s"]
        if traj.get("t_reward") is not None:
            ax.plot([traj["t_reward"] - t_start], [y], marker="|", color="k", markersize=8)
    ax.barh(0, t_end - t_start, left=0, height=0.8, color="white", edgecolor="#969696", hatch="///")  # idle
    for op in ops:
        ax.barh(0, op["t1"] - op["t0"], left=op["t0"] - t_start, height=0.8, color=OP_COLOURS.get(op["op"], "#bdbdbd"))
    busy = busy_fraction(ops, t_start, t_end)
    ax.set_yticks([0] + [1.5 + s for s in range(n_slots)], ["learner"] + [f"slot {s}" for s in range(n_slots)], fontsize=7)
    ax.set_xlabel("seconds since step start")
    ax.set_title(f"{title}  (learner busy {busy:.0%})")
    handles = [Patch(color="#74c476", label="generate"), Patch(color="#fee391", label="tool"),
               Patch(facecolor="white", edgecolor="#969696", hatch="///", label="learner idle")]
    handles += [Patch(color=c, label=k) for k, c in OP_COLOURS.items() if any(o["op"] == k for o in ops)]
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=3)
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def step_png(folder: str | Path, mode: str, step: int) -> tuple[Path, str]:
    """One step's timeline PNG path and title (the drawer during a run and ``draw_trace`` after it name them alike)."""
    return Path(folder) / f"{mode}_step{step:03d}.png", f"{mode} step {step}"


def draw_trace(trace: str | Path, out_dir: str | Path) -> list[Path]:
    """Every finished step's timeline from an event trace (``StepRecorder``'s JSONL, read and checked by the
    simulator's ``load_trace``), drawn after the run into ``out_dir``: what ``thundersync.timeline_every=0`` left
    undrawn. A step without its step record (the run ended inside it) is skipped."""
    from thundersync_verl.sim.trace import load_trace

    loaded = load_trace(trace)
    drawn = []
    for meta in sorted(loaded.steps, key=lambda r: r["step"]):
        n = meta["step"]
        png, title = step_png(out_dir, meta["mode"], n)
        drawn.append(draw_timeline([t for t in loaded.trajectories if t["step"] == n],
                                   [o for o in loaded.learner if o["step"] == n], meta["t_start"], meta["t_end"], png, title))
    return drawn


# ----- drawing off the step (point 3) -------------------------------------------------------
DRAW_COST_FILE = "draw_cost.jsonl"  # one {"png", "draw_s"} line per drawing, beside the PNGs
JOBS_PER_CHILD = 20  # drawings per child process (point 3): its memory stays that of a fresh one


class TimelineDrawer:
    """Draws timeline PNGs in a niced child process. ``submit`` writes the step's records to a job file beside
    the PNG (milliseconds) and hands the child its path, one short line: a killed trainer loses no drawing."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._jobs = 0  # handed to the current child
        self._retired: list[subprocess.Popen] = []  # finishing their queues

    def submit(self, trajectories: list[dict], ops: list[dict], t_start: float, t_end: float, png: str | Path,
               title: str, step: int | None = None) -> None:
        png = Path(png)
        png.parent.mkdir(parents=True, exist_ok=True)
        job = png.with_suffix(".job.json")
        job.write_text(json.dumps({"trajectories": trajectories, "ops": ops, "t_start": t_start, "t_end": t_end,
                                   "png": str(png), "title": title, "step": step}))
        if self._proc is not None and self._jobs >= JOBS_PER_CHILD:
            self._retire()
        if self._proc is None:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, text=True,
                                          start_new_session=True)  # outlives a killed trainer long enough to finish
            self._jobs = 0
        self._jobs += 1
        try:
            self._proc.stdin.write(str(job) + "\n")  # far below the pipe's buffer: never blocks
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._proc = None  # the child died: this drawing is left as its job file; training is not affected

    def _retire(self) -> None:
        """End the current child's input: it draws what it was given, then exits (reaped by a later call)."""
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        self._retired = [p for p in self._retired if p.poll() is None] + [self._proc]
        self._proc = None

    def close(self, timeout_s: float = 120.0) -> None:
        """Wait (at most ``timeout_s`` in all) for the children to draw every job handed to them."""
        if self._proc is not None:
            self._retire()
        deadline = time.time() + timeout_s
        for proc in self._retired:
            try:
                proc.wait(max(deadline - time.time(), 0.0))
            except subprocess.TimeoutExpired:
                pass  # still drawing: it exits on its own once its queue is empty
        self._retired = []


def low_priority() -> None:
    """Lowest CPU priority for this process: its nice AND its autogroup's (point 5). Either may be refused."""
    try:
        os.nice(19)
    except OSError:
        pass
    try:
        with open("/proc/self/autogroup", "w") as f:  # Linux with CONFIG_SCHED_AUTOGROUP; absent elsewhere
            f.write("19")
    except OSError:
        pass


def _serve(stream) -> int:
    """The child: read every job as it comes (a reader thread), draw them one by one at low priority."""
    low_priority()
    jobs: queue.Queue = queue.Queue()

    def read() -> None:
        for line in stream:
            if line.strip():
                jobs.put(Path(line.strip()))
        jobs.put(None)

    threading.Thread(target=read, daemon=True).start()
    while (path := jobs.get()) is not None:
        t0 = time.process_time()
        job = json.loads(path.read_text())
        png = draw_timeline(job["trajectories"], job["ops"], job["t_start"], job["t_end"], job["png"], job["title"])
        path.unlink()
        with open(png.parent / DRAW_COST_FILE, "a") as f:
            f.write(json.dumps({"png": png.name, "step": job.get("step"), "draw_s": time.process_time() - t0}) + "\n")
    return 0


class TimelineFeed:
    """The timeline PNGs the drawer has finished (``draw_cost.jsonl`` lines), each returned once by ``new()``."""

    def __init__(self, timelines_dir: str | Path):
        self.dir = Path(timelines_dir)
        self._seen: set[str] = set()

    def new(self) -> list[tuple[int | None, Path]]:
        """``(step, png)`` for every drawing finished since the last call, in the order they were drawn."""
        cost = self.dir / DRAW_COST_FILE
        if not cost.is_file():
            return []
        text = cost.read_text()
        out = []
        for line in text[: text.rfind("\n") + 1].splitlines():  # a line still being written waits for the next call
            record = json.loads(line) if line.strip() else None
            if record is not None and record["png"] not in self._seen:
                self._seen.add(record["png"])
                out.append((record.get("step"), self.dir / record["png"]))
        return out


if __name__ == "__main__":
    sys.exit(_serve(sys.stdin))
