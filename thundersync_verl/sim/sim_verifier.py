"""The reward verifier of a SWE task: how long its test run takes and whether the trajectory passed.

Why this module exists:
1. A SWE reward is a test run in the trajectory's repository: seconds for a targeted test file,
   minutes for a slow suite, cut by the harness timeout. `SWE_VERIFIER` is that shape (a
   mixture of a fast and a slow lognormal, capped), and `scaled` stretches it to study faster or
   slower verifiers with the same shape; the cap (a timeout) does not stretch.
2. Slow suites belong to repositories, so the latencies of one prompt group are correlated
   (`latency_icc`, through the same Gaussian copula as `dists.py`), and so are the outcomes: a
   prompt's pass probability is drawn from a Beta with mean `pass_rate` and intra-class
   correlation `pass_icc` (0 = every trajectory passes independently with `pass_rate`).
3. Starting backwards before the verifier answers pays off according to the pass rate (the
   second backwards are min(passes, fails) per group), so the outcomes are part of a batch
   (`Batch.passed`). `VerifiedSource` wraps any batch source and redraws the verifier from its
   own random stream keyed by (seed, batch index): the wrapped source's draws (turns, tokens,
   tools) stay identical for every verifier setting and every policy (common random numbers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from thundersync_verl.sim.dists import Dist, const, lognormal, mixture
from thundersync_verl.sim.workload import Batch

VERIFIER_STREAM = 0x5E7  # salt that keeps the verifier's draws apart from the wrapped source's
SWE_TIMEOUT_S = 1800.0  # a common SWE harness timeout per test run
SWE_VERIFIER = mixture((0.75, 0.25), (lognormal(20.0, 0.7), lognormal(120.0, 0.8)), cap=SWE_TIMEOUT_S)
SWE_VERIFIER_NOTE = ("75% targeted test runs (median 20 s, sigma 0.7), 25% slow suites (median 120 s, "
                     "sigma 0.8), capped at the 1800 s harness timeout; median ~27 s, mean ~60 s")


def scaled(dist: Dist, factor: float) -> Dist:
    """The same shape with every duration multiplied by `factor` (0 gives a zero-latency verifier)."""
    if factor < 0:
        raise ValueError(f"latency scale {factor} must be >= 0: it multiplies durations; use 0 for an "
                         "instant verifier")
    if factor == 0 or dist.kind == "const":
        return const(dist.value * factor if dist.kind == "const" else 0.0)
    if dist.kind == "lognormal":
        return Dist("lognormal", median=dist.median * factor, sigma=dist.sigma, cap=dist.cap)
    if dist.kind == "pareto":
        return Dist("pareto", scale=dist.scale * factor, alpha=dist.alpha, cap=dist.cap)
    parts = tuple(scaled(c, factor) for c in dist.components)
    return mixture(dist.weights, parts, cap=dist.cap)


@dataclass(frozen=True)
class VerifierSpec:
    """Latency and outcome model of the reward verifier."""

    latency: Dist = field(default_factory=lambda: SWE_VERIFIER)
    latency_icc: float = 0.5  # within-group correlation of the test-run latency (same repository)
    pass_rate: float = 0.5
    pass_icc: float = 0.0  # within-group correlation of the outcomes (prompt difficulty)

    def __post_init__(self) -> None:
        if not 0.0 <= self.pass_rate <= 1.0:
            raise ValueError(f"pass_rate={self.pass_rate} must lie in [0, 1]: it is the share of trajectories "
                             "whose tests pass; give a probability")
        for name in ("latency_icc", "pass_icc"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must lie in [0, 1): it is a share of variance "
                                 "between groups; 0 = independent trajectories")


def draw_verifier(rng: np.random.Generator, group: np.ndarray, n_groups: int,
                  spec: VerifierSpec) -> tuple[np.ndarray, np.ndarray]:
    """(latency s, passed) for trajectories of the given groups, each [N]."""
    n = len(group)
    z = (math.sqrt(spec.latency_icc) * rng.standard_normal(n_groups)[group]
         + math.sqrt(1.0 - spec.latency_icc) * rng.standard_normal(n))  # [N] unit-variance latents
    latency = np.maximum(spec.latency.from_latent(z), 0.0)  # [N]
    p = spec.pass_rate
    if spec.pass_icc > 0.0 and 0.0 < p < 1.0:
        concentration = (1.0 - spec.pass_icc) / spec.pass_icc  # Beta(a, b) with a + b = this
        p_group = rng.beta(p * concentration, (1.0 - p) * concentration, n_groups)  # [G]
    else:
        p_group = np.full(n_groups, p)
    passed = rng.random(n) < p_group[group]  # [N]
    return latency, passed


class VerifiedSource:
    """A batch source whose verifier latencies and pass outcomes come from a `VerifierSpec`.

    The wrapped source's own reward latency (and any replayed landing) is replaced: the reward
    lands `latency` after the trajectory's last turn.
    """

    def __init__(self, base, spec: VerifierSpec, seed: int = 0):
        self.base, self.spec, self.seed = base, spec, int(seed)

    @property
    def batch_size(self) -> int:
        return self.base.batch_size

    @property
    def group_size(self) -> int:
        return self.base.group_size

    def batch(self, index: int) -> Batch:
        b = self.base.batch(index)
        rng = np.random.default_rng([self.seed, int(index), VERIFIER_STREAM])
        latency, passed = draw_verifier(rng, b.group, b.n_groups, self.spec)
        return replace(b, reward_s=latency, passed=passed, land_s=None)
