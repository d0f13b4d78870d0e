"""verl custom reward functions for the arithmetic tool task.

How verl 0.9.1 calls them (``verl/trainer/ppo/reward.py`` and the reward-loop managers):
1. ``reward.custom_reward_function.{path,name}`` names the function; ``reward_kwargs`` from
   the config are merged into its keyword arguments. A coroutine function is awaited on the
   reward loop's event loop; a plain function runs in the loop's thread pool. We ship both:
   :func:`compute_score_async` (many verifiers wait concurrently) and :func:`compute_score`.
2. It is called with ``data_source``, ``solution_str`` (the response decoded with
   ``skip_special_tokens=True``: the answer markup is a non-special token so it survives),
   ``ground_truth`` (``reward_model.ground_truth``) and ``extra_info`` (the dataset's
   ``extra_info`` plus ``num_turns`` and tool fields added by the rollout).
3. A dict result must hold ``score``; every other key becomes a per-sample reward-extra field
   (strings are kept for dumps and skipped by the numeric metrics). All results carry the same
   keys because verl takes the key list from the first sample.
4. The verifier's latency is drawn from a :class:`LatencyModel`: ``extra_info["verifier_latency"]``
   overrides the ``verifier_latency`` reward kwarg, which overrides the default heavy-tailed
   model. The draw is seeded by the sample index and the response, so a rerun reproduces it.
"""

from __future__ import annotations

import random
import zlib
from typing import Any, Mapping

from thundersync_verl.envs.latency import LatencyModel
from thundersync_verl.envs.verifier import VerifierResult, verify, verify_async

DEFAULT_VERIFIER_TIMEOUT_S = 5.0


def _latency_for(solution_str: str, extra_info: Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> float:
    """This sample's extra verifier latency in seconds (reproducible per sample)."""
    extra_info = extra_info or {}
    config = extra_info.get("verifier_latency") or kwargs.get("verifier_latency")
    model = config if isinstance(config, LatencyModel) else LatencyModel.from_config(config)
    seed = zlib.crc32(f"{extra_info.get('index', 0)}:{solution_str}".encode("utf-8"))
    return model.sample(random.Random(seed))


def _as_dict(result: VerifierResult) -> dict[str, Any]:
    return {
        "score": float(result.score),
        "acc": float(result.score == 1.0),
        "reason": result.reason,
        "pred": result.pred if result.pred is not None else "",
        "verifier_s": float(result.duration_s),
    }


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Blocking reward: ``{"score", "acc", "reason", "pred", "verifier_s"}``.

    A bad response or a broken verifier gives score 0 with a reason; only an invalid latency
    configuration raises (a setup error that must not pass silently).
    """
    latency = _latency_for(solution_str, extra_info, kwargs)
    timeout_s = float(kwargs.get("verifier_timeout_s", DEFAULT_VERIFIER_TIMEOUT_S))
    return _as_dict(verify(solution_str, ground_truth, timeout_s=timeout_s, extra_latency_s=latency))


async def compute_score_async(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Awaitable :func:`compute_score` (same result), for verl's async reward path."""
    latency = _latency_for(solution_str, extra_info, kwargs)
    timeout_s = float(kwargs.get("verifier_timeout_s", DEFAULT_VERIFIER_TIMEOUT_S))
    result = await verify_async(solution_str, ground_truth, timeout_s=timeout_s, extra_latency_s=latency)
    return _as_dict(result)
