"""Per-step batches of trajectories: synthetic (from distributions) or replayed (from a trace).

Why this module exists:
1. Every mode must see the same trajectories for a fair comparison (common random numbers):
   batch k is drawn from a generator seeded by (seed, k) only, never by the mode.
2. A trajectory is a chain of turns: prefill the new tokens, decode the turn's answer, run
   the tool; the last turn has no tool call. Its slot is busy from start to the end of the
   last turn; its reward (verifier) lands `reward_s` later, outside the slot. For on-policy
   distillation each turn is scored by a teacher `score_s` after its generation ends.
3. Learner cost depends on token positions (causal attention grows with the prefix), so each
   turn carries the token range [lo, hi) it adds to the sequence.
4. Two group-correlated latents drive a trajectory: how many turns the task takes, and how
   slow its environment is (a repository whose tests take a minute slows every tool call
   of every trajectory of that prompt); both use the same within-group correlation.
5. At thousands of GPUs a per-turn draw is too slow for 1,000 steps: the "aggregate" detail
   level draws each trajectory's sums directly (Gamma, moment-matched to the sum of its
   turns), which is all GRPO needs. Per-turn streaming (OPD turn granularity) needs "full".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from thundersync_verl.sim.dists import Dist, const, group_latents, lognormal

DETAIL_LEVELS = ("full", "aggregate")


@dataclass(frozen=True)
class WorkloadSpec:
    """What the agent and its environment do (behaviour, not hardware)."""

    groups_per_step: int = 32
    group_size: int = 8
    turns: Dist = field(default_factory=lambda: lognormal(20, 0.8))
    icc: float = 0.72
    max_turns: int = 300
    max_context: int = 131_072
    prompt_tokens: Dist = field(default_factory=lambda: const(1024))
    gen_tokens: Dist = field(default_factory=lambda: lognormal(150, 0.6))  # decoded per turn
    obs_tokens: Dist = field(default_factory=lambda: lognormal(300, 0.8))  # tool output per turn
    tool_s: Dist = field(default_factory=lambda: lognormal(1.0, 0.8))  # tool / sandbox latency
    env_speed: Dist = field(default_factory=lambda: const(1.0))  # per-trajectory tool/verifier slowness
    reward_s: Dist = field(default_factory=lambda: lognormal(5.0, 0.5))  # verifier latency
    detail: str = "full"

    @property
    def batch_size(self) -> int:
        return self.groups_per_step * self.group_size


@dataclass(frozen=True)
class RolloutSpec:
    """How fast the rollout engines and the teacher serve one sequence."""

    slots: int = 256  # engines x concurrent sequences
    decode_s_per_token: float = 0.02
    prefill_s_per_token: float = 5e-5
    teacher_fixed_s: float = 0.5  # OPD: per-turn teacher scoring latency
    teacher_s_per_token: float = 2e-5
    # OPD: a teacher call is charged for its turn's new tokens only (a prefix-cached scorer: the published
    # system's assumption), or for the whole prefix it scores (a serving engine that skips its prefix cache for
    # prompt log-probs, as vLLM does; verl's whole-trajectory call is then the last turn's)
    teacher_prefix: bool = False

    def teacher_score_s(self, new_tokens, prefix_tokens):
        """Latency of the teacher's call for a turn with ``new_tokens`` of its own after a prefix ending at
        ``prefix_tokens`` (arrays or numbers)."""
        return self.teacher_fixed_s + self.teacher_s_per_token * (prefix_tokens if self.teacher_prefix else new_tokens)


@dataclass
class Batch:
    """One step's trajectories. Times are offsets (s) from each trajectory's own start."""

    n_groups: int
    group: np.ndarray  # [N] group index in 0..n_groups-1
    dur_s: np.ndarray  # [N] slot-busy time: sum over turns of gen_s + tool_s
    reward_s: np.ndarray  # [N] verifier latency after the last turn (GRPO)
    seq_tokens: np.ndarray  # [N] tokens the learner trains on (prompt + generated + tool output)
    n_turns: np.ndarray  # [N]
    last_score_s: np.ndarray  # [N] teacher latency of the last turn (OPD trajectory readiness)
    turn_ptr: np.ndarray | None = None  # [N + 1] turn offsets into the turn arrays
    turn_end_s: np.ndarray | None = None  # [M] end of the turn's generation, from trajectory start
    turn_lo: np.ndarray | None = None  # [M] first token position the turn adds
    turn_hi: np.ndarray | None = None  # [M] one past its last token position
    turn_score_s: np.ndarray | None = None  # [M] teacher scoring latency for the turn (OPD)
    turn_gen_s: np.ndarray | None = None  # [M] prefill + decode time of the turn
    turn_tool_s: np.ndarray | None = None  # [M] tool latency after the turn (0 for the last)
    turn_gen_tokens: np.ndarray | None = None  # [M] decoded tokens of the turn
    land_s: np.ndarray | None = None  # [N] slot end -> the trainer has the trajectory (replay); None: reward / score
    passed: np.ndarray | None = None  # [N] bool: the verifier's binary outcome (verifier.VerifiedSource)
    prompt_tokens: np.ndarray | None = None  # [N] prompt part of seq_tokens (synthetic draws); the rest is the response

    @property
    def size(self) -> int:
        return int(self.group.shape[0])

    @property
    def has_turns(self) -> bool:
        return self.turn_ptr is not None


def segment_cumsum(values: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """Cumulative sum restarted at each segment start given by ptr ([S + 1] offsets)."""
    cs = np.cumsum(values)  # [M]
    starts = ptr[:-1]
    base = np.where(starts > 0, cs[np.maximum(starts - 1, 0)], 0.0)  # [S]
    lengths = np.diff(ptr)
    return cs - np.repeat(base, lengths)


def batch_from_turns(group, n_groups, turns_per_traj, gen_s, tool_s, new_tokens,
                     gen_tokens, score_s, reward_s, seq_tokens=None) -> Batch:
    """Assemble a Batch from flat per-turn arrays (used by synthesis and trace replay)."""
    turns_per_traj = np.asarray(turns_per_traj, dtype=np.int64)
    ptr = np.concatenate([[0], np.cumsum(turns_per_traj)])  # [N + 1]
    slot_s = gen_s + tool_s  # [M]
    turn_end = segment_cumsum(slot_s, ptr) - tool_s  # [M] generation end of each turn
    turn_tok = new_tokens + gen_tokens  # [M]
    hi = segment_cumsum(turn_tok.astype(np.float64), ptr).astype(np.int64)  # [M]
    lo = hi - turn_tok
    dur = np.add.reduceat(slot_s, ptr[:-1]) if len(slot_s) else np.zeros(len(turns_per_traj))
    last = ptr[1:] - 1
    if seq_tokens is None:
        seq_tokens = hi[last]
    return Batch(n_groups=int(n_groups), group=np.asarray(group, dtype=np.int64), dur_s=dur,
                 reward_s=np.asarray(reward_s, dtype=np.float64), seq_tokens=np.asarray(seq_tokens, dtype=np.int64),
                 n_turns=turns_per_traj, last_score_s=score_s[last], turn_ptr=ptr, turn_end_s=turn_end,
                 turn_lo=lo, turn_hi=hi, turn_score_s=score_s, turn_gen_s=gen_s, turn_tool_s=tool_s,
                 turn_gen_tokens=gen_tokens)


class SyntheticSource:
    """Deterministic batches drawn from a WorkloadSpec and a RolloutSpec."""

    def __init__(self, workload: WorkloadSpec, rollout: RolloutSpec, seed: int = 0):
        if workload.detail not in DETAIL_LEVELS:
            raise ValueError(f"workload detail {workload.detail!r} must be one of {DETAIL_LEVELS}")
        self.workload, self.rollout, self.seed = workload, rollout, int(seed)

    @property
    def batch_size(self) -> int:
        return self.workload.batch_size

    @property
    def group_size(self) -> int:
        return self.workload.group_size

    def batch(self, index: int) -> Batch:
        rng = np.random.default_rng([self.seed, int(index)])
        return self.draw(rng, *self._latents(rng))

    def draw(self, rng: np.random.Generator, group: np.ndarray, turns: np.ndarray, env: np.ndarray) -> Batch:
        """The batch whose turn counts and environment factors are given ([N] each); the rest drawn from rng."""
        if self.workload.detail == "full":
            return self._full(rng, group, turns, env)
        return self._aggregate(rng, group, turns, env)

    def _latents(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(group index, turns, environment slowness factor), each [N]."""
        w = self.workload
        z_turns = group_latents(rng, w.groups_per_step, w.group_size, w.icc)  # [N]
        z_env = group_latents(rng, w.groups_per_step, w.group_size, w.icc)  # [N]
        return self.from_latents(z_turns, z_env)

    def from_latents(self, z_turns: np.ndarray, z_env: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(group index, turns, environment slowness factor) from standard-normal latents ([N] each)."""
        w = self.workload
        turns = np.clip(np.rint(w.turns.from_latent(z_turns)), 1, w.max_turns).astype(np.int64)  # [N]
        group = np.repeat(np.arange(len(z_turns) // w.group_size), w.group_size)  # [N]
        return group, turns, w.env_speed.from_latent(z_env)

    def _full(self, rng: np.random.Generator, group: np.ndarray, turns: np.ndarray, env: np.ndarray) -> Batch:
        w, r = self.workload, self.rollout
        n = len(turns)
        prompt = np.maximum(np.rint(w.prompt_tokens.sample(rng, n)), 1).astype(np.int64)  # [N]
        ptr = np.concatenate([[0], np.cumsum(turns)])
        m = int(ptr[-1])
        gen_tok = np.maximum(np.rint(w.gen_tokens.sample(rng, m)), 1).astype(np.int64)  # [M]
        obs_tok = np.maximum(np.rint(w.obs_tokens.sample(rng, m)), 0).astype(np.int64)  # [M]
        tool = w.tool_s.sample(rng, m) * np.repeat(env, turns)  # [M]
        reward = w.reward_s.sample(rng, n) * env  # [N] the verifier runs in the same environment
        # Context limit: keep the prefix of turns whose end stays within max_context.
        new_tok = np.empty(m, dtype=np.int64)
        new_tok[ptr[:-1]] = prompt
        rest = np.ones(m, dtype=bool)
        rest[ptr[:-1]] = False
        new_tok[rest] = obs_tok[np.flatnonzero(rest) - 1]
        hi = segment_cumsum((new_tok + gen_tok).astype(np.float64), ptr)  # [M]
        first = np.zeros(m, dtype=bool)
        first[ptr[:-1]] = True
        keep = (hi <= w.max_context) | first
        turns = np.add.reduceat(keep.astype(np.int64), ptr[:-1])  # [N] kept prefix lengths
        gen_tok, new_tok, tool = gen_tok[keep], new_tok[keep], tool[keep]
        ptr = np.concatenate([[0], np.cumsum(turns)])
        tool[ptr[1:] - 1] = 0.0  # the last turn ends the episode: no tool call
        gen_tok[ptr[:-1]] = np.minimum(gen_tok[ptr[:-1]], np.maximum(w.max_context - prompt, 1))
        gen_s = new_tok * r.prefill_s_per_token + gen_tok * r.decode_s_per_token  # [M]
        score = r.teacher_score_s(new_tok + gen_tok, segment_cumsum((new_tok + gen_tok).astype(np.float64), ptr))  # [M]
        batch = batch_from_turns(group, len(group) // w.group_size, turns, gen_s, tool, new_tok, gen_tok,
                                 score, reward)
        batch.prompt_tokens = prompt
        return batch

    def _aggregate(self, rng: np.random.Generator, group: np.ndarray, turns: np.ndarray, env: np.ndarray) -> Batch:
        w, r = self.workload, self.rollout
        n = len(turns)
        prompt = np.maximum(np.rint(w.prompt_tokens.sample(rng, n)), 1)  # [N]
        per_turn = w.gen_tokens.mean() + w.obs_tokens.mean()
        fit = np.maximum(np.floor((w.max_context - prompt + w.obs_tokens.mean()) / per_turn), 1)
        turns = np.minimum(turns, fit).astype(np.int64)  # expected context limit
        gen_tok = _gamma_sum(rng, w.gen_tokens, turns)  # [N]
        obs_tok = _gamma_sum(rng, w.obs_tokens, turns - 1)  # [N] no tool output after the last turn
        tool = _gamma_sum(rng, w.tool_s, turns - 1) * env  # [N]
        seq = np.minimum(prompt + gen_tok + obs_tok, w.max_context)
        dur = (prompt + obs_tok) * r.prefill_s_per_token + gen_tok * r.decode_s_per_token + tool
        last_tok = w.gen_tokens.mean() + w.obs_tokens.mean()
        last_score = r.teacher_score_s(np.full(n, last_tok), seq)  # [N]
        return Batch(n_groups=n // w.group_size, group=group, dur_s=dur, reward_s=w.reward_s.sample(rng, n) * env,
                     seq_tokens=np.rint(seq).astype(np.int64), n_turns=turns, last_score_s=last_score,
                     prompt_tokens=np.minimum(prompt, w.max_context).astype(np.int64))


def _gamma_sum(rng: np.random.Generator, dist: Dist, counts: np.ndarray) -> np.ndarray:
    """Sum of `counts` iid draws of dist, as a Gamma with the exact mean and variance."""
    mu, var = dist.mean(), dist.var()
    counts = np.asarray(counts, dtype=np.float64)
    out = counts * mu
    if var <= 0 or mu <= 0:
        return out
    pos = counts > 0
    shape = counts[pos] * mu * mu / var
    out[pos] = rng.gamma(shape, var / mu)
    return out
