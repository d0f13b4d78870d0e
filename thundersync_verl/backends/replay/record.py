"""Recording what a rollout produced, so a training step can be re-run on the same trajectories.

Why a recording, and why this format:
1. Sampling, tool latency and machine load make two runs of a step differ; tests and benchmarks
   that compare trainers (Sync vs ThunderSync, an old vs a new loss) need both to see exactly the
   same trajectories, rewards and arrival timing. The ``replay`` rollout backend serves them back
   from a file written here.
2. Two hook points see everything a trajectory is made of: the rollout server (every generate
   call: prompt ids in, response ids and log-probs out) and the reward function (the trajectory's
   decoded response, its score). Both append to one JSONL file, so the file is the whole step.
3. Several processes write the same file (the rollout server actor, the reward-loop workers).
   Each record is one ``write`` of one line to a file opened with ``O_APPEND``, so lines never
   interleave; the first writer creates the file with ``O_EXCL`` and a header holding the clock
   origin ``t0_unix``, and every writer reports times relative to it.

Format (``FORMAT``), one JSON object per line, ``kind`` says which:

* ``{"kind": "header", "format": "thundersync-replay/1", "t0_unix": <float>}``: first line;
  ``t0_unix`` is the wall-clock start of the first generate call (or of the first reward call
  when a process that scores arrives first). Every ``*_s`` field below is seconds since it.
* ``{"kind": "generate", "prompt_ids": [int], "response_ids": [int], "log_probs": [float],
  "stop_reason": "completed" | "length" | "aborted", "start_s", "end_s", "version": <int>,
  "temperature": <float>, "max_tokens": <int | null>, "request_id": <str>, "pid": <int>}``:
  one per generate call. ``log_probs`` are the sampled tokens' log-probs at ``temperature``;
  ``version`` is the weight version the call was generated with (the training step).
* ``{"kind": "reward", "data_source", "ground_truth", "index", "solution_str", "score": <float>,
  "result": <the reward function's dict or number>, "start_s", "landed_s", "pid"}``: one per
  scored trajectory; ``landed_s`` is when the reward was returned, ``index`` the dataset's
  ``extra_info.index``.

How to record (use a new path per recording run: an existing file is appended to):

* rollout: ``+actor_rollout_ref.rollout.engine_kwargs.hf_cpu.record_path=/abs/rec.jsonl``
  (or the environment variable ``THUNDERSYNC_RECORD_PATH`` in the processes that run the server);
* rewards: ``reward.custom_reward_function.path=pkg://thundersync_verl.backends.replay.record``,
  ``reward.custom_reward_function.name=record_compute_score_async`` and
  ``+reward.custom_reward_function.reward_kwargs.record_path=/abs/rec.jsonl``; the wrapped
  function is ``thundersync_verl.envs.reward:compute_score_async`` unless ``record_inner``
  (``"module:function"`` or ``"/path/file.py:function"``) names another; it receives the other
  reward kwargs.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import logging
import os
import time
from typing import Any, Mapping, Optional

logger = logging.getLogger(__name__)
FORMAT = "thundersync-replay/1"
RECORD_ENV = "THUNDERSYNC_RECORD_PATH"
RECORD_KWARG = "record_path"
INNER_KWARG = "record_inner"
DEFAULT_INNER = "thundersync_verl.envs.reward:compute_score_async"
ROLLOUT_SECTION = "hf_cpu"  # actor_rollout_ref.rollout.engine_kwargs.<this>.record_path


def _plain(value):
    """JSON fallback for numpy scalars / arrays that reward functions and verl hand around."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to a replay record")


def engine_section(config, name: str) -> dict:
    """``config.engine_kwargs[name]`` as a plain dict (rollout configs arrive as dataclasses or DictConfigs)."""
    kwargs = getattr(config, "engine_kwargs", None)
    if kwargs is None and isinstance(config, Mapping):
        kwargs = config.get("engine_kwargs")
    section = kwargs.get(name) if kwargs is not None else None
    return {str(k): v for k, v in (section or {}).items()}


def trajectory_key(data_source, ground_truth, index, solution_str: str) -> str:
    """What identifies a trajectory to the reward function (it never sees token ids)."""
    return json.dumps([str(data_source), ground_truth, index, solution_str], default=_plain, sort_keys=True)


def dataset_index(extra_info: Optional[Mapping[str, Any]]):
    index = (extra_info or {}).get("index")
    return int(index) if index is not None else None


class RecordFile:
    """An append-only JSONL recording shared by every process that writes it."""

    def __init__(self, path: str):
        self.path = os.path.abspath(os.path.expanduser(str(path)))
        self._t0: Optional[float] = None

    def origin(self, now: float) -> float:
        """The recording's ``t0_unix``; the first caller (any process) creates the file with ``now``."""
        if self._t0 is not None:
            return self._t0
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            self._t0 = self._read_origin()
        else:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({"kind": "header", "format": FORMAT, "t0_unix": now}) + "\n")
            self._t0 = now
        return self._t0

    def _read_origin(self) -> float:
        for _ in range(200):  # the creating process writes its header right after O_EXCL succeeds
            with open(self.path) as f:
                first = f.readline()
            if first.endswith("\n"):
                header = json.loads(first)
                if header.get("kind") != "header" or header.get("format") != FORMAT:
                    raise ValueError(
                        f"{self.path} exists and is not a replay recording (first line: {first[:120]!r}); "
                        "record to a new path"
                    )
                return float(header["t0_unix"])
            time.sleep(0.01)
        raise TimeoutError(f"{self.path} has no header line after 2 s; delete it and record again")

    def append(self, record: dict) -> None:
        line = (json.dumps(record, default=_plain) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, line)  # one write per line: concurrent writers never interleave inside a line
        finally:
            os.close(fd)


class GenerateRecorder:
    """The rollout server's hook: ``clock()`` when a call starts, ``generation(...)`` when it ends."""

    def __init__(self, path: str):
        self.file = RecordFile(path)
        self._last = 0.0
        if os.path.exists(self.file.path):
            logger.warning("replay recording %s already exists; this run's generate calls are appended to it "
                           "(record to a new path to keep runs apart)", self.file.path)

    @classmethod
    def from_config(cls, config, section: str = ROLLOUT_SECTION, use_env: bool = True) -> Optional["GenerateRecorder"]:
        """A recorder when ``engine_kwargs.<section>.record_path`` (or ``$THUNDERSYNC_RECORD_PATH``) is set, else None."""
        path = engine_section(config, section).get(RECORD_KWARG) or (os.environ.get(RECORD_ENV) if use_env else None)
        return cls(path) if path else None

    def clock(self) -> float:
        """A call's start time, strictly increasing in this process: replay serves calls in start order."""
        now = max(time.time(), self._last + 1e-6)
        self._last = now
        self.file.origin(now)
        return now

    def generation(self, *, request_id, prompt_ids, sampling_params: Mapping[str, Any], gen, start: float) -> None:
        """Append one ``generate`` record; ``gen`` has token_ids, log_probs, stop_reason, max_version."""
        t0 = self.file.origin(start)
        params = sampling_params or {}
        max_tokens = params.get("max_tokens", params.get("max_new_tokens"))
        self.file.append({
            "kind": "generate",
            "request_id": str(request_id),
            "prompt_ids": [int(t) for t in prompt_ids],
            "response_ids": [int(t) for t in gen.token_ids],
            "log_probs": [float(x) for x in (gen.log_probs or [])],
            "stop_reason": str(gen.stop_reason),
            "start_s": start - t0,
            "end_s": time.time() - t0,
            "version": int(gen.max_version or 0),
            "temperature": float(params.get("temperature", 1.0)),
            "max_tokens": int(max_tokens) if max_tokens is not None else None,
            "pid": os.getpid(),
        })


def _load_inner(spec: str):
    """``"package.module:function"`` or ``"/path/to/file.py:function"`` (a file, like verl's reward path)."""
    module_name, _, fn_name = str(spec).rpartition(":")
    if not module_name or not fn_name:
        raise ValueError(f"{INNER_KWARG}={spec!r} must be 'module:function' or '/path/file.py:function', "
                         f"e.g. {DEFAULT_INNER!r}")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise FileNotFoundError(f"{INNER_KWARG}={spec!r}: {module_name} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"_recorded_reward_{abs(hash(module_name))}", module_name)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    if not hasattr(module, fn_name):
        raise AttributeError(f"{INNER_KWARG}={spec!r}: {module_name} has no function {fn_name!r}")
    return getattr(module, fn_name)


_FILES: dict[str, RecordFile] = {}
_INNERS: dict[str, Any] = {}


async def record_compute_score_async(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: Optional[Mapping[str, Any]] = None,
    **kwargs: Any,
):
    """verl custom reward function: call the wrapped reward, append a ``reward`` record, return its result.

    ``record_path`` (reward kwarg) or ``$THUNDERSYNC_RECORD_PATH`` is the recording; ``record_inner``
    names the wrapped function (default :data:`DEFAULT_INNER`); every other kwarg goes to it.
    """
    path = kwargs.pop(RECORD_KWARG, None) or os.environ.get(RECORD_ENV)
    spec = kwargs.pop(INNER_KWARG, None) or DEFAULT_INNER
    inner = _INNERS.get(spec) or _INNERS.setdefault(spec, _load_inner(spec))
    if not path:
        raise ValueError(
            "record_compute_score_async needs a recording path: set "
            f"+reward.custom_reward_function.reward_kwargs.{RECORD_KWARG}=/abs/rec.jsonl (or ${RECORD_ENV})"
        )
    record_file = _FILES.setdefault(os.path.abspath(path), RecordFile(path))
    start = time.time()
    t0 = record_file.origin(start)
    args = dict(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)
    if inspect.iscoroutinefunction(inner):
        result = await inner(**args, **kwargs)
    else:  # a blocking reward runs in a thread, as verl runs it, so concurrent trajectories are scored concurrently
        result = await asyncio.to_thread(inner, **args, **kwargs)
    landed = time.time()
    score = result["score"] if isinstance(result, Mapping) else result
    record_file.append({
        "kind": "reward",
        "data_source": str(data_source),
        "ground_truth": ground_truth,
        "index": dataset_index(extra_info),
        "solution_str": solution_str,
        "score": float(score),
        "result": dict(result) if isinstance(result, Mapping) else float(result),
        "start_s": start - t0,
        "landed_s": landed - t0,
        "pid": os.getpid(),
    })
    return result


def record_compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Blocking :func:`record_compute_score_async` (for verl's thread-pool reward path)."""
    return asyncio.run(record_compute_score_async(data_source, solution_str, ground_truth, extra_info, **kwargs))
