"""The python tool as the agent loop sees it: parse result in, tool-turn text out.

Why a class of its own:
1. The agent loop, the evaluation loop and the benchmarks must execute tool calls the same
   way (same transient failures, same latency, same error texts), or measured rewards and
   turn counts would not transfer between them.
2. Transient failures (``retry_prob``) are decided by the caller's ``random.Random`` so a
   trajectory's sequence of failures is reproducible from its own seed, whatever the order in
   which concurrent trajectories reach the tool.
3. Nothing here raises on model output: a malformed call or a crashing program becomes an
   ``error: ...`` tool response the model can read and react to.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from thundersync_verl.run import faults
from thundersync_verl.envs import protocol
from thundersync_verl.envs.latency import LatencyModel
from thundersync_verl.envs.sandbox import SandboxResult, run_python_async


@dataclass(frozen=True)
class ToolOutcome:
    """What one tool call produced. ``kind``: ``ok``, ``retry`` (transient sandbox failure),
    ``program_error`` (the code failed) or ``call_error`` (the call itself was malformed)."""

    text: str  # the tool turn's content, already wrapped in <tool_response>
    kind: str
    latency_s: float
    sandbox: SandboxResult | None = None


class PythonTool:
    """Runs model-written code in the sandbox, with transient failures and modelled latency."""

    def __init__(
        self,
        *,
        retry_prob: float = 0.2,
        latency: LatencyModel | None = None,
        timeout_s: float = 5.0,
        mem_mb: int = 256,
        max_output_bytes: int = 512,
    ) -> None:
        if not 0.0 <= retry_prob < 1.0:
            raise ValueError(
                f"retry_prob must be in [0, 1), got {retry_prob}: it is the chance that one call "
                "fails transiently, and 1.0 would make every trajectory retry forever"
            )
        self.retry_prob = retry_prob
        self.latency = latency
        self.timeout_s = timeout_s
        self.mem_mb = mem_mb
        self.max_output_bytes = max_output_bytes

    async def execute(self, call: protocol.ToolCall | protocol.ToolCallError, rng: random.Random) -> ToolOutcome:
        """Execute one parsed call; ``rng`` is the trajectory's own stream."""
        latency_s = self.latency.sample(rng) if self.latency is not None else 0.0
        if isinstance(call, protocol.ToolCallError):
            return ToolOutcome(protocol.tool_response_text(call), "call_error", 0.0)
        if rng.random() < self.retry_prob:
            if latency_s > 0:
                await asyncio.sleep(latency_s)
            return ToolOutcome(protocol.tool_response_text(protocol.RETRY_ERROR_TEXT), "retry", latency_s)
        result = await run_python_async(
            faults.tool_code(call.code) if faults.ACTIVE else call.code,  # $THUNDERSYNC_FAULTS: sandbox_kill
            timeout_s=self.timeout_s,
            mem_mb=self.mem_mb,
            max_output_bytes=self.max_output_bytes,
            extra_latency_s=latency_s,
        )
        kind = "ok" if result.ok else "program_error"
        return ToolOutcome(protocol.tool_response_text(result), kind, latency_s, result)
