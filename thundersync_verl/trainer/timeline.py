"""Per-step utilisation timeline: rollout slots above, learner lanes below, idle time hatched.

1. Input is plain event records (seconds on one clock): trajectories with their generation
   and tool intervals and the moment the reward landed, and learner operations. The same
   records feed the simulator, so what is drawn is what was measured.
2. Trajectories are packed onto slots greedily (a slot holds one trajectory at a time), the
   way a rollout engine with N concurrent sequences is drawn in utilisation figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

OP_COLOURS = {"backward": "#2b8cbe", "fold": "#7bccc4", "optimizer": "#e34a33", "weight_sync": "#fdbb84",
              "forward": "#a6bddb", "other": "#bdbdbd"}


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
