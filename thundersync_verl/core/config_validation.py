"""Check, from plain values, that a verl configuration can be streamed exactly.

Why:
1. Streaming is exact only for settings whose update it reproduces: one optimizer step per
   mini-batch on a whole number of complete groups (several mini-batches and PPO epochs stream,
   ``step/minibatch_plan.py``), a linear policy term at ratio 1 for the first mini-batch. A few
   verl settings break that silently (batch statistics in the loss, PPO's clip against rollout
   log-probs at ratio != 1); they must be refused before training. Policy losses: one table,
   ``core/policy_losses.py``.
2. The function takes plain Python values, not a verl or omegaconf object, so the core stays
   importable without verl; the trainer reads the values from its config and passes them in.
   Every error names the verl config key to change.
3. It returns the settings the accumulator needs (estimator, normaliser, sign buckets, IS
   weights), so the trainer builds the accumulator from one validated source.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from thundersync_verl.core.errors import StreamingConfigError, fail, int_at_least
from thundersync_verl.core.batch_estimators import check_arrival_scope
from thundersync_verl.core.estimators import GroupEstimator, estimator_from_verl
from thundersync_verl.core.normalizers import check_loss_agg_mode
from thundersync_verl.core.objectives import KL_KINDS
from thundersync_verl.core.policy_losses import check_policy_loss

_ACTOR = "actor_rollout_ref.actor"
_RC = "algorithm.rollout_correction"


@dataclass(frozen=True)
class StreamingSettings:
    """What the accumulator and the learner need, derived from a validated config."""

    estimator: GroupEstimator
    loss_agg_mode: str
    loss_scale_factor: float | None
    sign_buckets: bool
    rollout_is: str | None
    rollout_is_upper: float | None
    rollout_is_lower: float | None
    ratio_is_one: bool  # old log-probs recomputed by the learner at the batch's weights


def config_value(cfg, path: str, default=None):
    """``cfg.a.b.c`` for ``path="a.b.c"`` on a hydra/OmegaConf config, a mapping or an object; ``default`` where a
    part is missing or the value is None."""
    node = cfg
    for part in path.split("."):
        node = None if node is None else (node.get(part, None) if hasattr(node, "get") else getattr(node, part, None))
    return default if node is None else node


_fail = functools.partial(fail, cls=StreamingConfigError)


def _positive_int(key: str, value: object) -> int:
    if not int_at_least(value, 1):
        _fail(f"{key}={value!r} must be a positive int", "it counts samples or steps", f"set {key} to a positive int")
    return value  # type: ignore[return-value]


def parse_is_threshold(threshold: object) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold``: a float (TIS upper) or "lower_upper" (IcePop)."""
    key = f"{_RC}.rollout_is_threshold"
    try:
        if isinstance(threshold, str) and "_" in threshold:
            lo, hi = threshold.split("_", 1)
            lower, upper = float(lo), float(hi)
        elif isinstance(threshold, (int, float, str)) and not isinstance(threshold, bool):
            lower, upper = None, float(threshold)
        else:
            raise ValueError
    except ValueError:
        _fail(f"{key}={threshold!r} is not a threshold", "it bounds the IS weights", f"set {key} to e.g. 2.0 or '0.5_2.0'")
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        _fail(f"{key}={threshold!r} is out of range", "bounds must satisfy 0 < lower <= upper", f"fix {key}")
    return upper, lower


def _check_steps(ppo_epochs: int, ppo_mini_batch_size: int, train_batch_size: int, rollout_n: int) -> None:
    """Several mini-batches and epochs stream (``step/minibatch_plan.py``); the partition must be exact.

    verl cuts the batch into train_batch_size / ppo_mini_batch_size equal mini-batches (one optimizer
    step each) and repeats them ppo_epochs times; the first mini-batch streams at ratio 1, later ones
    run verl's PPO ratio and clip against the batch's log-probs.
    """
    _positive_int("data.train_batch_size", train_batch_size)
    _positive_int("actor_rollout_ref.rollout.n", rollout_n)
    _positive_int(f"{_ACTOR}.ppo_epochs", ppo_epochs)
    mini = _positive_int(f"{_ACTOR}.ppo_mini_batch_size", ppo_mini_batch_size)
    if mini > train_batch_size or train_batch_size % mini:
        _fail(
            f"{_ACTOR}.ppo_mini_batch_size={mini} must divide data.train_batch_size={train_batch_size}",
            "each mini-batch is a whole number of complete prompt groups and one optimizer step; "
            "verl's own mini-batch iterator needs an exact split too",
            f"set {_ACTOR}.ppo_mini_batch_size to a divisor of {train_batch_size} (e.g. {train_batch_size})",
        )


def _check_estimator_steps(estimator, rollout_n: int, optimizer_steps: int) -> None:
    """grpo_passk needs two members per group; length- or batch-statistics estimators one step per batch."""
    if getattr(estimator, "verl_name", "") == "grpo_passk" and rollout_n < 2:
        _fail(
            f"algorithm.adv_estimator='grpo_passk' needs actor_rollout_ref.rollout.n >= 2 (got {rollout_n})",
            "pass@k's advantage is the gap between a group's best and second-best member; verl raises too",
            "set actor_rollout_ref.rollout.n >= 2",
        )
    check_arrival_scope(estimator, optimizer_steps)


def _check_clip(low: float, high: float, c: float) -> None:
    if not (0 < low < 1 and high > 0):
        _fail(
            f"clip band (1-{low}, 1+{high}) must contain 1 strictly",
            "with one step per batch every ratio is 1; strictly inside the band the clipped "
            "surrogate equals the plain policy gradient",
            f"set {_ACTOR}.clip_ratio_low in (0, 1) and {_ACTOR}.clip_ratio_high > 0",
        )
    if not c > 1:
        _fail(
            f"{_ACTOR}.clip_ratio_c={c} must be > 1",
            "the dual clip must not bind at ratio 1",
            f"set {_ACTOR}.clip_ratio_c to e.g. 3.0",
        )


def _check_rollout_correction(rollout_is, batch_normalize, bypass_mode, bypass_loss_type, sign_buckets) -> None:
    if rollout_is is not None and rollout_is not in ("token", "sequence"):
        _fail(f"{_RC}.rollout_is={rollout_is!r} is unknown", "IS weights are token or sequence level", f"set {_RC}.rollout_is to null, 'token' or 'sequence'")
    if rollout_is is not None and batch_normalize:
        _fail(
            f"{_RC}.rollout_is_batch_normalize=true cannot be streamed",
            "it divides the policy term by the mean IS weight of the whole batch, a statistic that "
            "only exists once the batch is complete",
            f"set {_RC}.rollout_is_batch_normalize=false",
        )
    if bypass_mode and bypass_loss_type not in ("ppo_clip", "reinforce"):
        _fail(f"{_RC}.loss_type={bypass_loss_type!r} is unknown", "bypass mode has two losses", f"set {_RC}.loss_type to 'reinforce' or 'ppo_clip'")
    if bypass_mode and bypass_loss_type == "ppo_clip" and not sign_buckets:
        _fail(
            f"{_RC}.bypass_mode=true with loss_type='ppo_clip' needs sign buckets",
            "bypass mode uses the rollout engine's log-probs as old log-probs, so ratios differ from "
            "1 and PPO's clip picks its branch by the sign of the advantage, unknown until the group "
            "closes",
            f"set {_RC}.bypass_mode=false (learner recomputes old log-probs), or {_RC}.loss_type="
            "'reinforce' (detached IS weights), or enable sign buckets",
        )


def validate_streaming_config(
    *,
    ppo_epochs: int,
    ppo_mini_batch_size: int,
    train_batch_size: int,
    rollout_n: int,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    policy_loss_mode: str = "vanilla",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    adv_estimator: str = "grpo",
    norm_adv_by_std_in_grpo: bool = True,
    gamma: float = 1.0,
    use_kl_loss: bool = False,
    kl_loss_type: str = "low_var_kl",
    rollout_is: str | None = None,
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
    bypass_mode: bool = False,
    bypass_loss_type: str = "ppo_clip",
    sign_buckets: bool = False,
    dro_beta: float | None = None,
) -> StreamingSettings:
    """Raise ``StreamingConfigError`` (naming the verl key) unless streaming is exact."""
    _check_steps(ppo_epochs, ppo_mini_batch_size, train_batch_size, rollout_n)
    check_loss_agg_mode(loss_agg_mode, loss_scale_factor)  # its errors name the verl keys
    optimizer_steps = ppo_epochs * train_batch_size // ppo_mini_batch_size
    check_policy_loss(policy_loss_mode, loss_agg_mode=loss_agg_mode, optimizer_steps=optimizer_steps,
                      dro_beta=dro_beta, ratio_is_one=not bypass_mode)  # core/policy_losses.py: the one table
    _check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    estimator = estimator_from_verl(adv_estimator, norm_adv_by_std_in_grpo, gamma=gamma)
    _check_estimator_steps(estimator, rollout_n, optimizer_steps)
    if use_kl_loss:
        base = kl_loss_type[:-1] if kl_loss_type.endswith("+") else kl_loss_type
        if base not in KL_KINDS:
            _fail(f"{_ACTOR}.kl_loss_type={kl_loss_type!r} is unknown", "the KL term must match verl's estimator", f"use one of {list(KL_KINDS)}")
    _check_rollout_correction(rollout_is, rollout_is_batch_normalize, bypass_mode, bypass_loss_type, sign_buckets)
    upper = lower = None
    if rollout_is is not None:
        upper, lower = parse_is_threshold(rollout_is_threshold)
    return StreamingSettings(
        estimator=estimator,
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=loss_scale_factor,
        sign_buckets=bool(bypass_mode and bypass_loss_type == "ppo_clip"),
        rollout_is=rollout_is,
        rollout_is_upper=upper,
        rollout_is_lower=lower,
        ratio_is_one=not bypass_mode,
    )


BALANCING_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")  # megatron-core 0.16 router.py


def balancing_loss_coeffs(kinds: Any, coeffs: Any) -> list[float]:
    """The nonzero load-balancing coefficients Megatron's router applies (its ``get_aux_loss_coeff`` for each of
    ``BALANCING_LOSSES``): ``kinds`` is ``moe_router_load_balancing_type`` (one name with a scalar coefficient, or a
    list with a list of coefficients). ``none`` / ``sinkhorn`` apply no coefficient, whatever its value."""
    names = [kinds] if isinstance(kinds, str) else list(kinds)
    values = [coeffs] * len(names) if coeffs is None or isinstance(coeffs, (int, float, str)) else list(coeffs)
    return [float(c) for k, c in zip(names, values) if k in BALANCING_LOSSES and c is not None and float(c) != 0.0]
