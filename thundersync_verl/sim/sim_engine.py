"""Discrete-event simulation of one RL pipeline mode over a sequence of steps.

Why this module exists:
1. The four pipelines differ only in WHEN the learner may train which trajectory and WHEN
   the rollout engines may start the next batch:
   - sync: all rollouts, all rewards, then the learner over the whole batch, then the
     optimizer and the weight push; the next batch starts on the new weights (staleness 0).
   - thundersync: same barrier, but each trajectory (GRPO) or turn (OPD) is trained as soon
     as its inputs are fixed (group granularity: when its group closes), under an open-group
     memory budget; one optimizer step after the last backward (staleness 0).
   - async (one-step off-policy): batch k+1 is generated on the old weights while the
     learner trains batch k; the weight push waits for both (staleness <= 1).
   - fully_async: see fully_async.py (streaming with a staleness gate, partial rollout).
2. A batch's trajectories are placed on rollout slots (all at once when slots suffice,
   otherwise earliest-free slot first); the learner is one lane (lane.py). Those events, the
   step recorder and the one-step-off schedule are events.py's, shared with shared.py.
3. Batch k comes from the source by index only, so every mode trains the same data.
4. `simulate` is the one entry point: it dispatches to fully_async.py (streaming), to
   verify_overlap.py (ThunderSync training trajectories before their reward lands), to
   shared.py (rollout and learner on the same cores) and to tail.py (ThunderSync with tail
   batching, mode thundersync_tail); none imports this module back.
"""

from __future__ import annotations

import numpy as np

from thundersync_verl.sim.sim_config import ALGOS, GRANULARITIES, MODES, TAIL_MODE, SimConfig
from thundersync_verl.sim.events import (Placement, Recorder, count_tokens, landing_delay, lane_policy, lane_work, one_step_off,
                     place_rollouts, reward_times)
from thundersync_verl.sim.fully_async import simulate_fully_async
from thundersync_verl.sim.hardware import LearnerCosts
from thundersync_verl.sim.host import bound_round
from thundersync_verl.sim.lane import LaneWork, run_lane
from thundersync_verl.sim.metrics import SimResult
from thundersync_verl.sim.sim_pace import simulate_pace
from thundersync_verl.sim.shared import simulate_shared
from thundersync_verl.sim.tail import simulate_tail
from thundersync_verl.sim.verify_overlap import simulate_verify_overlap
from thundersync_verl.sim.workload import Batch

# The run's config and the event helpers live in config.py and events.py; the simulator's users
# import them from here as well.
__all__ = ["ALGOS", "GRANULARITIES", "MODES", "Placement", "SimConfig", "landing_delay", "lane_policy", "lane_work",
           "one_step_off", "place_rollouts", "reward_times", "simulate"]


def simulate(cfg: SimConfig, source, costs: LearnerCosts) -> SimResult:
    """Run cfg.steps steps of cfg.mode on batches from `source` with learner `costs`."""
    cfg.validate(source.batch_size)
    if cfg.budget_groups is not None and cfg.budget_groups < 0:
        raise ValueError(f"budget_groups={cfg.budget_groups} must be >= 0 (0 = only closed groups, no buffers)")
    if cfg.mode == TAIL_MODE:
        return simulate_tail(cfg, source, costs)
    if cfg.mode == "fully_async":
        return simulate_fully_async(cfg, source, costs) if cfg.pace is None else simulate_pace(cfg, source, costs, cfg.pace)
    if cfg.verify_overlap:
        return simulate_verify_overlap(cfg, source, costs)
    if cfg.shared_cores is not None and cfg.shared_cores.active:
        return simulate_shared(cfg, source, costs)
    if cfg.mode == "async":
        return _one_step_off(cfg, source, costs)
    return _barrier(cfg, source, costs)


def _barrier(cfg: SimConfig, source, costs: LearnerCosts) -> SimResult:
    """sync and thundersync: rollout -> (streamed) learner -> optimizer -> weight push."""
    gran = cfg.resolved_granularity()
    policy = lane_policy(cfg, costs, gran)
    rec = Recorder(cfg)
    starts, ends, bounds = [], [], []
    t = 0.0
    for k in range(cfg.steps):
        batch = source.batch(k)
        place = place_rollouts(batch.dur_s, t, cfg.rollout_slots)
        if cfg.host is not None:  # the rollout hosts' CPUs (host.py)
            batch, place, _ = bound_round(cfg.host, batch, place, t, float(reward_times(batch, place, cfg.algo).max()),
                                          cfg.rollout_slots)
        work, computed = lane_work(batch, place, cfg.algo, gran, costs)
        run = run_lane(work, policy, t, record=cfg.record_timeline)
        t_opt = run.finish + costs.step_overhead_s + costs.optimizer_s
        t_end = t_opt + costs.weight_sync_s
        rec.learner_run(k, run, t_opt, t_opt, t_end, costs)
        rec.rollout(k, k, place, t, t_end)
        rec.trained(k, batch.size, k)
        count_tokens(rec, batch, run, computed)
        last = work.ready.max()
        tail = costs.chunk_overhead_s + work.cost[work.ready == last].max()
        bounds.append(last - t + tail + costs.step_overhead_s + costs.optimizer_s + costs.weight_sync_s)
        starts.append(t)
        ends.append(t_end)
        t = t_end + costs.step_gap_s
    return rec.result(cfg, starts, ends, {"step_lower_bound_s": np.asarray(bounds)})


def _one_step_off(cfg: SimConfig, source, costs: LearnerCosts) -> SimResult:
    """async on dedicated rollout engines: rollouts and learner run side by side without slowing each other."""
    policy = lane_policy(cfg, costs, "batch")

    def overlap(nxt: Batch, t_roll: float, work: LaneWork, t_learn: float):
        nxt_place = place_rollouts(nxt.dur_s, t_roll, cfg.rollout_slots)
        run = run_lane(work, policy, t_learn, record=cfg.record_timeline)
        t_opt = run.finish + costs.step_overhead_s + costs.optimizer_s
        return nxt_place, run, t_opt, nxt_place.done.max()

    return one_step_off(cfg, source, costs, lambda batch: place_rollouts(batch.dur_s, 0.0, cfg.rollout_slots), overlap)
