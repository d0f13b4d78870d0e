"""Heavy-tailed latency for tool calls and verifiers.

Why:
1. Streaming training pays off when trajectories finish at very different times. In agentic
   SWE traces most tool calls return quickly while a few (test suites, builds) take orders of
   magnitude longer; a constant delay would hide exactly the effect we want to measure.
2. The default ``mixture`` is a log-normal body plus a Pareto tail:
       body  (95%): log-normal, median 0.15 s, sigma 0.5   -> p99 of the body ~0.48 s
       tail  ( 5%): Pareto, scale 0.5 s, alpha 1.2          -> median of the tail ~0.9 s
       all        : p50 ~0.155 s, p90 ~0.34 s, p99 ~1.9 s, mean ~0.23 s, capped at 4 s
                    (~0.4% of calls hit the cap)
   (P(X > 2 s) = 0.05 * (0.5 / 2) ** 1.2 = 0.0095, hence p99 ~2 s.)
3. ``scale`` multiplies every sample and the cap: it is the one knob that calibrates the
   model to a machine or a trace without changing its shape.
4. Sampling takes an explicit ``random.Random`` so each trajectory can own a reproducible stream.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields
from typing import Any, Mapping

KINDS = ("lognormal", "pareto", "mixture", "constant")


@dataclass(frozen=True)
class LatencyModel:
    """Seconds of latency per call. See the module docstring for the default shape."""

    kind: str = "mixture"
    median_s: float = 0.15  # lognormal body median; the value itself for ``constant``
    sigma: float = 0.5  # lognormal body spread (log space)
    alpha: float = 1.2  # Pareto tail index (smaller = heavier)
    tail_prob: float = 0.05  # mixture: share of calls drawn from the tail
    tail_scale: float = 0.5  # Pareto scale x_m: the smallest tail value, seconds
    max_s: float = 4.0  # cap, before ``scale``
    scale: float = 1.0  # multiplies samples and cap: the calibration knob
    seed: int = 0  # seed of the model's own stream when ``sample`` gets no rng

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"LatencyModel.kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("median_s", "sigma", "tail_scale", "max_s", "scale"):
            if getattr(self, name) < 0:
                raise ValueError(f"LatencyModel.{name} must be >= 0 (it is a duration or a spread), got {getattr(self, name)}")
        if self.kind in ("pareto", "mixture") and self.alpha <= 0:
            raise ValueError(f"LatencyModel.alpha must be > 0 for a Pareto tail, got {self.alpha}")
        if not 0.0 <= self.tail_prob <= 1.0:
            raise ValueError(f"LatencyModel.tail_prob is a probability and must be in [0, 1], got {self.tail_prob}")
        object.__setattr__(self, "_own_rng", random.Random(self.seed))

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> "LatencyModel":
        """Build from a plain mapping (a hydra/omegaconf node converted to dict works too).

        Unknown keys are an error: a typo would otherwise silently fall back to the default shape.
        Keys whose value is None keep their default (parquet structs fill missing fields with None).
        """
        if config is None:
            return cls()
        config = {k: v for k, v in dict(config).items() if v is not None}
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - allowed)
        if unknown:
            raise ValueError(
                f"unknown latency keys {unknown}; allowed keys are {sorted(allowed)}. "
                "Unknown keys are rejected so that a typo cannot silently keep the default latency."
            )
        return cls(**{k: v for k, v in config.items()})

    def to_config(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def sample(self, rng: random.Random | None = None) -> float:
        """One latency in seconds, in [0, max_s * scale]."""
        rng = rng if rng is not None else self._own_rng  # type: ignore[attr-defined]
        if self.kind == "constant":
            raw = self.median_s
        elif self.kind == "lognormal":
            raw = self._lognormal(rng)
        elif self.kind == "pareto":
            raw = self._pareto(rng)
        else:
            raw = self._pareto(rng) if rng.random() < self.tail_prob else self._lognormal(rng)
        return min(raw, self.max_s) * self.scale

    def sample_many(self, n: int, rng: random.Random | None = None) -> list[float]:
        return [self.sample(rng) for _ in range(n)]

    def _lognormal(self, rng: random.Random) -> float:
        if self.median_s == 0:
            return 0.0
        return rng.lognormvariate(math.log(self.median_s), self.sigma)

    def _pareto(self, rng: random.Random) -> float:
        return self.tail_scale * rng.paretovariate(self.alpha)


NO_LATENCY = LatencyModel(kind="constant", median_s=0.0)
