"""Agent loop ``thundersync_swe_agent``: a ReAct SWE agent on verl's agent-loop API, scored by the tests.

1. Registered with verl's ``@register`` like the embedded tool agent (``envs/agent_loop.py``), so any
   trainer mode that runs verl's AgentLoopWorker runs it; rows select it with ``agent_name``.
2. Per trajectory: a workspace from ``swe.sandbox`` (``backends.py``) whose start-up is launched when the
   trajectory starts and awaited at the first tool call, so it overlaps the first generation (the wait
   that is left is recorded as ``sandbox_start_wait_s``). Each turn
   generates on the rollout server, runs the one tool it calls (``tools.py``) and appends the tool turn
   with response_mask 0 (observations are not trained on, as in verl's tool agent). The loop ends on
   ``submit``, a turn without a tool call, ``swe.max_turns``, or the context budget (``swe.max_context``
   and rollout.response_length); an observation no further action could read is not appended, so a
   trajectory always ends on an action.
3. Then the verifier (``verifier.py``) runs FAIL_TO_PASS / PASS_TO_PASS in the same workspace and the
   loop returns the reward itself (``reward_score``, which verl's worker keeps instead of calling a
   reward function) with the verdict as ``reward_extra_info``: test time, counts and reason per
   trajectory. A failed start or verifier gives reward 0 with the reason, never a lost row; the
   workspace is closed in a ``finally`` (cancellation included).
4. ThunderSync OPD runs: each finished turn is scored by the teacher and published while the tool runs,
   exactly as the embedded agent does (``algos/opd/turn_teacher.py``); the turn boundary is the tool call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thundersync_verl import verl_adapter as va
from thundersync_verl.config import ThunderSyncConfig
from thundersync_verl.algos.opd.turn_teacher import TURN_COUNT_KEY, AgentTurnTeacher, trajectory_key
from thundersync_verl.envs.agent_loop import _append_trace, _settle
from thundersync_verl.envs.abort import AbortCheck, quiet_aborted_sessions
from thundersync_verl.envs.swe import tools
from thundersync_verl.envs.swe import swe_protocol as protocol
from thundersync_verl.envs.swe import swe_verifier as verifier
from thundersync_verl.envs.swe.backends import open_workspace
from thundersync_verl.envs.swe.swe_config import SWEConfig
from thundersync_verl.envs.swe.instance import instance_from_extra_info
from thundersync_verl.envs.swe.swe_sandbox import Workspace
from thundersync_verl.verl_adapter.patches import TEACHER_REUSED_KEY

logger = logging.getLogger(__name__)


@dataclass
class Episode:
    """One trajectory's growing sequence and its per-turn record."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    scoring: list[asyncio.Task] = field(default_factory=list)  # OPD: one teacher call per finished turn
    submitted: bool = False
    start_wait_s: float | None = None  # how long the first use of the workspace waited for its start

    def append(self, ids: list[int], *, trained: bool, logprobs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.response_mask += [1 if trained else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs and len(logprobs) == len(ids) else [0.0] * len(ids)


def repos_dir_for(settings: SWEConfig, config) -> Path | None:
    """``swe.repos_dir``, else ``repos/`` next to the first training file (where swe_synthetic puts it)."""
    if settings.repos_dir:
        return Path(settings.repos_dir)
    files = config.get("data", {}).get("train_files") if hasattr(config, "get") else None
    first = files if isinstance(files, str) else (list(files)[0] if files else None)
    return Path(str(first)).parent / "repos" if first else None


@va.register_agent_loop(protocol.AGENT_NAME)
class SWEAgentLoop(va.agent_loop_base()):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = SWEConfig.from_verl(self.config)  # the swe section, typed and checked
        self.response_length = int(self.rollout_config.response_length)
        self.max_context = self.settings.max_context or int(self.rollout_config.prompt_length) + self.response_length
        self.repos_dir = repos_dir_for(self.settings, self.config)
        self.turn_teacher = AgentTurnTeacher.for_agent_loop(self.config, self.server_manager)  # None unless OPD
        tail = ThunderSyncConfig.from_verl(self.config).tail.enabled
        self.abort = AbortCheck(tail, self.rollout_config.name)  # tail batching: stop on the group's abort (envs/abort.py)
        if tail:
            quiet_aborted_sessions(va.agent_loop_session_loggers())

    async def run(self, sampling_params: dict[str, Any], **kwargs):
        key = trajectory_key(kwargs.get("uid"), kwargs.get("session_id"))
        instance = instance_from_extra_info(kwargs.get("extra_info"))
        workspace = open_workspace(self.settings, instance, repos_dir=self.repos_dir)
        starting = asyncio.create_task(_start(workspace))  # overlaps the first generation (point 2)
        try:
            return await self._run(sampling_params, workspace, starting, key, kwargs)
        except BaseException:
            if self.turn_teacher is not None:  # no whole-trajectory question will come for this one
                self.turn_teacher.forget(key)
            raise
        finally:
            await _shutdown(workspace, starting)

    async def _run(self, sampling_params, workspace: Workspace, starting: asyncio.Task, key: str, kwargs):
        t_submit = time.time()
        ep = Episode(await self.ct_build_initial_tokens(list(kwargs["raw_prompt"])))
        request_id = uuid.uuid4().hex
        for turn_index in range(self.settings.max_turns):
            budget = self._budget(ep)
            if budget <= 0:
                break
            action_start = await self.abort.unless_aborted(kwargs.get("uid"), self._generate(
                ep, sampling_params, budget, request_id, key,
                self.abort.server_kwargs(kwargs.get("uid"))))
            action = protocol.parse_action(self.tokenizer.decode(ep.response_ids[action_start:], skip_special_tokens=False))
            if action is None:
                break
            result = await self.abort.unless_aborted(kwargs.get("uid"), self._act(action, workspace, starting, ep))
            ep.turns[-1].update(tool_s=result.duration_s, tool=getattr(action, "name", "invalid"), tool_kind=result.kind)
            if result.submitted:
                ep.submitted = True
                break
            observation = self.tokenizer.encode(protocol.tool_turn_text(result.text), add_special_tokens=False)
            if turn_index + 1 >= self.settings.max_turns or self._budget(ep, len(observation)) <= 0:
                break  # a tool turn only when another action will read it: the trajectory ends on an action
            ep.append(observation, trained=False)
        verdict = await self._verify(workspace, starting, ep)
        return await self._output(ep, verdict, workspace, t_submit, key, kwargs)

    def _budget(self, ep: Episode, pending: int = 0) -> int:
        """Tokens the next action may take after ``pending`` more observation tokens (response and context limits)."""
        used = len(ep.response_ids) + pending
        return min(self.response_length - used, self.max_context - len(ep.prompt_ids) - used)

    async def _generate(self, ep: Episode, sampling_params, budget: int, request_id: str, key: str,
                        extra: dict | None = None) -> int:
        """One assistant turn appended (trained); its teacher scoring launched in OPD runs; returns where it starts.
        ``extra``: keyword arguments for the server (``envs/abort.generate_kwargs``)."""
        t0 = time.time()
        out = await self.server_manager.generate(request_id=request_id, prompt_ids=ep.prompt_ids + ep.response_ids,
                                                 sampling_params={**sampling_params, "max_tokens": budget},
                                                 **(extra or {}))
        ep.turns.append({"gen_s": time.time() - t0, "gen_tokens": len(out.token_ids),
                         "prompt_tokens": len(ep.prompt_ids) + len(ep.response_ids), "tool_s": 0.0})
        ep.versions += [int(out.extra_fields.get("min_global_steps") or 0), int(out.extra_fields.get("max_global_steps") or 0)]
        action_start = len(ep.response_ids)
        ep.append(list(out.token_ids), trained=True, logprobs=out.log_probs)
        end = min(len(ep.response_ids), self.response_length)
        if self.turn_teacher is not None and action_start < end:
            ep.scoring.append(asyncio.create_task(self.turn_teacher.score_and_publish(
                key, len(ep.scoring), ep.prompt_ids, ep.response_ids[: self.response_length], action_start,
                rollout_log_probs=ep.logprobs[action_start:end])))
        return action_start

    async def _act(self, action, workspace: Workspace, starting: asyncio.Task, ep: Episode) -> tools.ToolResult:
        """The tool call's result; the first one waits for the workspace start-up (point 2)."""
        ready, why = await _ready(starting, ep)
        return await tools.execute(action, workspace if ready else None, timeout_s=self.settings.tool_timeout_s,
                                   max_chars=self.settings.max_observation_chars, unavailable=why)

    async def _verify(self, workspace: Workspace, starting: asyncio.Task, ep: Episode) -> verifier.TestVerdict:
        ready, why = await _ready(starting, ep)
        if not ready:
            logger.warning("%s: workspace failed to start, scoring 0.0: %s", workspace.instance.instance_id, why)
            return verifier.TestVerdict(0.0, f"workspace failed to start: {why}")
        snapshot = starting.result()
        return await verifier.verify(workspace, workspace.instance, snapshot, command=self.settings.test_command,
                                     timeout_s=self.settings.verifier_timeout_s)

    async def _output(self, ep: Episode, verdict: verifier.TestVerdict, workspace: Workspace, t_submit: float,
                      key: str, kwargs):
        if ep.scoring:
            await _settle(ep.scoring)  # turns are published before the trajectory lands
        n = self.response_length
        record = {"t_submit": t_submit, "t_done": time.time(), "turns": ep.turns, "response_tokens": len(ep.response_ids),
                  "prompt_tokens": len(ep.prompt_ids), "policy_version": min(ep.versions) if ep.versions else 0,
                  "uid": kwargs.get("uid"), "session_id": kwargs.get("session_id"),
                  "instance_id": workspace.instance.instance_id, "sandbox": workspace.backend,
                  "sandbox_start_s": workspace.start_s, "sandbox_start_wait_s": ep.start_wait_s,
                  "submitted": ep.submitted, **verdict.extra()}
        _append_trace(self.settings.trace_path, record)
        extra = {"turn_scores": [], "tool_rewards": [], "thundersync_events": record,
                 "min_global_steps": min(ep.versions) if ep.versions else 0,
                 "max_global_steps": max(ep.versions) if ep.versions else 0,
                 "reward_extra_info": {**verdict.extra(), "submitted": ep.submitted, "turns": len(ep.turns)}}
        if self.turn_teacher is not None:
            extra[TURN_COUNT_KEY] = len(ep.scoring)
            reply = self.turn_teacher.whole_trajectory_reply(key, ep.prompt_ids + ep.response_ids[:n])
            if reply is not None:  # verl's whole-trajectory teacher call would repeat the last turn's (verl_adapter.patches)
                extra.update(reply)
                extra[TEACHER_REUSED_KEY] = True
            record["teacher_reused"] = reply is not None
        metrics = {"generate_sequences": sum(t["gen_s"] for t in ep.turns),
                   "tool_calls": sum(t["tool_s"] for t in ep.turns), "num_preempted": -1}
        return va.agent_loop_output_cls()(
            prompt_ids=ep.prompt_ids, response_ids=ep.response_ids[:n], response_mask=ep.response_mask[:n],
            response_logprobs=ep.logprobs[:n], reward_score=float(verdict.score), num_turns=2 * len(ep.turns) + 1,
            metrics=metrics, extra_fields=extra)


async def _start(workspace: Workspace) -> dict:
    """Start the workspace and keep its test files as they started (the verifier restores them)."""
    await workspace.start()
    return await verifier.snapshot_tests(workspace, workspace.instance)


async def _ready(starting: asyncio.Task, ep: Episode | None = None) -> tuple[bool, str]:
    """Whether the workspace started; the reason when it did not (awaiting a finished task is free). The
    first wait is kept in ``ep.start_wait_s``: near 0 when the start hid behind the first generation."""
    t0 = time.perf_counter()
    try:
        await asyncio.shield(starting)
        return True, ""
    except asyncio.CancelledError:
        if starting.cancelled():
            return False, "start-up was cancelled"
        raise
    except Exception as exc:  # noqa: BLE001 - reported to the model and in the reward reason
        return False, f"{type(exc).__name__}: {exc}"
    finally:
        if ep is not None and ep.start_wait_s is None:
            ep.start_wait_s = time.perf_counter() - t0


async def _shutdown(workspace: Workspace, starting: asyncio.Task) -> None:
    """Stop a start-up still running, then close the workspace (a container is removed)."""
    if not starting.done():
        starting.cancel()
    with contextlib.suppress(BaseException):
        await starting
    try:
        await asyncio.shield(workspace.close())
    except Exception as exc:  # noqa: BLE001 - cleanup failures are logged, the trajectory's result stands
        logger.warning("closing the workspace of %s failed: %s", workspace.instance.instance_id, exc)
