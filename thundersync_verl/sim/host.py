"""The rollout hosts' CPUs: a round's rollout cannot end before the hosts have done its agent-loop work.

Why this module exists:
1. Agent loops, tool sandboxes, the verifier and the serving front end run on the rollout side's host
   CPUs. The slot model (`events.place_rollouts`) gives every trajectory its recorded durations, whatever
   else runs beside it. A policy that runs more turns in a round than the recorded run did (tail batching's
   wider launch, and its rounds of queued long prompts) can saturate those CPUs, and then everything they
   touch slows down. Measured on the emulated device (the rollout side on one core): a round of queued
   prompts ran 2.3x the turns of a plain round, its tool calls 55% slower per turn, and the round took
   19 s where the slot model gave 12 s.
2. The model is a throughput bound with one constant: each turn (one generate call with what follows it
   on the host: the tool call, the agent loop's bookkeeping, its share of the reward) costs the hosts
   `cpu_s_per_turn` CPU-seconds. A round's rollout phase (its start to the last landing it waits for) lasts
   at least the CPU-seconds of the turns that started in it over the host cores. When the slot schedule is
   shorter, the round's rollout timeline is stretched by the ratio, uniformly (processor sharing slows every
   host activity alike), which keeps the order of starts and landings: the same groups complete first.
3. `HostCpu.fit` takes the constant from a measured run: the rollout side's CPU-seconds a step (per-core
   accounting, `benchmarks/emulated_trace.host_cpu`) over the turns that run's trace shows a step. The
   recorded run itself then stays as the slot model replays it, apart from its busiest rounds.
4. Applied in the barrier schedules (sync, thundersync) and the tail policy (`tail.py`); the other
   schedules refuse it (`SimConfig.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from thundersync_verl.sim.events import Placement, place_rollouts
from thundersync_verl.sim.workload import Batch

_TIMES = ("dur_s", "reward_s", "last_score_s", "turn_end_s", "turn_score_s", "turn_gen_s", "turn_tool_s", "land_s")


@dataclass(frozen=True)
class HostCpu:
    cpu_s_per_turn: float  # host CPU-seconds each turn costs (point 2)
    cores: float = 1.0  # host cores the rollout side's agent loops, tools and verifier share

    def __post_init__(self) -> None:
        if not self.cpu_s_per_turn >= 0 or not self.cores > 0:
            raise ValueError(f"HostCpu(cpu_s_per_turn={self.cpu_s_per_turn}, cores={self.cores}): the CPU-seconds "
                             "per turn must be >= 0 and the host cores > 0")

    @classmethod
    def fit(cls, cpu_s_per_step: float, turns_per_step: float, cores: float) -> "HostCpu":
        """The constant from a measured run (point 3)."""
        if not turns_per_step > 0:
            raise ValueError(f"turns_per_step={turns_per_step}: a run with no turns cannot give a CPU cost per turn")
        return cls(cpu_s_per_step / turns_per_step, cores)

    def stretch_factor(self, turns: float, span_s: float) -> float:
        """How much longer the round's rollout must take: its turns' CPU time on the host cores over its span."""
        need = self.cpu_s_per_turn * turns / self.cores
        return max(1.0, need / span_s) if span_s > 0 else 1.0


def turn_starts(batch: Batch, place: Placement) -> np.ndarray:
    """[M] wall time each turn's generate call starts (each trajectory's turns run back to back from its start)."""
    if not batch.has_turns:
        return np.repeat(place.start, batch.n_turns)  # no turn detail: every turn counted at its trajectory's start
    return np.repeat(place.start, np.diff(batch.turn_ptr)) + batch.turn_end_s - batch.turn_gen_s


def stretch(batch: Batch, factor: float) -> Batch:
    """The batch with every duration of its rollout phase `factor` times longer."""
    scaled = {name: getattr(batch, name) * factor for name in _TIMES if getattr(batch, name) is not None}
    return replace(batch, **scaled)


def bound_round(host: HostCpu, batch: Batch, place: Placement, t0: float, t_end: float,
                slots: int) -> tuple[Batch, Placement, float]:
    """(batch, placement, factor) of a round started at `t0` whose rollout phase ends at `t_end` in the slot
    model: stretched when the turns started before `t_end` need longer on the host (point 2)."""
    turns = int((turn_starts(batch, place) < t_end).sum())
    factor = host.stretch_factor(turns, t_end - t0)
    if factor <= 1.0:
        return batch, place, 1.0
    batch = stretch(batch, factor)
    return batch, place_rollouts(batch.dur_s, t0, slots), factor
