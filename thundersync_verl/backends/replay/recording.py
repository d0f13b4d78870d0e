"""A loaded recording (format: :mod:`thundersync_verl.backends.replay.record`), indexed for replay.

Why it is shaped like this:
1. A replayed call must get *its* recorded answer: generate calls are keyed by the exact prompt
   ids, and the k-th call with a prompt gets the k-th recorded call with it (recorded order =
   order of the calls' start times), so the n samples of a GRPO group come back in the order
   they were generated. Rewards are keyed the same way by what the reward function sees
   (data source, ground truth, dataset index, decoded response).
2. The server controls how long a call takes, not when it arrives (that is the agent loop's and
   the tools' business), so timing is replayed as each call's recorded service time
   ``end_s - start_s`` (times ``time_scale``). Calls that arrive together, like the first turns of
   a batch, then complete in the recorded order with the recorded gaps.
3. ``permute_seed`` shuffles the service times among the calls of one weight version (one
   training step) with a seeded RNG, so the completion order is a reproducible permutation of
   the recorded one while the set of latencies, and every token, stays the same.
4. Anything unrecorded is an error that names the file and how to record it: a silent fallback
   would train on something else than the recording and defeat the point of replaying.
5. ``repeat``: a prompt asked for more often than it was recorded serves its recorded answers again, in
   recorded order (call k gets answer k mod the recorded count). Tail batching runs a deferred prompt again as
   a new group; replayed, the new group is the first run's answers, service times included.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import threading
from collections import defaultdict
from typing import Any, Optional

from thundersync_verl.backends.replay.record import FORMAT, trajectory_key

HOW_TO_RECORD = (
    "record it with the hf_cpu rollout and the same data/config: "
    "+actor_rollout_ref.rollout.engine_kwargs.hf_cpu.record_path=<file> for generate calls and "
    "reward.custom_reward_function.{path=pkg://thundersync_verl.backends.replay.record,"
    "name=record_compute_score_async} with +reward.custom_reward_function.reward_kwargs.record_path=<file> "
    "for rewards (see the docstring of thundersync_verl/backends/replay/record.py)"
)


class ReplayMissError(KeyError):
    """A call or trajectory the recording does not hold."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class GenerateRecord:
    prompt_ids: tuple[int, ...]
    response_ids: list[int]
    log_probs: list[float]
    stop_reason: str
    start_s: float
    end_s: float
    version: int
    temperature: float
    max_tokens: Optional[int]
    line: int  # 1-based line in the file, for error messages

    @property
    def service_s(self) -> float:
        return max(0.0, self.end_s - self.start_s)


@dataclasses.dataclass(frozen=True)
class RewardRecord:
    key: str
    score: float
    result: Any
    start_s: float
    landed_s: float
    line: int

    @property
    def latency_s(self) -> float:
        return max(0.0, self.landed_s - self.start_s)


class Recording:
    """Every record of one file, with per-key cursors (``next_generate`` / ``next_reward`` consume)."""

    def __init__(self, path: str, *, permute_seed: Optional[int] = None, repeat: bool = False):
        self.path = os.path.abspath(os.path.expanduser(str(path)))
        self.repeat = repeat  # a prompt asked for more often than recorded starts over (point 5)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"replay recording {self.path} does not exist; {HOW_TO_RECORD}")
        self.generates: dict[tuple[int, ...], list[GenerateRecord]] = defaultdict(list)
        self.rewards: dict[str, list[RewardRecord]] = defaultdict(list)
        self.t0_unix: Optional[float] = None
        self._load()
        for records in self.generates.values():
            records.sort(key=lambda r: (r.start_s, r.line))
        for records in self.rewards.values():
            records.sort(key=lambda r: (r.start_s, r.line))
        self._gen_cursor: dict[tuple[int, ...], int] = defaultdict(int)
        self._reward_cursor: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()  # the blocking reward path calls from a thread pool
        self.service_s = self._service_plan(permute_seed)

    # -- loading --------------------------------------------------------------------------
    def _load(self) -> None:
        with open(self.path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{self.path}:{line_no} is not JSON ({e}); was the recording cut short? record again") from None
                kind = rec.get("kind")
                if kind == "header":
                    if rec.get("format") != FORMAT:
                        raise ValueError(f"{self.path}:{line_no}: format {rec.get('format')!r}, this replay reads {FORMAT!r}")
                    self.t0_unix = float(rec["t0_unix"])
                elif kind == "generate":
                    r = GenerateRecord(
                        prompt_ids=tuple(int(t) for t in rec["prompt_ids"]), response_ids=[int(t) for t in rec["response_ids"]],
                        log_probs=[float(x) for x in rec["log_probs"]], stop_reason=str(rec["stop_reason"]),
                        start_s=float(rec["start_s"]), end_s=float(rec["end_s"]), version=int(rec.get("version") or 0),
                        temperature=float(rec.get("temperature", 1.0)), max_tokens=rec.get("max_tokens"), line=line_no)
                    self.generates[r.prompt_ids].append(r)
                elif kind == "reward":
                    key = trajectory_key(rec["data_source"], rec["ground_truth"], rec["index"], rec["solution_str"])
                    self.rewards[key].append(RewardRecord(key, float(rec["score"]), rec["result"], float(rec["start_s"]),
                                                          float(rec["landed_s"]), line_no))
                else:
                    raise ValueError(f"{self.path}:{line_no}: unknown record kind {kind!r} (expected header/generate/reward)")
        if self.t0_unix is None:
            raise ValueError(f"{self.path} has no header line, so it is not a replay recording; {HOW_TO_RECORD}")

    def _service_plan(self, permute_seed: Optional[int]) -> dict[int, float]:
        """Service time per generate record (by line): recorded, or shuffled within each weight version."""
        plan = {r.line: r.service_s for records in self.generates.values() for r in records}
        if permute_seed is None:
            return plan
        by_version: dict[int, list[GenerateRecord]] = defaultdict(list)
        for records in self.generates.values():
            for r in records:
                by_version[r.version].append(r)
        for version, records in sorted(by_version.items()):
            records.sort(key=lambda r: r.line)
            times = [r.service_s for r in records]
            random.Random(f"{int(permute_seed)}:{version}").shuffle(times)
            plan.update({r.line: t for r, t in zip(records, times)})
        return plan

    # -- lookups --------------------------------------------------------------------------
    @property
    def num_generates(self) -> int:
        return sum(len(v) for v in self.generates.values())

    @property
    def num_rewards(self) -> int:
        return sum(len(v) for v in self.rewards.values())

    def next_generate(self, prompt_ids, *, temperature: Optional[float] = None,
                      max_tokens: Optional[int] = None, min_version: Optional[int] = None) -> GenerateRecord:
        """The next recorded answer to exactly ``prompt_ids``; checks the request can have produced it.

        ``min_version`` (a run resumed at that weight version): answers recorded at older weight versions
        belong to the steps before the checkpoint, which the interrupted run consumed, so they are passed over.
        """
        with self._lock:
            return self._next_generate(prompt_ids, temperature, max_tokens, min_version)

    def _next_generate(self, prompt_ids, temperature, max_tokens, min_version=None) -> GenerateRecord:
        key = tuple(int(t) for t in prompt_ids)
        records = self.generates.get(key)
        if not records:
            raise ReplayMissError(
                f"replay: no generate call with this prompt ({len(key)} tokens, starting {list(key[:8])}) is recorded in "
                f"{self.path} ({self.num_generates} calls, {len(self.generates)} distinct prompts); {HOW_TO_RECORD}"
            )
        k = self._gen_cursor[key]
        while min_version is not None and k < len(records) and records[k].version < min_version:
            k += 1  # recorded before the checkpoint this run resumed from
        if k >= len(records) and not (self.repeat and records):
            raise ReplayMissError(
                f"replay: this prompt ({len(key)} tokens, starting {list(key[:8])}) was recorded {len(records)} time(s) in "
                f"{self.path} and is asked for a {k + 1}th time; record as many steps and samples (rollout.n) as you replay"
            )
        rec = records[k % len(records)]
        if temperature is not None and abs(float(temperature) - rec.temperature) > 1e-9:
            raise ValueError(
                f"replay: {self.path}:{rec.line} was generated at temperature {rec.temperature} but is requested at "
                f"{temperature}; its log-probs are only right at the recorded temperature: use the recording's sampling config"
            )
        if max_tokens is not None and len(rec.response_ids) > int(max_tokens):
            raise ValueError(
                f"replay: {self.path}:{rec.line} holds {len(rec.response_ids)} response tokens but the request allows "
                f"max_tokens={max_tokens}; replay with the recording's data.max_response_length"
            )
        self._gen_cursor[key] = k + 1
        return rec

    def next_reward(self, data_source, ground_truth, index, solution_str: str) -> RewardRecord:
        """The next recorded reward of this trajectory."""
        with self._lock:
            return self._next_reward(data_source, ground_truth, index, solution_str)

    def _next_reward(self, data_source, ground_truth, index, solution_str: str) -> RewardRecord:
        key = trajectory_key(data_source, ground_truth, index, solution_str)
        records = self.rewards.get(key)
        if not records:
            raise ReplayMissError(
                f"replay: no reward is recorded in {self.path} for the trajectory of dataset index {index} "
                f"(data_source {data_source!r}, response {solution_str[:60]!r}...; {self.num_rewards} rewards recorded); "
                f"{HOW_TO_RECORD}"
            )
        k = self._reward_cursor[key]
        if k >= len(records):
            raise ReplayMissError(
                f"replay: the trajectory of dataset index {index} was scored {len(records)} time(s) in {self.path} and is "
                f"asked for a {k + 1}th time; record as many steps and samples as you replay"
            )
        self._reward_cursor[key] = k + 1
        return records[k]
