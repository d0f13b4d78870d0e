"""Measure a policy's reward on held-out problems with a plain HF ``generate`` agent loop.

Why:
1. Before any RL we must know where the warm-started models start (the student should sit
   near 0.4 so RL can visibly improve it; the teacher near 0.9+), measured the way the agent
   loop will sample them: temperature 1, generation stops at ``<|im_end|>``, tool calls run
   in the real sandbox with transient failures, tool turns are appended as chat-template
   tokens after the turn separator, and the reward decodes the response with
   ``skip_special_tokens=True`` exactly like verl's reward manager.
2. All unfinished trajectories are advanced one assistant turn per batched ``generate`` call
   and their tool calls run concurrently, so 200 problems take seconds, not minutes.
3. Everything is seeded (problems, sampling, tool failures), so a report is reproducible on
   the same machine and thread count.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from thundersync_verl.envs import protocol
from thundersync_verl.envs.tool import PythonTool
from thundersync_verl.envs.verifier import verify_async
from thundersync_verl.models.tokenizer import EOS_TOKEN, TURN_SEPARATOR, chat_ids

MAX_CONCURRENT_SANDBOXES = 16


@dataclass
class _Trajectory:
    problem: protocol.Problem
    ids: list[int]
    prompt_len: int
    rng: random.Random
    tool_calls: int = 0
    turns: int = 0
    done: bool = False
    call_errors: int = 0
    pending: protocol.ToolCall | protocol.ToolCallError | None = field(default=None, repr=False)


def _generate_turn(model, tokenizer, contexts: list[list[int]], temperature: float, max_new_tokens: int) -> list[list[int]]:
    """Sample one assistant turn per context (left-padded batch); each result ends at <|im_end|>
    when the model closed the turn, else it is ``max_new_tokens`` long."""
    import torch
    from transformers import GenerationConfig

    eos_id, pad_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.pad_token_id
    width = max(len(c) for c in contexts)
    input_ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)  # [B, T]
    attention = torch.zeros((len(contexts), width), dtype=torch.long)  # [B, T]
    for row, ctx in enumerate(contexts):
        input_ids[row, width - len(ctx) :] = torch.tensor(ctx)
        attention[row, width - len(ctx) :] = 1
    config = GenerationConfig(
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config)  # [B, T+N]
    turns = []
    for row in out[:, width:].tolist():
        turns.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return turns


async def _run_tools(tool: PythonTool, jobs: list[_Trajectory]) -> list[str]:
    gate = asyncio.Semaphore(MAX_CONCURRENT_SANDBOXES)

    async def one(traj: _Trajectory) -> str:
        async with gate:
            return (await tool.execute(traj.pending, traj.rng)).text

    return list(await asyncio.gather(*(one(t) for t in jobs)))


async def _score(tokenizer, trajectories: list[_Trajectory]) -> list[tuple[float, str]]:
    gate = asyncio.Semaphore(MAX_CONCURRENT_SANDBOXES)

    async def one(traj: _Trajectory) -> tuple[float, str]:
        text = tokenizer.decode(traj.ids[traj.prompt_len :], skip_special_tokens=True)
        async with gate:
            result = await verify_async(text, traj.problem.ground_truth)
        return result.score, result.reason

    return list(await asyncio.gather(*(one(t) for t in trajectories)))


def _advance(
    model, tokenizer, batch: list[_Trajectory], tool: PythonTool, temperature: float, max_new_tokens: int, last: bool
) -> None:
    """One assistant turn for every trajectory of ``batch``, then their tool calls."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    separator = tokenizer.encode(TURN_SEPARATOR, add_special_tokens=False)
    turns = _generate_turn(model, tokenizer, [t.ids for t in batch], temperature, max_new_tokens)
    calling = []
    for traj, new_ids in zip(batch, turns):
        traj.ids += new_ids
        traj.turns += 1
        closed = bool(new_ids) and new_ids[-1] == eos_id
        text = tokenizer.decode(new_ids[:-1] if closed else new_ids, skip_special_tokens=False)
        traj.pending = protocol.parse_tool_call(text) if closed else None
        if traj.pending is None or last:
            traj.done = True
        else:
            calling.append(traj)
    for traj, response in zip(calling, asyncio.run(_run_tools(tool, calling))):
        traj.tool_calls += 1
        traj.call_errors += isinstance(traj.pending, protocol.ToolCallError)
        traj.ids += separator + chat_ids(tokenizer, [{"role": "tool", "content": response}], add_generation_prompt=True)


def evaluate_policy(
    model_path: str | Path,
    n_problems: int = 200,
    seed: int = 0,
    *,
    temperature: float = 1.0,
    max_turns: int = 6,
    max_new_tokens: int = 64,
    retry_prob: float = 0.2,
    batch_size: int = 100,
) -> dict:
    """Mean reward and behaviour statistics of the policy at ``model_path`` on held-out problems.

    Blocking (it runs its own event loops for the sandbox calls): call it from synchronous code.
    Problems come from the ``eval`` stream, disjoint from the warm-start and dataset streams.
    """
    import torch

    from thundersync_verl.models.factory import load_tiny_model

    started = time.perf_counter()
    model, tokenizer = load_tiny_model(model_path)
    torch.manual_seed(seed)
    tool = PythonTool(retry_prob=retry_prob)
    trajectories = []
    for i, problem in enumerate(protocol.problems(n_problems, seed, stream="eval")):
        prompt = chat_ids(tokenizer, protocol.prompt_messages(problem), add_generation_prompt=True)
        trajectories.append(_Trajectory(problem, list(prompt), len(prompt), random.Random(f"eval-tool:{seed}:{i}")))
    for turn in range(max_turns):
        active = [t for t in trajectories if not t.done]
        for start in range(0, len(active), batch_size):
            chunk = active[start : start + batch_size]
            _advance(model, tokenizer, chunk, tool, temperature, max_new_tokens, last=turn == max_turns - 1)
    scores = asyncio.run(_score(tokenizer, trajectories))
    n = max(1, len(trajectories))
    return {
        "model_path": str(model_path),
        "n_problems": len(trajectories),
        "seed": seed,
        "temperature": temperature,
        "reward": sum(s for s, _ in scores) / n,
        "tool_use_rate": sum(t.tool_calls > 0 for t in trajectories) / n,
        "mean_tool_calls": sum(t.tool_calls for t in trajectories) / n,
        "mean_turns": sum(t.turns for t in trajectories) / n,
        "call_error_rate": sum(t.call_errors for t in trajectories) / max(1, sum(t.tool_calls for t in trajectories)),
        "mean_response_tokens": sum(len(t.ids) - t.prompt_len for t in trajectories) / n,
        "reasons": dict(Counter(reason for _, reason in scores)),
        "seconds": time.perf_counter() - started,
    }
