"""What a finished emulated-device run's traces say (``emulated_rollout.py``'s comparison reads them): the rollout
side's pace, each side's CPU a step, the streaming bound of a Sync run's own timings, and the reporting's cost. Each
function takes the run dict that ``emulated_rollout.run_replay`` returns (``run_dir``, ``traj_path``, ``per_step``,
and the pinned run's ``core_load`` / ``pin``) and reads files only: no Ray, no verl."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def reporting_cost(run: dict) -> dict:
    """ThunderSync's reporting: seconds spent inside the step timer, and the drawing moved to the background."""
    def read(path: Path, key: str) -> list[float]:
        return [json.loads(x)[key] for x in open(path)] if path.is_file() else []

    in_step = read(run["run_dir"] / "report_cost.jsonl", "in_step_s")
    drawn = read(run["run_dir"] / "timelines" / "draw_cost.jsonl", "draw_s")
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
    return {"report_in_step_s": mean(in_step), "timeline_draw_cpu_s_moved": mean(drawn), "timelines_drawn": len(drawn),
            "timelines_drawn_after_run": len(run.get("drawn_after_run", []))}


def by_version(traj_path: Path) -> dict[int, list[dict]]:
    """A run's agent-loop trajectory records, grouped by the policy version that generated them."""
    versions: dict[int, list[dict]] = {}
    for raw in (json.loads(x) for x in open(traj_path)):
        versions.setdefault(int(raw.get("policy_version", 0)), []).append(raw)
    return versions


def _makespan(trajs: list[dict]) -> float:
    return max(t["t_done"] for t in trajs) - min(t["t_submit"] for t in trajs)


def version_makespans(traj_path: Path) -> dict[int, float]:
    """Seconds from each version's first submit to its last agent loop's end."""
    return {v: _makespan(ts) for v, ts in by_version(traj_path).items()}


def rollout_makespan(run: dict) -> dict[str, float] | None:
    """The rollout side's own pace, over the versions after the first (median): seconds from a version's first
    submit to its last agent loop's end, and the tool seconds its agent loops recorded. A mode whose learner or
    driver slows the rollout side's core (the emulated device shares the host: ``core_contention.py``) shows a
    longer makespan for the same replayed work; ``streaming_bound`` assumes Sync's."""
    if not run["traj_path"].is_file():
        return None
    versions = by_version(run["traj_path"])
    timed = [versions[v] for v in sorted(versions)[1:]] or list(versions.values())
    if not timed:
        return None
    span = [_makespan(ts) for ts in timed]
    tools = [sum(turn.get("tool_s", 0.0) for t in ts for turn in (t.get("turns") or [])) for ts in timed]
    return {"makespan_s": statistics.median(span), "tool_s": statistics.median(tools)}


def host_cpu(run: dict) -> dict | None:
    """CPU seconds per step on each side of the pinned run (``cpu_pin.CoreLoad``), over the steps after the first:
    from the first submit of the second version's trajectories to the first submit of the last version's; and the
    same per process (``by_process``, the largest ``TOP_PROCESSES``: which process the side's time went to)."""
    load, pin = run.get("core_load"), run.get("pin")
    if load is None or not run["traj_path"].is_file():
        return None
    submits = {v: min(t["t_submit"] for t in trajs) for v, trajs in by_version(run["traj_path"]).items()}
    versions = sorted(submits)
    if len(versions) < 3:
        return None
    first, last = versions[1], versions[-1]
    busy = load.busy_s(submits[first], submits[last])
    steps = last - first
    side = lambda cpus: round(sum(busy.get(c, 0.0) for c in cpus) / steps, 3)  # noqa: E731
    by_process = list(load.by_process_s(submits[first], submits[last]).items())[:TOP_PROCESSES]
    return {"rollout_side": side(pin["rollout_side_cpus"]), "learner_side": side(pin["learner_cpus"]),
            "step_s": round((submits[last] - submits[first]) / steps, 3),
            "by_process": {title: round(sec / steps, 3) for title, sec in by_process}}


TOP_PROCESSES = 12


def streaming_bound(run: dict, algo: str = "grpo") -> float | None:
    """The shortest step ANY zero-staleness stream could take on a Sync run's own timings: median over the steps
    after the first of ``max_k(a_k + (n - k) * w)``, row k landing at ``a_k`` and every row from k on still to
    back-propagate at Sync's own ``update_actor`` time per row ``w``. GRPO's rows are trajectories, landing at their
    agent loop's end; OPD's are agent turns, landing when the turn's generation ends (the trajectory's start plus the
    recorded generation and tool seconds before it: no teacher latency, which only lowers the bound), with Sync's
    ``update_actor`` shared equally among the turns. Landings are shifted so that the last trajectory ends at the end
    of Sync's ``gen`` (one verifier or teacher latency for all). No overhead of streaming, no optimizer step or
    weight push: Sync's step over it bounds every streamed speed-up from above."""
    versions = by_version(run["traj_path"])
    bounds = []
    for step in sorted(run["per_step"])[1:]:
        trajs, m = versions.get(step - 1), run["per_step"][step]  # Sync's step s trains on version s-1
        if not trajs or "timing_s/update_actor" not in m:
            continue
        s0 = min(t["t_submit"] for t in trajs)
        shift = m["timing_s/gen"] - max(t["t_done"] - s0 for t in trajs)
        rows = sorted(a - s0 for t in trajs for a in (turn_ends(t) if algo == "opd" else [t["t_done"]]))
        w = m["timing_s/update_actor"] / len(rows)
        bounds.append(max(a + shift + (len(rows) - k) * w for k, a in enumerate(rows)))
    return statistics.median(bounds) if bounds else None


def last_landing(run: dict, mode: str) -> dict[str, float] | None:
    """Where a step's end lies against its last landing, median over the steps after the first: seconds from the
    step's start to its last reward (``last_landing_s``) and from there to the step's end (``after_s``). A Sync
    run's last landing is its ``gen``'s end, as ``streaming_bound`` places it; a ThunderSync run's is the last reward
    its driver saw (its step record and trajectory records), so ``after_s`` is the stream's tail: the last rows'
    backward, the optimizer step and the weight push, which the bound leaves out."""
    steps = sorted(run["per_step"])[1:]
    if mode != "thundersync":
        timed = [run["per_step"][s] for s in steps if "timing_s/gen" in run["per_step"][s]]
        return {"last_landing_s": statistics.median(m["timing_s/gen"] for m in timed), "after_s": statistics.median(
            m["timing_s/step"] - m["timing_s/gen"] for m in timed)} if timed else None
    path = run["run_dir"] / "grpo_thundersync.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(x) for x in open(path)]
    landed, after = [], []
    for step in steps:
        st = next((r for r in records if r["kind"] == "step" and r["step"] == step and "t_end" in r), None)
        rewards = [r["t_reward"] for r in records if r["kind"] == "trajectory" and r["step"] == step]
        if st is not None and rewards:
            landed.append(max(rewards) - st["t_start"])
            after.append(st["t_end"] - max(rewards))
    return {"last_landing_s": statistics.median(landed), "after_s": statistics.median(after)} if landed else None


def turn_ends(traj: dict) -> list[float]:
    """When each agent turn's generation ended (an agent-loop trace record: its start, then per turn ``gen_s`` and
    the ``tool_s`` that followed it); the trajectory's end for a record without turns."""
    ends, t = [], traj["t_submit"]
    for turn in traj.get("turns") or []:
        t += turn["gen_s"]
        ends.append(min(t, traj["t_done"]))
        t += turn.get("tool_s", 0.0)
    return ends or [traj["t_done"]]
