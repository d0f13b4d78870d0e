"""The synthetic run the sim calibration and replay tests share: one workload, rollout and learner costs,
its trace records as the trainers write them, and those records as an in-memory trace."""

from __future__ import annotations

from thundersync_verl.sim.dists import const, lognormal
from thundersync_verl.sim.sim_engine import SimConfig
from thundersync_verl.sim.hardware import LearnerCosts
from thundersync_verl.sim.trace import Trace
from thundersync_verl.sim.tracegen import trace_records
from thundersync_verl.sim.workload import RolloutSpec, SyntheticSource, WorkloadSpec

WORK = WorkloadSpec(groups_per_step=4, group_size=4, turns=lognormal(3, 0.6), prompt_tokens=const(64),
                    gen_tokens=lognormal(40, 0.5), obs_tokens=lognormal(30, 0.5), tool_s=lognormal(0.2, 0.5),
                    reward_s=const(0.7))
ROLL = RolloutSpec(slots=16, decode_s_per_token=0.004, prefill_s_per_token=1e-4, teacher_fixed_s=0.05,
                   teacher_s_per_token=1e-4)
COSTS = LearnerCosts(s_per_token=2e-4, chunk_overhead_s=0.05, optimizer_s=0.3, weight_sync_s=0.2)


def records(mode, algo="grpo", costs=COSTS, steps=8, **kw) -> list[dict]:
    cfg = SimConfig(mode=mode, algo=algo, steps=steps, rollout_slots=16, min_chunk=1, **kw)
    return trace_records(cfg, SyntheticSource(WORK, ROLL, seed=4), costs)


def as_trace(recs) -> Trace:
    kinds = {"trajectory": [], "learner": [], "step": []}
    for r in recs:
        kinds[r["kind"]].append(r)
    return Trace("mem", kinds["trajectory"], kinds["learner"], kinds["step"])
