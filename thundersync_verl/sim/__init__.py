"""Trace-driven discrete-event simulator and planner for RL post-training pipelines.

Why this package exists:
1. Users run 8 to thousands of GPUs; a simulator shows what streaming the backward passes
   (ThunderSync) buys against sync, one-step-off async and fully-async pipelines at any
   scale, and checks scheduler decisions (granularity, accumulator memory budget).
2. It is validated against recorded traces of real runs (trace.py) and calibrated on the
   published ThunderSyncRL figures with physical, sourced parameters (presets.py).
3. It depends on numpy, matplotlib and the standard library only, so it runs anywhere.
"""

from thundersync_verl.sim.sim_config import ALGOS, ALL_MODES, GRANULARITIES, MODES, TAIL_MODE, SimConfig
from thundersync_verl.sim.dists import Dist, const, lognormal, mixture, pareto
from thundersync_verl.sim.sim_engine import simulate
from thundersync_verl.sim.hardware import ClusterSpec, GpuSpec, LearnerCosts, ModelSpec, SharedCores
from thundersync_verl.sim.metrics import SimResult, comparison_table
from thundersync_verl.sim.prompts import PromptSource
from thundersync_verl.sim.trace import TraceSource, fit_learner_costs, load_trace, measured_step_time, replay, replay_config
from thundersync_verl.sim.workload import Batch, RolloutSpec, SyntheticSource, WorkloadSpec

__all__ = [
    "ALGOS", "ALL_MODES", "Batch", "ClusterSpec", "Dist", "GRANULARITIES", "GpuSpec", "LearnerCosts", "MODES",
    "ModelSpec", "PromptSource", "RolloutSpec", "SharedCores", "SimConfig", "SimResult", "SyntheticSource", "TAIL_MODE",
    "TraceSource", "WorkloadSpec",
    "comparison_table", "const", "fit_learner_costs", "load_trace", "lognormal", "measured_step_time", "mixture",
    "pareto", "replay", "replay_config", "simulate",
]
