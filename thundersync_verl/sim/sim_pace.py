"""PACE (and verl's drop threshold) as fully-async policies of the simulator.

Why this module exists:
1. The benchmark (benchmarks/pace.py) measures PACE on the real trainer; the simulator predicts the
   same runs from their traces, so the policy must exist here too, on the same streaming schedule
   as plain fully-async (``fully_async.py``'s state, unchanged but for a rejection step).
2. At each point where the learner is about to take a chunk, the ready pool's complete groups
   are scored and the worst are rejected, with ``core/pace.py``'s budget restated here for
   whole-group version lags (the simulator has no per-token versions and the package must not
   import torch): v = learner version, born = a trajectory's start version,
       G = delta * (v_land - born)       (one segment per trajectory; group mean; accrued by landing)
       W = v - v_land                    (v_land: the version when its group's last member landed)
       S = G + beta * W,   E = max(0, Q - b - Q*),   B = min(floor(kappa * E), Q - b)
   and the B highest-S groups with S > min_score are rejected (ties: the older group first). The
   simulator has no token log-probs, so the measured drift of (3m) (``pace.scorer=rollout_server``)
   has no counterpart here (``benchmarks/pace.py`` gives its ``pace_measured`` run no prediction).
   The budget is spent at a step's first chunk (``once_per_step``, the sampler's default) or at
   every chunk. ``drop_threshold`` is verl's rule instead: every group with v - born + 1 > threshold goes
   (verl counts spans from the prompt's dispatch step; here from the trajectory's start).
3. Rejected trajectories are regenerated: they leave the staleness gate (``_State.retired``) and
   fresh trajectories are drawn from the stream, as verl's refill submits new prompts. Their
   count is reported (``rejected_trajectories``, ``rejected_share``), and per training step
   (``per_step``: step = learner version + 1, as verl's ``global_steps``: rejected and trained
   trajectories and the trained ones' staleness sum), so a prediction can be read over the steps
   a measured run counted.
4. The budget depends on how full the pool is at a step's first chunk, so the prediction is only
   as good as the landing latency the replay uses (a group enters the pool when its last member
   has landed): with a landing a few seconds too long, the batch started at the previous push is
   still landing when the next step begins, the pool holds one batch instead of two and the
   budget shrinks (measured with ``benchmarks/pace.py``, which replays with the landing latency
   measured from the unfiltered run's pool counts).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from thundersync_verl.sim.sim_config import SimConfig
from thundersync_verl.sim.fully_async import _State, simulate_fully_async
from thundersync_verl.sim.hardware import LearnerCosts
from thundersync_verl.sim.metrics import SimResult


@dataclass(frozen=True)
class PacePolicy:
    target_pool: int = 0  # Q*: groups kept in reserve
    gain: float = 1.0  # kappa
    waiting_weight: float = 1.0  # beta
    drift_per_version: float = 1.0  # delta
    min_score: float = 0.0
    drop_threshold: int | None = None  # set: verl's drop rule instead of PACE's budget
    once_per_step: bool = True  # PACE's budget at a step's first chunk only (the sampler's decide_every=step)

    def budget(self, pool: int, needed: int) -> int:
        excess = max(0, pool - needed - self.target_pool)
        return max(0, min(math.floor(self.gain * excess), pool - needed))


class _PaceState(_State):
    def __init__(self, cfg: SimConfig, source, costs: LearnerCosts, policy: PacePolicy):
        super().__init__(cfg, source, costs)
        self.policy = policy
        self.landed_at: dict[int, int] = {}  # tid -> learner version when it landed
        self.rejected = 0
        self.decisions = 0
        self.per_step: dict[int, list[int]] = {}  # step (learner version + 1) -> [rejected, trained, staleness sum]

    def _tally(self, rejected: int = 0, trained: int = 0, staleness: int = 0) -> None:
        row = self.per_step.setdefault(self.version + 1, [0, 0, 0])
        row[0] += rejected
        row[1] += trained
        row[2] += staleness

    def on_land(self, t: float, tid: int) -> None:
        self.landed_at[tid] = self.version
        super().on_land(t, tid)

    def try_learn(self, t: float) -> None:
        need = min(self.mini_batch, self.n - self.consumed)
        first = self.consumed == 0 or not self.policy.once_per_step or self.policy.drop_threshold is not None
        if self.learner_phase is None and self.n_ready >= need and self.ready and first:
            self._reject(t, need)
        super().try_learn(t)

    def _score(self, block: list[int]) -> float:
        p, landed = self.policy, max(self.landed_at[tid] for tid in block)
        gen = sum(max(0, landed - self.version_of[tid]) for tid in block) / len(block)
        return p.drift_per_version * gen + p.waiting_weight * max(0, self.version - landed)

    def _reject(self, t: float, need: int) -> None:
        blocks = list(self.ready)
        size = max(len(b) for b in blocks)
        if self.policy.drop_threshold is not None:
            worst = [i for i, b in enumerate(blocks)
                     if self.version - min(self.version_of[tid] for tid in b) + 1 > self.policy.drop_threshold]
        else:
            needed = -(-need // size)  # groups the chunk takes
            budget = self.policy.budget(len(blocks), needed)
            scores = [self._score(b) for b in blocks]
            order = sorted((i for i in range(len(blocks)) if scores[i] > self.policy.min_score),
                           key=lambda i: (-scores[i], i))
            worst = order[:budget]
        self.decisions += 1
        if not worst:
            return
        gone = set(worst)
        self.ready = deque(b for i, b in enumerate(blocks) if i not in gone)
        for i in worst:
            for tid in blocks[i]:
                self.version_of.pop(tid)
                self.landed_at.pop(tid, None)
                self.stream.release(tid)
            self.n_ready -= len(blocks[i])
            self.retired += len(blocks[i])
            self.rejected += len(blocks[i])
            self._tally(rejected=len(blocks[i]))
        self.try_start(t)  # regenerate: the gate has room again

    def _train(self, tid: int) -> None:
        self.landed_at.pop(tid, None)
        self._tally(trained=1, staleness=self.version - self.version_of[tid])
        super()._train(tid)


def simulate_pace(cfg: SimConfig, source, costs: LearnerCosts, policy: PacePolicy) -> SimResult:
    """Fully-async with PACE's (or verl's drop) rejection; ``extra`` adds the rejected count and share, overall
    and per step."""
    state = _PaceState(cfg, source, costs, policy)
    result = simulate_fully_async(cfg, source, costs, state=state)
    trained = result.extra.get("trained_trajectories", 0)
    result.extra.update({"rejected_trajectories": state.rejected,
                         "rejected_share": state.rejected / max(state.rejected + trained, 1),
                         "per_step": {step: {"rejected": r, "trained": n, "staleness_sum": st}
                                      for step, (r, n, st) in sorted(state.per_step.items())}})
    return result
