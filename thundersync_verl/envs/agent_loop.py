"""Agent loop ``thundersync_tool_agent``: the embedded multi-turn tool-use task inside verl's AgentLoopWorker.

1. Registered with verl's ``@register``, so datasets select it with ``agent_name``
   and verl's AgentLoopWorker runs it like its own tool agent: generate a turn on
   the rollout server, run the tool call in a real subprocess sandbox, append the
   observation (masked out of the loss), repeat until a final answer.
2. Tool latency is drawn from a heavy-tailed model (``thundersync.env.tool_latency``)
   so the long tail of agentic traces is present even on a CPU.
3. Every trajectory carries its own event record (turn timings, weight versions)
   in ``extra_fields``; trainers use it for timelines and staleness.
4. ThunderSync OPD runs (the rollout client carries the teacher clients): each finished
   turn is scored by the teacher and published while the next tool call runs
   (``algos/opd/turn_teacher.py``); the trajectory returns only after all its turns
   are published, and says how many there are. Other runs are unaffected.
5. With tail batching (``thundersync.tail``) each generate and tool call runs unless the trainer aborts the
   group (``envs/abort.py``): an aborted loop stops before its next call, and a call in flight is cut.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from typing import Any

from thundersync_verl.run import faults
from thundersync_verl import verl_adapter as va
from thundersync_verl.config import ThunderSyncConfig
from thundersync_verl.envs import protocol
from thundersync_verl.envs.abort import AbortCheck, quiet_aborted_sessions
from thundersync_verl.envs.sandbox import run_python_async
from thundersync_verl.algos.opd.turn_teacher import TURN_COUNT_KEY, AgentTurnTeacher, trajectory_key
from thundersync_verl.verl_adapter.patches import TEACHER_REUSED_KEY

def _append_trace(path, record: dict) -> None:
    """One JSON line per finished trajectory (timings for timelines and the simulator); no-op without a path."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


async def _settle(tasks: list) -> None:
    """Wait for every task; then raise the first failure (each failed turn has published its failure record)."""
    results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]


@va.register_agent_loop(protocol.AGENT_NAME)
class ThunderSyncToolAgentLoop(va.agent_loop_base()):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        ts = ThunderSyncConfig.from_verl(self.config)
        self.settings = ts.env  # thundersync.env, typed and checked
        self.abort = AbortCheck(ts.tail.enabled, self.rollout_config.name)  # tail batching: stop on the group's abort
        if ts.tail.enabled:
            quiet_aborted_sessions(va.agent_loop_session_loggers())
        self.latency = self.settings.tool_latency
        self.response_length = self.rollout_config.response_length
        self.tool_rng = random.Random()
        self.turn_teacher = AgentTurnTeacher.for_agent_loop(self.config, self.server_manager)  # None unless OPD

    async def run(self, sampling_params: dict[str, Any], **kwargs):
        try:
            return await self._run(sampling_params, **kwargs)
        except BaseException:
            if self.turn_teacher is not None:  # no whole-trajectory question will come for this one
                self.turn_teacher.forget(trajectory_key(kwargs.get("uid"), kwargs.get("session_id")))
            raise

    async def _run(self, sampling_params: dict[str, Any], **kwargs):
        t_submit = time.time()
        messages = list(kwargs["raw_prompt"])
        prompt_ids = await self.ct_build_initial_tokens(messages)
        response_ids: list[int] = []
        response_mask: list[int] = []
        logprobs: list[float] = []
        turns: list[dict] = []
        versions: list[int] = []
        request_id = uuid.uuid4().hex
        scoring: list[asyncio.Task] = []  # OPD: one teacher call per finished turn, overlapping the tools
        for _ in range(self.settings.max_tool_turns + 1):
            budget = self.response_length - len(response_ids)
            if budget <= 0:
                break
            t0 = time.time()
            out = await self.abort.unless_aborted(kwargs.get("uid"), self.server_manager.generate(
                request_id=request_id,
                prompt_ids=prompt_ids + response_ids,
                sampling_params={**sampling_params, "max_tokens": budget},
                **self.abort.server_kwargs(kwargs.get("uid")),
            ))
            turn = {"gen_s": time.time() - t0, "gen_tokens": len(out.token_ids), "prompt_tokens": len(prompt_ids) + len(response_ids), "tool_s": 0.0,
                    "min_version": int(out.extra_fields.get("min_global_steps") or 0),  # PACE's per-turn versions
                    "max_version": int(out.extra_fields.get("max_global_steps") or 0)}
            turns.append(turn)
            versions += [turn["min_version"], turn["max_version"]]
            action_start = len(response_ids)
            response_ids += out.token_ids
            response_mask += [1] * len(out.token_ids)
            logprobs += list(out.log_probs or [0.0] * len(out.token_ids))
            if self.turn_teacher is not None and action_start < min(len(response_ids), self.response_length):
                scoring.append(asyncio.create_task(self.turn_teacher.score_and_publish(
                    trajectory_key(kwargs.get("uid"), kwargs.get("session_id")), len(scoring), prompt_ids,
                    response_ids[: self.response_length], action_start,
                    rollout_log_probs=logprobs[action_start : min(len(response_ids), self.response_length)])))
            call = protocol.parse_tool_call(self.tokenizer.decode(out.token_ids, skip_special_tokens=False))
            if call is None or len(response_ids) >= self.response_length:
                break
            t1 = time.time()
            observation = await self.abort.unless_aborted(kwargs.get("uid"), self._run_tool(call))
            turn["tool_s"] = time.time() - t1
            obs_ids = self.tokenizer.encode(observation, add_special_tokens=False)
            response_ids += obs_ids
            response_mask += [0] * len(obs_ids)
            logprobs += [0.0] * len(obs_ids)
        if scoring:
            await _settle(scoring)  # turns are published before the trajectory lands
        record = {"t_submit": t_submit, "t_done": time.time(), "turns": turns, "response_tokens": len(response_ids),
                  "prompt_tokens": len(prompt_ids), "policy_version": min(versions) if versions else 0,
                  "uid": kwargs.get("uid"), "session_id": kwargs.get("session_id")}
        _append_trace(self.settings.trace_path, record)
        n = self.response_length
        metrics = {"generate_sequences": sum(t["gen_s"] for t in turns), "tool_calls": sum(t["tool_s"] for t in turns), "num_preempted": -1}
        extra = {
            "turn_scores": [],
            "tool_rewards": [],
            "thundersync_events": record,
            "min_global_steps": min(versions) if versions else 0,
            "max_global_steps": max(versions) if versions else 0,
        }
        if self.turn_teacher is not None:
            extra[TURN_COUNT_KEY] = len(scoring)
            reply = self.turn_teacher.whole_trajectory_reply(trajectory_key(kwargs.get("uid"), kwargs.get("session_id")),
                                                             prompt_ids + response_ids[:n])
            if reply is not None:  # verl's whole-trajectory teacher call would repeat the last turn's (verl_adapter.patches)
                extra.update(reply)
                extra[TEACHER_REUSED_KEY] = True
            record["teacher_reused"] = reply is not None
        return va.agent_loop_output_cls()(
            prompt_ids=prompt_ids,
            response_ids=response_ids[:n],
            response_mask=response_mask[:n],
            response_logprobs=logprobs[:n],
            num_turns=2 * len(turns) + 1,
            metrics=metrics,
            extra_fields=extra,
        )

    async def _run_tool(self, call) -> str:
        """The tool turn as text (chat markup included): error text for bad calls, never an exception."""
        if isinstance(call, protocol.ToolCallError):
            body = protocol.tool_response_text(call)
        elif self.tool_rng.random() < self.settings.retry_prob:
            await asyncio.sleep(self.latency.sample(self.tool_rng))  # a busy sandbox still costs a round trip
            body = protocol.tool_response_text(protocol.RETRY_ERROR_TEXT)
        else:
            result = await run_python_async(
                faults.tool_code(call.code) if faults.ACTIVE else call.code,  # $THUNDERSYNC_FAULTS: sandbox_kill
                timeout_s=self.settings.tool_timeout_s,
                extra_latency_s=self.latency.sample(self.tool_rng),
            )
            body = protocol.tool_response_text(result)
        return f"\n<|im_start|>tool\n{body}<|im_end|>\n<|im_start|>assistant\n"
