"""Tail batching with the rollout on its own (emulated) device: ``modes.py --rollout emulated --modes
thundersync,thundersync_tail``.

Why:
1. ``thundersync_tail`` is ThunderSync with tail batching on (``thundersync.tail.eta`` = ``TAIL_ETA``, the other
   tail keys at their defaults): each round launches ceil(eta x P) prompt groups, trains the first P to complete and
   aborts the rest, whose prompts run again in a later round. It replays the same recording as every other mode with
   ``engine_kwargs.replay.repeat=true``: a deferred prompt's new group is served its recorded answers again, tokens
   and service times alike. So a re-run here is the first run again (a long prompt stays exactly as long); on real
   engines a re-run is a new sample of the prompt, which the simulator's synthetic study models
   (``sim/prompts.py`` point 1). What this pair measures is the policy's machinery and its cost in verl (the wider
   launch sharing the rollout slots, the aborts, the deferred rounds), and whether the simulator predicts it.
2. The recording must hold every prompt the tail run draws: about eta x steps batches of fresh prompts, so with
   this mode in the run the recording holds ``recording_steps`` steps (the other modes use its first part; a
   recording is keyed by its step count, so it is made once per size).
3. The simulator's prediction, made from the plain ThunderSync run of the same repeat (never from the tail run):
   ``sim/trace.replay`` fits the learner's costs and the calibration on that run's trace; the same recorded prompts
   then run through the simulator's tail policy (``sim/prompts.RecordedPrompts``: a re-run is the recorded group
   again, as the replay serves it) for the same number of steps at the same eta, deferral bound and round kind.
   Predicted speed-up = simulated plain step over simulated tail step, each the mean over the steps after the
   first, as the measured one (``modes.summarise``; a round of queued long prompts is one step in eight, which a
   median would leave out). Both are simulated without the shared-core slowdown (the tail policy is simulated on
   dedicated devices; dropping it moves the plain replay of the committed paper trace by 0.02%).
4. The rollout side's host CPUs: the slot model alone gives every trajectory its recorded durations, while the
   agent loops, tools and verifier share the rollout side's core(s), which the wider launch and the rounds of
   queued long prompts load beyond the plain run. With the plain run's per-core accounting (pinned runs), the
   prediction bounds each round by that CPU (``sim/host.py``: the plain run's rollout-side CPU-seconds per turn,
   the turns each simulated round starts); the slot model's own prediction is kept beside it
   (``sim_prediction_slots_only``), and ``plain_prediction_rel_err`` says how the bounded model replays the plain
   run it was fitted on.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from pathlib import Path

TAIL_MODE = "thundersync_tail"
TAIL_ETA = 1.25
TAIL_MAX_DEFERRALS = 2  # thundersync.tail.max_deferrals' default
TAIL_ROUNDS = "dedicated"  # thundersync.tail.rounds' default
REPLAY = "+actor_rollout_ref.rollout.engine_kwargs.replay"
FIGURES = ("launched", "kept", "dropped", "pinned", "queue", "deferred_kept_share", "delay_steps_mean",
           "delay_steps_max", "tq_keys_cleared")


def overrides() -> list[str]:
    """The tail mode's settings on top of plain ThunderSync (point 1)."""
    return [f"thundersync.tail.eta={TAIL_ETA}", f"{REPLAY}.repeat=true"]


def recording_steps(steps: int, modes_run: list[str]) -> int:
    """Steps the recording must hold (point 2): two more than the runs (the async modes generate ahead), times eta
    when the tail mode runs."""
    return math.ceil((steps + 2) * TAIL_ETA) if TAIL_MODE in modes_run else steps + 2


def tail_figures(run: dict) -> dict:
    """The tail policy's own metrics per step (``thundersync/tail/*``) over the whole run, and the totals: shares and
    delays are over the trained groups (each step's figure weighted by the groups it kept)."""
    steps = [run["per_step"][s] for s in sorted(run["per_step"])]
    per_step = {k: [float(m.get(f"thundersync/tail/{k}", 0.0)) for m in steps] for k in FIGURES}
    kept = sum(per_step["kept"])
    over_kept = lambda k: sum(x * n for x, n in zip(per_step[k], per_step["kept"])) / max(kept, 1)  # noqa: E731
    return {"per_step": per_step, "launched_groups": sum(per_step["launched"]),
            "aborted_groups": sum(per_step["dropped"]), "trained_groups": kept,
            "aborted_groups_per_step": round(sum(per_step["dropped"]) / max(len(steps), 1), 3),
            "deferred_prompt_share": round(over_kept("deferred_kept_share"), 4),
            "delay_steps_mean": round(over_kept("delay_steps_mean"), 3),
            "delay_steps_max": int(max(per_step["delay_steps_max"], default=0)),
            "queue_at_end": int(per_step["queue"][-1]) if steps else 0}


def _mean_after_first(times) -> float:
    times = list(times)
    return statistics.fmean(times[1:] if len(times) > 1 else times)


def host_model(trace_path: Path, host_cpu: dict | None, cores: int):
    """The rollout hosts' CPU cost per turn (``sim/host.py``, point 4 above) from the plain run: its rollout side's
    CPU-seconds a step over the turns a step its trace shows, over the same steps (``emulated_trace.host_cpu``:
    the versions after the first, the last excluded). None without the per-core accounting."""
    from thundersync_verl.sim.host import HostCpu
    from thundersync_verl.sim.trace import load_trace

    if not host_cpu or host_cpu.get("rollout_side") is None or cores < 1:
        return None
    turns: dict[int, int] = {}
    for rec in load_trace(trace_path).trajectories:
        turns[rec["policy_version"]] = turns.get(rec["policy_version"], 0) + len(rec["turns"])
    window = sorted(turns)[1:-1]
    if not window:
        return None
    return HostCpu.fit(host_cpu["rollout_side"], sum(turns[v] for v in window) / len(window), cores)


def predict_speedup(trace_path: Path, host=None) -> dict:
    """The simulator's tail-over-plain speed-up from the plain ThunderSync trace alone (point 3), over as many steps
    as it recorded (the tail run's); with ``host`` (``sim.host.HostCpu``) each round bounded by the rollout hosts'
    CPUs (point 4)."""
    from thundersync_verl.sim.prompts import RecordedPrompts
    from thundersync_verl.sim.sim_engine import simulate
    from thundersync_verl.sim.trace import load_trace, replay

    cfg, source, costs = replay(load_trace(trace_path))
    cfg = replace(cfg, shared_cores=None, host=host)
    plain = simulate(cfg, source, costs)
    tail = simulate(replace(cfg, mode=TAIL_MODE, tail_eta=TAIL_ETA, tail_max_deferrals=TAIL_MAX_DEFERRALS,
                            tail_rounds=TAIL_ROUNDS), RecordedPrompts(source), costs)
    plain_s, tail_s = _mean_after_first(plain.step_times), _mean_after_first(tail.step_times)
    summary = tail.extra["tail"]
    out = {"plain_step_s": round(plain_s, 3), "tail_step_s": round(tail_s, 3),
           "tail_speedup_vs_thundersync": round(plain_s / tail_s, 3),
           "deferred_prompt_share": None if not summary else round(summary["deferred_prompt_share"], 4)}
    if host is not None:
        out["host_cpu_s_per_turn"] = round(host.cpu_s_per_turn, 5)
        out["host_cores"] = host.cores
    return out


def headline(rows: dict, runs: dict) -> dict:
    """The pair's figures: measured speed-up, the simulator's prediction of it and its relative error."""
    if TAIL_MODE not in rows:
        return {}
    out = {"tail": tail_figures(runs[TAIL_MODE]), "tail_settings": {
        "eta": TAIL_ETA, "max_deferrals": TAIL_MAX_DEFERRALS, "rounds": TAIL_ROUNDS, "replay_repeat": True}}
    if "thundersync" not in rows:
        return out
    measured = rows["thundersync"]["step_time_s"] / rows[TAIL_MODE]["step_time_s"]
    trace = runs["thundersync"]["run_dir"] / "grpo_thundersync.jsonl"
    pin = runs["thundersync"].get("pin") or {}
    host = host_model(trace, rows["thundersync"].get("host_cpu_s_per_step"), len(pin.get("rollout_side_cpus", ())))
    slots_only = predict_speedup(trace)
    predicted = predict_speedup(trace, host) if host is not None else slots_only
    out.update(tail_speedup_vs_thundersync=round(measured, 3), sim_prediction=predicted,
               tail_speedup_predicted=predicted["tail_speedup_vs_thundersync"],
               prediction_rel_err=round(predicted["tail_speedup_vs_thundersync"] / measured - 1.0, 4),
               plain_prediction_rel_err=round(predicted["plain_step_s"] / rows["thundersync"]["step_time_s"] - 1.0, 4),
               prediction_host_bound=host is not None, sim_prediction_slots_only=slots_only,
               prediction_rel_err_slots_only=round(slots_only["tail_speedup_vs_thundersync"] / measured - 1.0, 4))
    return out
