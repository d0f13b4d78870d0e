"""What one simulated run is: the pipeline mode, the algorithm, the streaming granularity and the run's knobs.

Why this module exists:
1. Every schedule (engine.py for dedicated engines, shared.py for shared cores,
   fully_async.py for streaming with a staleness gate) reads the same `SimConfig`, so it
   lives below all of them and none has to import another to learn what a run asks for.
2. The checks of a configuration (`SimConfig.validate`) are written once, here, and run
   before any schedule starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from thundersync_verl.sim.hardware import SharedCores

MODES = ("sync", "async", "fully_async", "thundersync")
TAIL_MODE = "thundersync_tail"  # ThunderSync with tail batching (tail.py); opt-in, so not among the default MODES
ALL_MODES = MODES + (TAIL_MODE,)
TAIL_ROUNDS = ("dedicated", "mixed")
ALGOS = ("grpo", "opd")
GRANULARITIES = ("turn", "trajectory", "group", "batch")
BUFFERS_PER_OPEN_GROUP = 2  # GRPO: G1 = sum r_i H_i and G2 = sum H_i of the landed trajectories
VERIFY_OVERLAP_BUFFERS_PER_OPEN_GROUP = 3  # plus the sum of the trajectories trained before their reward
VERIFY_REWARDS = ("binary", "general")


@dataclass(frozen=True)
class SimConfig:
    mode: str
    algo: str = "grpo"
    granularity: str | None = None  # thundersync only: trajectory (GRPO) / turn (OPD) by default
    steps: int = 8
    warmup_steps: int = 1
    rollout_slots: int = 256
    budget_groups: int | None = None  # thundersync: most GRPO groups holding buffers at once
    staleness_threshold: float = 1.0  # fully_async: extra batches the rollout may run ahead
    mini_batch: int | None = None  # fully_async: trajectories per learner chunk (default batch / 4)
    min_chunk: int | None = None  # lane: smallest chunk while more work can arrive (default dp)
    max_chunk: int | None = None
    gpus: int = 8  # learner + rollout GPUs, for GPU-hours
    bytes_per_buffer: float = 0.0  # fp32 accumulator bytes per learner rank (4 P / shards)
    record_timeline: bool = False
    shared_cores: SharedCores | None = None  # rollout and learner on the same cores (CPU); None on GPUs
    verify_overlap: bool = False  # thundersync GRPO: start a backward at completion, before the reward
    verify_second_cost: float = 1.0  # verify_overlap: a second backward's cost / the first's (full recompute)
    verify_rewards: str = "binary"  # verify_overlap: binary (smaller class again) or general (every early one)
    pace: object | None = None  # fully_async: a pace.PacePolicy rejecting stale groups (PACE or verl's drop)
    tail_eta: float = 1.25  # thundersync_tail: prompt groups launched per step / groups the batch needs
    tail_max_deferrals: int = 2  # thundersync_tail: a prompt aborted this many times is kept on its next run
    tail_rounds: str = "dedicated"  # thundersync_tail: queued prompts run in rounds of their own, or "mixed"
    host: object | None = None  # host.HostCpu: the rollout hosts' CPU bound on each round (sync, thundersync, tail)

    @property
    def buffers_per_open_group(self) -> int:
        """fp32 accumulator buffers an open GRPO group holds."""
        return VERIFY_OVERLAP_BUFFERS_PER_OPEN_GROUP if self.verify_overlap else BUFFERS_PER_OPEN_GROUP

    def resolved_granularity(self) -> str:
        if self.mode in ("sync", "async"):
            return "batch"
        if self.mode == "fully_async":
            return "mini_batch"
        return self.granularity or ("turn" if self.algo == "opd" else "trajectory")

    @property
    def streams(self) -> bool:
        """ThunderSync's lane (open-group budget, streamed units): plain or with tail batching."""
        return self.mode in ("thundersync", TAIL_MODE)

    def validate(self, batch_size: int) -> None:
        if self.mode not in ALL_MODES:
            raise ValueError(f"mode {self.mode!r} is unknown; the simulator models {ALL_MODES}")
        if self.algo not in ALGOS:
            raise ValueError(f"algo {self.algo!r} is unknown; the simulator models {ALGOS}")
        gran = self.resolved_granularity()
        if self.mode == TAIL_MODE:
            self._validate_tail()
        if self.streams and gran not in GRANULARITIES:
            raise ValueError(f"granularity {gran!r} is unknown; thundersync streams at {GRANULARITIES}")
        if self.algo == "grpo" and gran == "turn":
            raise ValueError("GRPO cannot stream per turn: a turn's advantage needs the trajectory's reward; "
                             "use granularity trajectory, group or batch")
        if self.steps <= self.warmup_steps:
            raise ValueError(f"steps={self.steps} must exceed warmup_steps={self.warmup_steps}: the "
                             "steady-state window starts after warm-up; run more steps")
        if self.mode in ("async", "fully_async") and self.warmup_steps < 1:
            raise ValueError(f"{self.mode} needs warmup_steps >= 1: its first step fills the pipeline and is "
                             "not representative of the steady state")
        if self.rollout_slots < 1 or batch_size < 1:
            raise ValueError("rollout_slots and the batch size must be >= 1")
        if self.verify_overlap:
            self._validate_verify_overlap()
        if self.host is not None and (self.mode not in ("sync", "thundersync", TAIL_MODE) or self.verify_overlap
                                      or (self.shared_cores is not None and self.shared_cores.active)):
            raise ValueError(f"the host CPU bound (host) is modelled for sync, thundersync and {TAIL_MODE} on "
                             f"dedicated devices (got mode {self.mode!r}); drop host, shared_cores or verify_overlap")
        if self.pace is not None and self.mode != "fully_async":
            raise ValueError(f"pace is a fully_async policy (got mode {self.mode!r}): it rejects groups from the "
                             "pool of finished ones, which only a streaming pipeline has; use mode='fully_async'")

    def _validate_tail(self) -> None:
        if self.algo != "grpo":
            raise ValueError(f"{TAIL_MODE} keeps or aborts whole GRPO prompt groups (got algo {self.algo!r}); "
                             "use algo='grpo'")
        if not self.tail_eta >= 1.0:
            raise ValueError(f"tail_eta={self.tail_eta} must be >= 1: it is the prompt groups launched per step over "
                             "those the batch needs (1 = plain ThunderSync); give 1 or more, e.g. 1.25")
        if isinstance(self.tail_max_deferrals, bool) or not isinstance(self.tail_max_deferrals, int) \
                or self.tail_max_deferrals < 1:
            raise ValueError(f"tail_max_deferrals={self.tail_max_deferrals!r} must be a whole number >= 1: a prompt "
                             "aborted that many times is kept on its next run; give 1 or more")
        if self.tail_rounds not in TAIL_ROUNDS:
            raise ValueError(f"tail_rounds={self.tail_rounds!r} is unknown: queued prompts run in rounds of their own "
                             f"(dedicated) or beside fresh ones in the next round (mixed); use one of {TAIL_ROUNDS}")
        if self.verify_overlap or (self.shared_cores is not None and self.shared_cores.active):
            raise ValueError(f"{TAIL_MODE} is simulated on dedicated rollout and learner devices without verify "
                             "overlap; drop shared_cores and verify_overlap")

    def _validate_verify_overlap(self) -> None:
        if self.mode != "thundersync" or self.algo != "grpo" or self.resolved_granularity() != "trajectory":
            raise ValueError(f"verify_overlap is a ThunderSync GRPO policy at trajectory granularity (got mode "
                             f"{self.mode!r}, algo {self.algo!r}, granularity {self.resolved_granularity()!r}): it "
                             "splits a trajectory's backward around its binary reward; use mode='thundersync', "
                             "algo='grpo', granularity='trajectory'")
        if self.shared_cores is not None and self.shared_cores.active:
            raise ValueError("verify_overlap is simulated on dedicated rollout and learner devices only: the "
                             "shared-cores schedule does not model its second backwards; drop shared_cores")
        if self.verify_rewards not in VERIFY_REWARDS:
            raise ValueError(f"verify_rewards={self.verify_rewards!r} is unknown: binary rewards need a second "
                             "backward of the smaller class only, general rewards one per early trajectory; use "
                             f"one of {VERIFY_REWARDS}")
        if self.verify_second_cost < 0:
            raise ValueError(f"verify_second_cost={self.verify_second_cost} must be >= 0: it is the second "
                             "backward's cost relative to the first (1.0 = a full forward + backward again)")
