"""PACE's measured drift: the rollout servers re-score a finished trajectory with the weights they hold now.

Why this module exists:
1. ``core/pace.py``'s formula (3m) needs log pi_r(y_t | y_<t) for every generated token under a policy
   newer than the one that generated it. In verl's separate-async trainer the replay buffer runs in
   the trainer's process with no handle on the learner's workers; the rollout servers, though, are
   named Ray actors that answer verl's own teacher-scoring request (``sampling_params`` with
   ``prompt_logprobs=0``: every token's log-prob given its prefix, plus a one-token generation), and
   they hold the newest pushed weights: in separate_async the standalone servers receive version s at
   the end of step s, so at the next step's samples they hold pi_v exactly (v = the learner version).
2. ``RolloutServerScorer`` finds those servers by actor-name prefix (``hf_cpu_server_`` for this
   package's CPU rollout; verl's vLLM servers answer the same request), asks each for its weight
   version with a two-token probe, sends the batch to the newest one and returns each response's
   log-probs with the version that scored them. A server that does not answer the probe within
   ``PROBE_TIMEOUT_S`` is parked (a hybrid replica lent back to the learner parks its requests until
   it is switched to rollout again, and keeps its old weights meanwhile) and left out from then on;
   the standalone servers receive every push, so nothing newer is lost.
3. Cost: one prefill of prompt + response per trajectory, once (when its group is first seen finished;
   the sampler caches the result), on a rollout server (competing with generation) and on the
   trainer's sample path (the learner waits for it). Off by default (``pace.scorer=none``).
4. The servers' prompt log-probs are at temperature 1 (vLLM's and hf_cpu's), the rollout's at the
   rollout temperature: the measured drift compares like with like only at temperature 1, the
   default of ``actor_rollout_ref.rollout.temperature``; the sampler refuses another temperature at
   construction when verl builds it from a trainer (``verl_adapter.rollout_temperature_of``).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Protocol, Sequence

import torch

from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError, rule_message

SCORE_PARAMS = {"prompt_logprobs": 0, "max_tokens": 1, "temperature": 1.0}
DEFAULT_SERVER_PREFIX = "hf_cpu_server_"
NOT_ROLLOUT = ("teacher", "reward")  # servers of other models that share the name prefix
PROBE_TIMEOUT_S = 5.0  # a server answering no two-token request in this time is parked


class ServerEndpoint(Protocol):
    """One rollout server: ``sequences`` -> per sequence (the log-prob row of each token given its
    prefix, verl's ``prompt_logprobs`` layout flattened; the weight version that scored it)."""

    name: str

    def prompt_logprobs(self, sequences: list[list[int]],
                        timeout_s: float | None = None) -> list[tuple[list[float], int | None]]:
        """Raises ``TimeoutError`` when ``timeout_s`` passes before every answer."""


def _parse(output) -> tuple[list[float], int | None]:
    """verl's teacher reply: row p is token p+1's log-prob given tokens <= p; the last row is padding."""
    extra = getattr(output, "extra_fields", None) or {}
    rows = extra.get("prompt_logprobs")
    if rows is None:
        raise StreamingInputError(rule_message(
            "the rollout server answered a scoring request without prompt_logprobs",
            "PACE's measured drift needs every generated token's log-prob under the server's weights",
            "use a rollout server that implements verl's teacher scoring (hf_cpu, vllm), or set pace.scorer=none"))
    version = extra.get("global_steps")
    return [float(r[0]) for r in rows], (None if version is None else int(version))


class RayServerEndpoint:
    """A rollout server reached through its Ray actor handle."""

    def __init__(self, name: str, handle):
        self.name, self.handle = name, handle

    def prompt_logprobs(self, sequences: list[list[int]],
                        timeout_s: float | None = None) -> list[tuple[list[float], int | None]]:
        import ray

        refs = [self.handle.generate.remote(prompt_ids=list(ids), sampling_params=dict(SCORE_PARAMS),
                                            request_id=f"pace-{uuid.uuid4().hex}") for ids in sequences]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            for ref in pending:
                ray.cancel(ref)  # the parked request would otherwise run when the server resumes
            raise TimeoutError(f"{self.name} answered {len(refs) - len(pending)} of {len(refs)} in {timeout_s} s")
        return [_parse(out) for out in ray.get(refs)]


class InProcessServerEndpoint:
    """A server object living in this process (the same ``generate`` call, without Ray), driven by an
    event loop of its own: a parked server's pause event stays bound to the loop that first waited on it."""

    def __init__(self, server, name: str = "in_process"):
        self.name, self.server = name, server
        self.loop = asyncio.new_event_loop()

    def prompt_logprobs(self, sequences: list[list[int]],
                        timeout_s: float | None = None) -> list[tuple[list[float], int | None]]:
        async def run():
            return await asyncio.wait_for(asyncio.gather(*[
                self.server.generate(prompt_ids=list(ids), sampling_params=dict(SCORE_PARAMS),
                                     request_id=f"pace-{uuid.uuid4().hex}") for ids in sequences]), timeout_s)

        return [_parse(out) for out in self.loop.run_until_complete(run())]


def discover_servers(prefix: str = DEFAULT_SERVER_PREFIX) -> list[RayServerEndpoint]:
    """The rollout servers of this Ray job whose actor name starts with ``prefix`` (teachers left out)."""
    import ray

    names = sorted(n for n in ray.util.list_named_actors()
                   if n.startswith(prefix) and not any(w in n for w in NOT_ROLLOUT))
    if not names:
        raise StreamingConfigError(rule_message(
            f"PACE's scorer found no rollout server actor named {prefix}*",
            "the measured drift re-scores trajectories on the rollout servers, found by their Ray actor names",
            "set pace.scorer_server_prefix to the rollout's actor names (hf_cpu_server_, vllm_server_), "
            "or pace.scorer=none for the version-count proxy"))
    return [RayServerEndpoint(n, ray.get_actor(n)) for n in names]


class RolloutServerScorer:
    """Re-scores (prompt, response) pairs on the rollout server holding the newest weights."""

    def __init__(self, endpoints: Sequence[ServerEndpoint], probe_timeout_s: float = PROBE_TIMEOUT_S):
        self.endpoints = list(endpoints)
        self.probe_timeout_s = probe_timeout_s
        self.parked: set[str] = set()  # endpoints that did not answer a probe: left out from then on
        self.calls = 0
        self.sequences = 0

    @classmethod
    def discover(cls, prefix: str = DEFAULT_SERVER_PREFIX) -> "RolloutServerScorer":
        return cls(discover_servers(prefix))

    def _newest(self, probe: list[int]) -> ServerEndpoint:
        """With several servers (hybrid replicas keep old weights while the learner trains): the newest."""
        live = [ep for ep in self.endpoints if ep.name not in self.parked]
        if len(live) == 1:
            return live[0]
        answered = []
        for ep in live:
            try:
                answered.append((ep.prompt_logprobs([probe], timeout_s=self.probe_timeout_s)[0][1], ep))
            except (TimeoutError, asyncio.TimeoutError):
                self.parked.add(ep.name)
        if not answered:
            raise StreamingInputError(rule_message(
                f"no rollout server answered PACE's scoring probe within {self.probe_timeout_s} s "
                f"(parked: {sorted(self.parked)})",
                "the measured drift needs a server that holds the current weights and serves requests",
                "check that the standalone rollout servers run, or set pace.scorer=none"))
        return max(answered, key=lambda a: -1 if a[0] is None else a[0])[1]

    def score(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[list[torch.Tensor], int | None]:
        """Per ``(prompt_ids, response_ids)``: the response tokens' log-probs [R] given their prefix under the
        server's weights; and the newest weight version that scored them (None if the server does not say)."""
        if not rows:
            return [], None
        for prompt, _ in rows:
            if len(prompt) < 1:
                raise StreamingInputError(rule_message(
                    "a trajectory to re-score has an empty prompt",
                    "the first response token's log-prob is conditioned on the prompt",
                    "check the stored prompts of the trajectory"))
        endpoint = self._newest((list(rows[0][0]) + list(rows[0][1]))[:2])
        replies = endpoint.prompt_logprobs([list(p) + list(r) for p, r in rows])
        self.calls += 1
        self.sequences += len(rows)
        out = []
        for (prompt, response), (flat, _) in zip(rows, replies):
            start = len(prompt) - 1  # row of the first response token
            out.append(torch.tensor(flat[start:start + len(response)], dtype=torch.float64))  # [R]
        versions = [v for _, v in replies if v is not None]
        return out, (max(versions) if versions else None)
