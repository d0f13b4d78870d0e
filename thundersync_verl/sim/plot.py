"""Pictures of a simulation: utilisation timelines and scale-out curves.

Why this module exists:
1. A timeline shows at a glance where each pipeline idles: rollout slots on top (one row
   per slot, busy bars coloured by batch, idle hatched), the learner lane below (compute,
   optimizer, weight push, idle hatched). One panel per mode over the same number of steps.
2. The scale-out figure puts every mode's speedup over Sync and ThunderSync's accumulator
   memory per rank against the budget, for each model size and tail shape; the tail study's
   figure puts each mode's step time against the GPU count, per model, tail and batch.
3. matplotlib runs headless (Agg) so the figures render on any CI machine.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

LEARNER_COLORS = {"compute": "#2b6cb0", "optimizer": "#dd6b20", "weight_sync": "#c53030"}
BATCH_COLORS = ("#38a169", "#68d391")


def _window(res, first: int, n_steps: int) -> tuple[float, float]:
    first = min(first, len(res.step_end) - 1)
    last = min(first + n_steps, len(res.step_end)) - 1
    return float(res.step_start[first]), float(res.step_end[last])


def _draw_rollout(ax, res, a: float, b: float, max_rows: int) -> None:
    slots = res.ledger.slots
    stride = max(1, -(-slots // max_rows))
    rows = list(range(0, slots, stride))
    row_of = {s: r for r, s in enumerate(rows)}
    for r in range(len(rows)):
        ax.add_patch(Rectangle((a, r), b - a, 0.9, facecolor="white", edgecolor="#a0aec0", hatch="///", lw=0))
    for entry in res.timeline["rollout"]:
        slot, t0, t1, batch = entry[0], entry[1], entry[2], entry[3]
        if slot in row_of and t1 > a and t0 < b:
            ax.add_patch(Rectangle((max(t0, a), row_of[slot]), min(t1, b) - max(t0, a), 0.9,
                                   facecolor=BATCH_COLORS[batch % 2], lw=0))
    ax.set_ylim(0, len(rows))
    ax.set_ylabel(f"rollout slots\n(every {stride})" if stride > 1 else "rollout slots")
    ax.set_yticks([])


def _draw_learner(ax, res, a: float, b: float) -> None:
    ax.add_patch(Rectangle((a, 0), b - a, 0.9, facecolor="white", edgecolor="#a0aec0", hatch="///", lw=0))
    for t0, t1, kind, _tokens in res.timeline["learner"]:
        if kind in LEARNER_COLORS and t1 > a and t0 < b:
            ax.add_patch(Rectangle((max(t0, a), 0), min(t1, b) - max(t0, a), 0.9,
                                   facecolor=LEARNER_COLORS[kind], lw=0))
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_ylabel("learner")


def plot_timelines(results: list, path, n_steps: int = 3, first_step: int = 1, max_rows: int = 64) -> str:
    """One (rollout, learner) panel pair per result; results need record_timeline=True."""
    missing = [r.mode for r in results if r.timeline is None]
    if missing:
        raise ValueError(f"results for {missing} have no timeline; simulate with record_timeline=True to plot them")
    fig, axes = plt.subplots(2 * len(results), 1, figsize=(12, 2.6 * len(results)), sharex=False,
                             gridspec_kw={"height_ratios": [3, 0.6] * len(results)})
    for k, res in enumerate(results):
        a, b = _window(res, first_step, n_steps)
        top, bottom = axes[2 * k], axes[2 * k + 1]
        _draw_rollout(top, res, a, b, max_rows)
        _draw_learner(bottom, res, a, b)
        for ax in (top, bottom):
            ax.set_xlim(a, b)
        top.set_title(f"{res.mode} ({res.algo}, {res.granularity}): {res.step_time_s:,.0f} s/step, "
                      f"learner {100 * res.learner_util:.0f}% busy, rollout {100 * res.rollout_util:.0f}% busy",
                      fontsize=9, loc="left")
        bottom.set_xlabel("time (s)", fontsize=8)
    handles = [Patch(facecolor=c, label=k) for k, c in LEARNER_COLORS.items()]
    handles += [Patch(facecolor=BATCH_COLORS[0], label="rollout busy"),
                Patch(facecolor="white", edgecolor="#a0aec0", hatch="///", label="idle")]
    fig.legend(handles=handles, loc="upper center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_scale(rows: list[dict], path) -> str:
    """rows: {gpus, model, tail, mode, speedup, accum_gb_per_rank, unbounded_gb_per_rank, budget_gb_per_rank}.

    One speedup panel per (model, tail), modes as lines; a last panel with ThunderSync's
    accumulator memory per rank (under the budget, and unbounded) against the budget.
    """
    combos = sorted({(r["model"], r["tail"]) for r in rows})
    modes = [m for m in ("sync", "async", "fully_async", "thundersync") if any(r["mode"] == m for r in rows)]
    fig, axes = plt.subplots(1, len(combos) + 1, figsize=(3.6 * (len(combos) + 1), 3.8))
    for ax, (model, tail) in zip(axes, combos):
        for mi, mode in enumerate(modes):
            sel = sorted((r for r in rows if (r["model"], r["tail"], r["mode"]) == (model, tail, mode)),
                         key=lambda r: r["gpus"])
            ax.plot([r["gpus"] for r in sel], [r["speedup"] for r in sel], marker="o", color=f"C{mi}", label=mode)
        ax.set_title(f"{model}, {tail} turns", fontsize=9)
        ax.set_ylabel("speedup over Sync")
    mem = axes[-1]
    for ci, (model, tail) in enumerate(combos):
        ts = sorted((r for r in rows if (r["model"], r["tail"], r["mode"]) == (model, tail, "thundersync")),
                    key=lambda r: r["gpus"])
        g = [r["gpus"] for r in ts]
        mem.plot(g, [r["accum_gb_per_rank"] for r in ts], marker="o", color=f"C{ci}", label=f"{model}/{tail}")
        mem.plot(g, [r["unbounded_gb_per_rank"] for r in ts], ls=":", color=f"C{ci}")
    budget = sorted({(r["gpus"], r["budget_gb_per_rank"]) for r in rows})
    mem.plot([b[0] for b in budget], [b[1] for b in budget], color="black", lw=2, alpha=0.5, label="budget")
    mem.set_yscale("log")
    mem.set_title("accumulators per rank (dotted: unbounded)", fontsize=9)
    mem.set_ylabel("GB per learner rank")
    gpus = sorted({r["gpus"] for r in rows})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlim(gpus[0] / 1.5, gpus[-1] * 1.5)
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_step_times(rows: list[dict], path, batches=(64, 8)) -> str:
    """rows: {gpus, model, tail, batch_per_gpu, mode, step_s, staleness_max}; one panel per (model, tail).

    Step time against GPUs, one colour per mode, one line style per batch per rollout GPU (the
    tail study, benchmarks/simulate_tail.py); the legend gives each mode's largest staleness.
    """
    styles = dict(zip(batches, ("-", "--", ":", "-.")))
    combos = sorted({(r["model"], r["tail"]) for r in rows})
    modes = [m for m in ("sync", "async", "fully_async", "thundersync", "thundersync_tail", "sync_tail")
             if any(r["mode"] == m for r in rows)]
    cols = min(len(combos), 2)
    nrows = -(-len(combos) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.0 * cols, 4.4 * nrows), squeeze=False)
    for ax, (model, tail) in zip(axes.ravel(), combos):
        for mi, mode in enumerate(modes):
            for b, style in styles.items():
                sel = sorted((r for r in rows if (r["model"], r["tail"], r["batch_per_gpu"], r["mode"]) ==
                              (model, tail, b, mode)), key=lambda r: r["gpus"])
                if not sel:
                    continue
                stale = max(r["staleness_max"] for r in rows if r["mode"] == mode)
                ax.plot([r["gpus"] for r in sel], [r["step_s"] for r in sel], marker="o", ls=style, color=f"C{mi}",
                        label=f"{mode} (staleness <= {stale})" if b == batches[0] else None)
        for b, style in styles.items():
            ax.plot([], [], ls=style, color="black", label=f"{b} per rollout GPU")
        ax.set_title(f"{model}, {tail} turns: batch = b x GPUs / 2 trajectories", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs (learner + rollout, split chosen per mode)", fontsize=8)
        ax.set_ylabel("step time (s)")
        ax.grid(alpha=0.3, which="both")
    for ax in axes.ravel()[len(combos):]:
        ax.set_visible(False)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.12 / nrows, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
