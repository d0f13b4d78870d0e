"""What a trace folder of ``benchmarks/modes.py`` says about its runs besides their records.

Why:
1. A trace's name tells its Sync configuration (``*_bypass``: verl's bypass of the old-log-prob forward).
2. An emulated-device run (``modes.py --rollout emulated``) writes ``meta.json`` beside its traces: the policy's
   parameter count (per-token costs scale with it from one policy to another) and ``machine_probe_s``, per mode
   the time of a fixed training step of the policy on the learner's core before and after the mode's run
   (``thundersync_harness.machine_probe``). The probes' ratio between two runs is how much slower the machine
   ran for identical work; ``at_machine_speed`` scales the learner core's costs by it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from thundersync_verl.sim.hardware import LearnerCosts


def is_bypass(path: Path) -> bool:
    """Sync in verl's bypass mode (no separate old-log-prob forward): modes.py names its trace *_bypass."""
    return Path(path).stem.endswith("_bypass")


def rollout_on_own_device(path: Path) -> bool:
    """An emulated-device run (``modes.py --rollout emulated`` writes meta.json beside its traces)."""
    return (Path(path).parent / "meta.json").is_file()


def policy_params(path: Path) -> int | None:
    """The run's policy parameter count, from the meta.json ``modes.py --rollout emulated`` writes beside it."""
    meta = Path(path).parent / "meta.json"
    return json.loads(meta.read_text()).get("policy_params") if meta.is_file() else None


def token_scale(fit_path: Path, target_path: Path) -> float:
    """Target over fit policy parameters (sim/transfer.py, point 7); 1 when either is unknown."""
    fit, target = policy_params(fit_path), policy_params(target_path)
    return target / fit if fit and target else 1.0


LEARNER_CORE_COSTS = ("s_per_token", "s_per_token_sq", "chunk_overhead_s", "optimizer_s", "weight_sync_s",
                      "step_overhead_s", "forward_s_per_token", "forward_overhead_s", "step_gap_s", "s_per_row")


def machine_probe_s(path: Path) -> float | None:
    """The learner core's probe time beside the run of this trace (module docstring, point 9): the mean of the probes
    before and after it, from the meta.json ``modes.py --rollout emulated`` writes; None when it has none."""
    meta = Path(path).parent / "meta.json"
    probes = json.loads(meta.read_text()).get("machine_probe_s", {}) if meta.is_file() else {}
    pair = probes.get(Path(path).stem.split("_", 1)[-1])
    return sum(pair) / len(pair) if pair else None


def speed_ratio(fit_path: Path, target_path: Path) -> float | None:
    """How much slower the machine's learner core ran beside the target than beside the fit run (probe time of the
    target over the fit's); None without both probes."""
    fit, target = machine_probe_s(fit_path), machine_probe_s(target_path)
    return target / fit if fit and target else None


def at_machine_speed(costs: LearnerCosts, ratio: float) -> LearnerCosts:
    """Every cost of the learner's core (its compute, host work per row and per call, optimizer, weight push, the
    driver's step gap, which shares that core) times ``ratio``."""
    return replace(costs, **{k: getattr(costs, k) * ratio for k in LEARNER_CORE_COSTS})
