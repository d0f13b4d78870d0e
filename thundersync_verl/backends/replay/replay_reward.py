"""Replay reward function: the recorded reward of each trajectory, landing after its recorded latency.

Why:
1. A replayed step must see the recorded rewards, not a fresh verifier run: verifiers can time
   out or depend on the machine, and their latency shapes when ThunderSync can start a
   trajectory's backward pass. This function returns the recorded result (the whole dict, so
   verl's reward-extra fields are the same) after sleeping the recorded reward latency times
   ``time_scale`` (0 = no sleeping).
2. It has verl's custom reward signature (``thundersync_verl/envs/reward.py``), so it plugs in
   through config only::

       reward.custom_reward_function.path=pkg://thundersync_verl.backends.replay.replay_reward
       reward.custom_reward_function.name=compute_score_async
       +reward.custom_reward_function.reward_kwargs.replay_path=/abs/recording.jsonl
       +reward.custom_reward_function.reward_kwargs.time_scale=1.0     # optional

3. Trajectories are matched by what a reward function sees (data source, ground truth, dataset
   index, decoded response) and, for identical ones, by occurrence in recorded order. Each
   reward-loop process counts occurrences itself; identical responses to one prompt have equal
   scores under a deterministic verifier, so ``reward.num_workers > 1`` only swaps their latencies.
4. An unrecorded trajectory raises an error naming the file and how to record it.
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from typing import Any, Mapping, Optional

from thundersync_verl.backends.replay.record import dataset_index
from thundersync_verl.backends.replay.recording import Recording

REPLAY_ENV = "THUNDERSYNC_REPLAY_PATH"
_RECORDINGS: dict[str, Recording] = {}


def recording_for(path: str) -> Recording:
    """This process's loaded recording of ``path`` (loaded once; its occurrence cursors live in it)."""
    key = os.path.abspath(os.path.expanduser(str(path)))
    if key not in _RECORDINGS:
        _RECORDINGS[key] = Recording(key)
    return _RECORDINGS[key]


def forget_recordings() -> None:
    """Drop loaded recordings (tests; a new replay of the same file in one process)."""
    _RECORDINGS.clear()


def _lookup(data_source, solution_str, ground_truth, extra_info, kwargs) -> tuple[Any, float]:
    path = kwargs.get("replay_path") or os.environ.get(REPLAY_ENV)
    if not path:
        raise ValueError("the replay reward needs a recording: set "
                         "+reward.custom_reward_function.reward_kwargs.replay_path=/abs/recording.jsonl "
                         f"(or ${REPLAY_ENV})")
    time_scale = float(kwargs.get("time_scale", 1.0))
    if not time_scale >= 0:
        raise ValueError(f"reward_kwargs.time_scale must be >= 0 (0 = no sleeping), got {time_scale}")
    rec = recording_for(path).next_reward(data_source, ground_truth, dataset_index(extra_info), solution_str)
    return copy.deepcopy(rec.result), rec.latency_s * time_scale


async def compute_score_async(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: Optional[Mapping[str, Any]] = None,
    **kwargs: Any,
):
    """The recorded reward result of this trajectory, after its recorded latency (scaled)."""
    result, delay = _lookup(data_source, solution_str, ground_truth, extra_info, kwargs)
    if delay > 0:
        await asyncio.sleep(delay)
    return result


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Blocking :func:`compute_score_async` (for verl's thread-pool reward path)."""
    result, delay = _lookup(data_source, solution_str, ground_truth, extra_info, kwargs)
    if delay > 0:
        time.sleep(delay)
    return result
