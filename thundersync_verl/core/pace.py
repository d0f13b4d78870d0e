"""PACE: pool-aware control of effective staleness for fully-asynchronous training.

Why this module exists:
1. In fully-async training a finished trajectory is stale twice: before completion (its tokens
   were generated under weight versions older than the learner's) and after (it waits in the
   pool of finished groups while the learner trains others). verl's own control is a hard span
   threshold on the prompt's dispatch step (``max_off_policy_threshold``, drop or wait); it
   ignores which tokens are old, how far the policy moved, and how full the pool is.
2. PACE turns both kinds into one effective-staleness score per group, and rejects (evicts and
   regenerates) the worst groups only when the pool holds more than the learner needs: a
   rejection then costs throughput nobody was waiting for.
3. This module is the math only (standard library + torch for the measured drift), so the
   sampler (``thundersync_verl/algos/pace/pace_sampler.py``) and the tests share one definition.

Formulas (v: the learner version the trajectory would update, verl's ``global_steps - 1``; v_land: the
learner version when its group became sampleable, so the staleness accrued before completion and the
staleness accrued in the pool add up to the plain version lag v - u when beta = 1 and gamma = 0):
  (1) segments    a trajectory's generated tokens in generation order, split where the rollout's
                  weight version changed: segment j holds n_j tokens made by version u_j
                  (one segment per agent turn; with only verl's ``min/max_global_steps``: two
                  segments of n/2 tokens at min and at max, see ``segments_from_span``).
  (2) lag         l_j = max(0, v_land - u_j)                          (accrued before completion)
  (3) drift       d_j = delta * l_j                                   (proxy: ``drift_per_version``)
 (3m) measured    m_j = mean_{t in j} |log pi_r(y_t | y_<t) - log pi_{u_j}(y_t | y_<t)|   (nats)
                  m_j < epsilon counts as 0                           (``DRIFT_NOISE_NATS``: the same
                                                  weights re-score within ~1e-6 in float32 and a
                                                  ``min_score`` must not be crossed by rounding)
                  d_j = delta * m_j / k                               (``measured_drift_nats``,
                                                  ``in_version_units``): the whole sequence re-scored by
                                                  the policy pi_r the rollout servers hold when the group
                                                  is first seen finished (r = v_land while weights are
                                                  pushed every step), the rollout's own log-prob the
                                                  second term; tokens the policy did not generate (tool
                                                  observations) are left out. k: the nats one version of
                                                  lag is worth, ``nats_per_version`` or, when 0, the
                                                  running ratio sum n_j m_j / sum n_j l_j over every
                                                  measured segment with l_j > 0 so far
                                                  (``DriftCalibration``; 1 until one is seen). So an
                                                  average trajectory scores its version lag and one whose
                                                  prefix barely moved scores less. Re-scored by a policy
                                                  newer than v_land, m_j covers part of the wait too:
                                                  lower beta accordingly
  (4) prefix      e_1 = d_1,  e_j = max(d_j, gamma * e_{j-1})         (``prefix_carry`` gamma in [0, 1]:
                  tokens generated on a drifted prefix carry part of its drift)
  (5) generation  G = sum_j n_j e_j / sum_j n_j                       (0 for a trajectory with no tokens)
  (6) waiting     W = max(0, v - v_land)    v_land: the learner version when the group became sampleable
  (7) effective   S = G + beta * W          (``waiting_weight`` beta); a group's S is the mean over
                  its trajectories (GRPO trains whole groups)
  (8) excess      E = max(0, Q - b - Q*)    Q: finished groups in the pool, b: groups this sample
                  takes, Q*: ``target_pool`` (the reserve kept for the next samples)
  (9) budget      B = min(floor(kappa * E), Q - b)       (``gain`` kappa >= 0; 0 = observe only)
 (10) rejection   the B groups of highest S among those with S > ``min_score``; ties: older dispatch
                  step first, then the group id. Rejected groups are evicted and regenerated.

What is ours: the published description of PACE names per-token versions, prefix-aware
generation staleness weighted by drift, waiting staleness, an adaptive budget from excess pool
occupancy and ranking within it, without closed forms. The exact forms above (the two-segment
fallback, the mean absolute log-prob gap of (3m) and its conversion to versions by k, the
max-carry of (4), the token mean of (5), the additive S of (7), the group mean, the floor/cap of
(9) and the tie order of (10)) are this project's choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

import torch

from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError, int_at_least, rule_message

DRIFT_NOISE_NATS = 1e-4  # epsilon of (3m): a mean |log-prob gap| below it is re-scoring noise, not drift
HISTOGRAM_EDGES = (0.5, 1.5, 2.5, 3.5)  # staleness buckets 0, 1, 2, 3, 4+ (integers land mid-bucket)


@dataclass(frozen=True)
class PaceSettings:
    """The knobs of formulas (3)-(10); ``validate`` refuses values outside their meaning."""

    target_pool: int = 0  # Q*: finished groups kept in reserve beyond this sample's
    gain: float = 1.0  # kappa: rejections per group of excess (0 = score and log, never reject)
    waiting_weight: float = 1.0  # beta: drift units per version waited in the pool
    drift_per_version: float = 1.0  # delta: proxy drift of one version of lag
    prefix_carry: float = 0.5  # gamma: share of a prefix's drift carried into later segments
    min_score: float = 0.0  # groups scoring at or below this are never rejected (on-policy ones)
    nats_per_version: float = 0.0  # k of (3m): measured drift worth one version of lag; 0 = running estimate

    def validate(self) -> "PaceSettings":
        checks = (
            (int_at_least(self.target_pool, 0), "target_pool must be an int >= 0", "groups kept in reserve"),
            (_finite_at_least(self.gain, 0.0), "gain must be a finite number >= 0", "0 disables rejection"),
            (_finite_at_least(self.waiting_weight, 0.0), "waiting_weight must be >= 0", "0 ignores pool waiting"),
            (_finite_at_least(self.drift_per_version, 0.0), "drift_per_version must be >= 0", "1 = version lag"),
            (_finite_at_least(self.prefix_carry, 0.0) and self.prefix_carry <= 1.0, "prefix_carry must be in [0, 1]",
             "0 = each segment alone, 1 = worst prefix drift everywhere"),
            (_finite_at_least(self.min_score, 0.0), "min_score must be >= 0", "0 protects on-policy groups only"),
            (_finite_at_least(self.nats_per_version, 0.0), "nats_per_version must be >= 0",
             "0 estimates it from the measured segments"),
        )
        for ok, rule, hint in checks:
            if not ok:
                raise StreamingConfigError(rule_message(
                    f"PACE setting invalid: {rule} (got {self})",
                    "the staleness score and the rejection budget are only defined on these ranges",
                    f"set thundersync's PACE sampler_kwargs within range ({hint})"))
        return self


def _finite_at_least(value: object, minimum: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= minimum


@dataclass(frozen=True)
class Segment:
    """``tokens`` generated by weight version ``version``; ``drift`` set when measured, else the proxy."""

    tokens: int
    version: int
    drift: float | None = None


def segments_from_span(tokens: int, min_version: int, max_version: int) -> list[Segment]:
    """The fallback of (1) when only verl's ``min/max_global_steps`` are known: n/2 tokens at each end."""
    if max_version < min_version:
        raise StreamingInputError(rule_message(
            f"max_global_steps {max_version} < min_global_steps {min_version}",
            "weights only move forward, so a trajectory cannot end on an older version than it started",
            "check the rollout server's version stamps (extra_fields min/max_global_steps)"))
    if min_version == max_version:
        return [Segment(tokens, min_version)]
    first = tokens // 2
    return [Segment(first, min_version), Segment(tokens - first, max_version)]


def segments_from_turns(turns: Iterable[Mapping]) -> list[Segment]:
    """(1) from per-turn records ``{"gen_tokens", "version"}``, merging consecutive turns of one version."""
    out: list[Segment] = []
    for turn in turns:
        n, version = int(turn["gen_tokens"]), int(turn["version"])
        if out and out[-1].version == version and out[-1].drift is None:
            out[-1] = Segment(out[-1].tokens + n, version)
        else:
            out.append(Segment(n, version))
    return out


def generation_staleness(segments: Sequence[Segment], landed_version: int, settings: PaceSettings) -> float:
    """(2)-(5): the token-weighted, prefix-carried drift of a trajectory's generated tokens, accrued by
    ``landed_version`` (the learner version when its group finished)."""
    total = sum(s.tokens for s in segments)
    if total <= 0:
        return 0.0
    carried, acc = 0.0, 0.0
    for seg in segments:
        lag = max(0, landed_version - seg.version)
        drift = settings.drift_per_version * lag if seg.drift is None else float(seg.drift)
        carried = max(drift, settings.prefix_carry * carried)
        acc += seg.tokens * carried
    return acc / total


def waiting_staleness(learner_version: int, landed_version: int) -> float:
    """(6): versions the finished group has waited in the pool."""
    return float(max(0, learner_version - landed_version))


def effective_staleness(generation: float, waiting: float, settings: PaceSettings) -> float:
    """(7)."""
    return generation + settings.waiting_weight * waiting


def rejection_budget(pool: int, needed: int, settings: PaceSettings) -> int:
    """(8)-(9): how many finished groups may be rejected when ``pool`` are finished and ``needed`` are taken."""
    if not (int_at_least(pool, 0) and int_at_least(needed, 0)):
        raise StreamingInputError(rule_message(
            f"pool ({pool!r}) and needed ({needed!r}) must be ints >= 0",
            "they count finished prompt groups",
            "pass the number of sampleable groups and the sample's batch size"))
    excess = max(0, pool - needed - settings.target_pool)
    return max(0, min(math.floor(settings.gain * excess), pool - needed))


def select_rejections(scores: Mapping[str, float], budget: int, settings: PaceSettings,
                      dispatch_step: Mapping[str, int] | None = None) -> list[str]:
    """(10): the ids to reject, worst first."""
    dispatch_step = dispatch_step or {}
    eligible = [g for g, s in scores.items() if s > settings.min_score]
    eligible.sort(key=lambda g: (-scores[g], dispatch_step.get(g, 0), g))
    return eligible[:max(0, budget)]


def measured_segment_drift(rollout_log_probs: torch.Tensor, current_log_probs: torch.Tensor,
                           segment_of_token: torch.Tensor, n_segments: int) -> list[float]:
    """(3, measured): per segment, the mean |log pi_v - log pi_u| over its generated tokens.

    ``rollout_log_probs`` [T] are the rollout's own log-probs (pi_u, stamped per token),
    ``current_log_probs`` [T] the same tokens re-scored in their prefix by the current policy pi_v,
    ``segment_of_token`` [T] long: each generated token's segment, -1 for tokens not generated by the
    policy (tool observations). A segment without tokens has drift 0.
    """
    if rollout_log_probs.shape != current_log_probs.shape or rollout_log_probs.shape != segment_of_token.shape:
        raise StreamingInputError(rule_message(
            "rollout log-probs, current log-probs and segment ids must have the same shape [T]",
            "each token's drift compares its two log-probs and belongs to one segment",
            f"got {tuple(rollout_log_probs.shape)}, {tuple(current_log_probs.shape)}, {tuple(segment_of_token.shape)}"))
    keep = segment_of_token >= 0  # [T]
    delta = (current_log_probs.double() - rollout_log_probs.double()).abs()[keep]  # [T_gen]
    seg = segment_of_token[keep].long()  # [T_gen]
    sums = torch.zeros(n_segments, dtype=torch.float64).index_add_(0, seg, delta)  # [J]
    counts = torch.zeros(n_segments, dtype=torch.float64).index_add_(0, seg, torch.ones_like(delta))  # [J]
    return (sums / counts.clamp(min=1.0)).tolist()


def segment_of_tokens(segments: Sequence[Segment], response_mask: torch.Tensor) -> torch.Tensor:
    """[R] long: each response token's segment in generation order, -1 where ``response_mask`` is 0.

    The segments' token counts may differ from the generated tokens (the span fallback counts tool
    observations too; the response may be truncated): their boundaries are then scaled to the
    generated count, so each segment keeps its share of the trajectory.
    """
    mask = response_mask.reshape(-1).bool()  # [R]
    out = torch.full(mask.shape, -1, dtype=torch.long)  # [R]
    n_gen, total = int(mask.sum()), sum(s.tokens for s in segments)
    if n_gen == 0 or total <= 0:
        return out
    cum = torch.tensor([s.tokens for s in segments], dtype=torch.float64).cumsum(0)  # [J]
    ends = torch.round(cum * n_gen / total).long()  # [J] exclusive end of each segment, in generated tokens
    index = torch.arange(n_gen)  # [R_gen]
    out[mask] = torch.searchsorted(ends, index, right=True).clamp(max=len(segments) - 1)
    return out


def measured_drift_nats(segments: Sequence[Segment], rollout_log_probs: torch.Tensor,
                        current_log_probs: torch.Tensor, response_mask: torch.Tensor) -> list[Segment]:
    """(3m): ``segments`` with ``drift`` = m_j in nats, from a trajectory's response log-probs under the
    rollout ([R]) and under the re-scoring policy ([R])."""
    seg_ids = segment_of_tokens(segments, response_mask)  # [R]
    drifts = measured_segment_drift(rollout_log_probs.reshape(-1), current_log_probs.reshape(-1), seg_ids, len(segments))
    return [replace(s, drift=d if d >= DRIFT_NOISE_NATS else 0.0) for s, d in zip(segments, drifts)]


@dataclass
class DriftCalibration:
    """k of (3m): the running token-weighted nats per version of lag over the measured segments seen."""

    nats: float = 0.0  # sum n_j m_j over measured segments with lag > 0
    token_versions: float = 0.0  # sum n_j l_j over the same segments

    def observe(self, segments: Sequence[Segment], landed_version: int) -> None:
        for s in segments:
            lag = max(0, landed_version - s.version)
            if s.drift is not None and lag > 0:
                self.nats += s.tokens * float(s.drift)
                self.token_versions += s.tokens * lag

    def per_version(self, settings: PaceSettings) -> float:
        if settings.nats_per_version > 0:
            return float(settings.nats_per_version)
        if self.token_versions > 0 and self.nats > 0:
            return self.nats / self.token_versions
        return 1.0


def in_version_units(segments: Sequence[Segment], nats_per_version: float, settings: PaceSettings) -> list[Segment]:
    """(3m): measured drifts (nats) as d_j = delta * m_j / k; proxy segments (drift None) unchanged."""
    scale = settings.drift_per_version / nats_per_version
    return [s if s.drift is None else replace(s, drift=float(s.drift) * scale) for s in segments]


@dataclass(frozen=True)
class PaceDecision:
    """One sample call's outcome: the pool, the budget and the groups rejected (worst first)."""

    pool: int
    needed: int
    budget: int
    rejected: list[str]
    scores: dict[str, float]

    @property
    def kept(self) -> list[str]:
        rejected = set(self.rejected)
        return [g for g in self.scores if g not in rejected]


def decide(scores: Mapping[str, float], needed: int, settings: PaceSettings,
           dispatch_step: Mapping[str, int] | None = None) -> PaceDecision:
    """(8)-(10) over the pool's group scores: the budget and which groups to reject."""
    budget = rejection_budget(len(scores), needed, settings)
    rejected = select_rejections(scores, budget, settings, dispatch_step)
    return PaceDecision(pool=len(scores), needed=needed, budget=budget, rejected=rejected, scores=dict(scores))


def histogram(values: Iterable[float], edges: Sequence[float] = HISTOGRAM_EDGES) -> list[int]:
    """Counts per bucket: (-inf, e_0], (e_0, e_1], ..., (e_last, inf)."""
    counts = [0] * (len(edges) + 1)
    for value in values:
        counts[sum(value > e for e in edges)] += 1
    return counts
