"""OPD at the published scale: what each of the product's row and teacher-call settings costs, simulated.

Why:
1. ``simulate_paper.py`` reproduces the published OPD step times under the published system's assumptions: a
   turn's backward keeps its prefix's graph (linear learner work) and the teacher scores only a turn's new tokens
   (a prefix-cached scorer). This project's learner recomputes the prefix for every turn row (exact, no kept
   graph: ``algos/opd/opd_stream.py``), and a serving engine asked for prompt log-probs scores the whole prefix
   (vLLM skips its prefix cache then). With ~30 turns a trajectory, both multiply the work per turn row.
2. On the calibrated paper setting (``sim/presets.paper_setting``: 8 B200, 32 x 8 trajectories, ~30B, SWE agent;
   no parameter depends on the mode), each OPD setting runs against Sync under the SAME teacher model:
   - ``turn_kept_graph``: per-turn rows, prefix graph kept (the published system; not what this project builds);
   - ``turn_recompute``: per-turn rows, prefix recomputed (``thundersync.opd.granularity: turn``, the default);
   - ``trajectory``: one row per trajectory as it lands (``granularity: trajectory``).
   Teacher models: ``cached`` (new tokens only) and ``prefix`` (each call scores its whole prefix; verl's one
   whole-trajectory call in Sync and with ``opd.teacher_calls: trajectory`` is the last turn's).
3. Figures per setting: step time, speed-up over Sync, the learner's computed tokens over Sync's
   (``learner_work_over_sync``: prefix recompute included), its utilisation, and the teacher's scored tokens a
   step over one whole-trajectory call each (``teacher_work_over_whole``; per-turn calls on the ``prefix``
   model). The simulator gives the teacher latency, not a teacher fleet's capacity: ``teacher_work_over_whole``
   says how much larger that fleet must be for per-turn calls to keep the modelled latency.
4. ``turns_sweep``: the same comparison (``prefix`` teacher) with the median turns per trajectory set to each of
   ``TURN_MEDIANS`` (the paper's is 30; the spread and every other parameter kept): how the per-turn rows'
   extra work grows with the agent's horizon.
Run: python benchmarks/simulate_opd_rows.py [--quick]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from thundersync_verl.run.results import add_results_dir_argument, write_result
from thundersync_verl.sim import presets
from thundersync_verl.sim.dists import lognormal
from thundersync_verl.sim.metrics import format_table
from thundersync_verl.sim.sim_engine import simulate
from thundersync_verl.sim.workload import SyntheticSource

SCRIPT = "simulate_opd_rows"
TEACHERS = {"cached": False, "prefix": True}  # RolloutSpec.teacher_prefix
TURN_MEDIANS = (3, 10, 30)
SETTINGS = {  # name -> (granularity, prefix recomputed by the learner)
    "turn_kept_graph": ("turn", False),
    "turn_recompute": ("turn", True),
    "trajectory": ("trajectory", False),
}


def teacher_tokens(source: SyntheticSource, steps: int) -> tuple[float, float]:
    """Mean per step of (tokens scored by one call per turn on its whole prefix, tokens of one whole-trajectory
    call per trajectory), over the batches the simulation draws."""
    per_turn, whole = [], []
    for step in range(steps):
        batch = source.batch(step)
        per_turn.append(float(batch.turn_hi.sum()))
        whole.append(float(batch.seq_tokens.sum()))
    return float(np.mean(per_turn)), float(np.mean(whole))


def run(steps: int, seed: int, teachers=tuple(TEACHERS), turns_median: float | None = None) -> dict:
    setting = presets.paper_setting(**({} if turns_median is None else
                                       {"turns": lognormal(turns_median, presets.PAPER_WORKLOAD.turns.sigma)}))
    out = {}
    for teacher in teachers:
        prefix = TEACHERS[teacher]
        source = SyntheticSource(setting.workload, replace(setting.rollout, teacher_prefix=prefix), seed=seed)
        sync = simulate(setting.sim_config("sync", "opd", steps), source, setting.costs)
        rows = {"sync": {"step_s": round(sync.step_time_s, 1), "learner_util": round(sync.learner_util, 3)}}
        for name, (granularity, recompute) in SETTINGS.items():
            costs = replace(setting.costs, prefix_recompute=recompute)
            res = simulate(setting.sim_config("thundersync", "opd", steps, granularity=granularity), source, costs)
            rows[name] = {"step_s": round(res.step_time_s, 1),
                          "speedup_vs_sync": round(sync.step_time_s / res.step_time_s, 3),
                          "learner_work_over_sync": round(res.compute_tokens / sync.compute_tokens, 2),
                          "learner_util": round(res.learner_util, 3)}
        out[teacher] = rows
    per_turn, whole = teacher_tokens(SyntheticSource(setting.workload, setting.rollout, seed=seed), min(steps, 50))
    out["teacher_work_over_whole"] = round(per_turn / whole, 2)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"100 steps instead of {presets.PAPER_STEPS}")
    ap.add_argument("--seed", type=int, default=0)
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    steps = 100 if args.quick else presets.PAPER_STEPS
    print(f"OPD on the calibrated paper setting, {steps} steps a run, seed {args.seed}:", flush=True)
    res = run(steps, args.seed)
    table = [[teacher, name, f'{r["step_s"]:.1f}', f'{r.get("speedup_vs_sync", 1.0):.3f}',
              f'{r.get("learner_work_over_sync", 1.0):.2f}', f'{r["learner_util"]:.3f}']
             for teacher in TEACHERS for name, r in res[teacher].items()]
    print(format_table(table, ["teacher", "setting", "step_s", "speedup_vs_sync", "learner_work_over_sync",
                               "learner_util"]))
    print(f"per-turn teacher calls on the whole prefix score {res['teacher_work_over_whole']}x the tokens of one "
          "whole-trajectory call per trajectory")
    sweep = {}
    for median in TURN_MEDIANS:
        rows = run(steps, args.seed, teachers=("prefix",), turns_median=median)["prefix"]
        sweep[str(median)] = {name: {k: rows[name][k] for k in ("speedup_vs_sync", "learner_work_over_sync")}
                              for name in ("turn_recompute", "trajectory")}
        print(f"median {median:>2} turns: per-turn rows {rows['turn_recompute']['speedup_vs_sync']:.3f}x Sync "
              f"(learner work {rows['turn_recompute']['learner_work_over_sync']:.2f}x), one row per trajectory "
              f"{rows['trajectory']['speedup_vs_sync']:.3f}x", flush=True)
    head = {"steps": steps, "seed": args.seed, **{f"{t}_{n}_speedup_vs_sync": res[t][n]["speedup_vs_sync"]
                                                  for t in TEACHERS for n in SETTINGS},
            "turn_recompute_learner_work_over_sync": res["prefix"]["turn_recompute"]["learner_work_over_sync"],
            "teacher_work_over_whole": res["teacher_work_over_whole"], "by_teacher": {t: res[t] for t in TEACHERS},
            "turns_sweep": sweep}
    write_result(SCRIPT + ("_quick" if args.quick else ""), head, args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
