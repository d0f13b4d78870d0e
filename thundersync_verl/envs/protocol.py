"""Text conventions of the embedded arithmetic tool-use task: the one place they are defined.

Why one module:
1. The warm-start transcripts, the agent loop, the evaluation loop and the reward all read and
   write the same markup. If any of them drifts, a model trained on one convention is scored
   on another and rewards silently collapse to zero.
2. Tokens are expensive on a 2-core CPU, so the markup is short: compact JSON in tool calls
   (Hermes-style, so verl's ``hermes`` parser also reads it), a bare ``<answer>N</answer>``
   final turn, and the expression quoted in backticks so that its numbers tokenize exactly as
   in the code the model must write (a leading space would give different BPE tokens).
3. Parsers never raise on model output: a malformed tool call becomes a :class:`ToolCallError`
   that the agent loop turns into an error tool response, so a trajectory is never lost.
4. Multi-turn variety comes from a transiently failing tool (``RETRY_ERROR_TEXT`` with
   probability ``retry_prob``); the transcripts show the retry, so trajectories have one to
   several tool turns.

A transcript, as chat messages (the chat template adds ``<|im_start|>role\\n`` and ``<|im_end|>``)::

    system     Use the python tool, then reply <answer>N</answer>.
    user       Compute `37+45*2`.
    assistant  <tool_call>{"name":"python","arguments":{"code":"print(37+45*2)"}}</tool_call>
    tool       <tool_response>error: sandbox busy, retry</tool_response>
    assistant  <tool_call>{"name":"python","arguments":{"code":"print(37+45*2)"}}</tool_call>
    tool       <tool_response>127</tool_response>
    assistant  <answer>127</answer>
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

PROTOCOL_VERSION = 1
DATA_SOURCE = "thundersync_arith"
AGENT_NAME = "thundersync_tool_agent"
ABILITY = "arithmetic_tool"
TOOL_NAME = "python"

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
RETRY_ERROR_TEXT = "error: sandbox busy, retry"
SYSTEM_PROMPT = "Use the python tool, then reply <answer>N</answer>."
MAX_TOOL_RESPONSE_CHARS = 200  # longer tool output is cut: the tiny models have short contexts
TRUNCATED_MARK = " [output truncated]"  # ends a cut tool response, so the model knows it saw a part

# The verifier runs in an isolated interpreter that cannot import this package: it receives
# this pattern as data, so the parser and the verifier can never disagree.
ANSWER_PATTERN = r"<answer>(.*?)</answer>"
_ANSWER_RE = re.compile(ANSWER_PATTERN, re.DOTALL)
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

OPERATORS = ("+", "-", "*")
OPERAND_RANGE = (1, 50)


@dataclass(frozen=True)
class Problem:
    """One task instance: an integer expression and its exact value."""

    expression: str
    answer: int

    @property
    def ground_truth(self) -> str:
        return str(self.answer)


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call of the python tool."""

    name: str
    code: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCallError:
    """A tool call the model attempted but got wrong; ``reason`` goes back as the tool response."""

    reason: str
    raw: str


def make_problem(rng: random.Random) -> Problem:
    """Draw an expression with 1-2 operators over small positive integers."""
    n_ops = rng.choice((1, 2))
    parts = [str(rng.randint(*OPERAND_RANGE))]
    for _ in range(n_ops):
        parts.append(rng.choice(OPERATORS))
        parts.append(str(rng.randint(*OPERAND_RANGE)))
    expression = "".join(parts)
    return Problem(expression=expression, answer=_evaluate_expression(expression))


def _evaluate_expression(expression: str) -> int:
    """Evaluate ``a op b [op c]`` with the usual precedence, without ``eval``."""
    tokens = re.findall(r"\d+|[+\-*]", expression)
    terms: list[int] = [int(tokens[0])]
    signs: list[int] = [1]
    for op, value in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            terms[-1] *= int(value)
        else:
            terms.append(int(value))
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def prompt_messages(problem: Problem) -> list[dict[str, str]]:
    """The chat prompt of one problem (system + user), as verl's dataset stores it."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"Compute `{problem.expression}`."},
    ]


def tool_call_text(code: str) -> str:
    """The assistant's tool-call turn for ``code`` (compact JSON, Hermes layout)."""
    payload = {"name": TOOL_NAME, "arguments": {"code": code}}
    return TOOL_CALL_OPEN + json.dumps(payload, separators=(",", ":")) + TOOL_CALL_CLOSE


def answer_text(value: Any) -> str:
    """The assistant's final turn."""
    return f"{ANSWER_OPEN}{value}{ANSWER_CLOSE}"


def parse_tool_call(text: str) -> ToolCall | ToolCallError | None:
    """Read the first tool call in an assistant turn.

    Returns None when the turn makes no tool call (it is a final answer), a :class:`ToolCall`
    when it is well formed, and a :class:`ToolCallError` (never an exception) otherwise.
    """
    if TOOL_CALL_OPEN not in text:
        return None
    match = _TOOL_CALL_RE.search(text)
    if match is None:
        return ToolCallError("tool call not closed with </tool_call>", text)
    body = match.group(1).strip()
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        return ToolCallError(f"invalid JSON in tool call: {exc}", body)
    if not isinstance(payload, dict):
        return ToolCallError("tool call must be a JSON object", body)
    name, arguments = payload.get("name"), payload.get("arguments")
    if name != TOOL_NAME:
        return ToolCallError(f"unknown tool {name!r}; the only tool is {TOOL_NAME!r}", body)
    if isinstance(arguments, str):  # some models emit arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCallError("arguments is a string that is not JSON", body)
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        return ToolCallError('arguments must be {"code": "<python source>"}', body)
    return ToolCall(name=name, code=arguments["code"], arguments=arguments)


def parse_answer(text: str) -> str | None:
    """The content of the LAST ``<answer>...</answer>`` in ``text``, stripped; None if absent."""
    matches = _ANSWER_RE.findall(text)
    if not matches:
        return None
    return matches[-1].strip()


def tool_response_text(result: Any) -> str:
    """The tool turn's content for a sandbox result (or a plain string).

    Success gives the printed output; a failure gives ``error: <last stderr line or reason>``.
    The text is cut to ``MAX_TOOL_RESPONSE_CHARS`` so a chatty program cannot flood the context;
    a cut text (here or by the sandbox's output cap) ends with ``TRUNCATED_MARK``.
    """
    if isinstance(result, ToolCallError):
        body = f"error: {result.reason}"
    elif isinstance(result, str):
        body = result
    elif getattr(result, "ok", False):
        body = result.stdout.strip()
    else:
        stderr_lines = [line for line in (getattr(result, "stderr", "") or "").strip().splitlines() if line]
        detail = stderr_lines[-1] if stderr_lines else (getattr(result, "error", None) or "failed")
        body = f"error: {detail}"
    cut_by_sandbox = getattr(result, "ok", False) and getattr(result, "truncated", False)  # stdout was capped
    if len(body) > MAX_TOOL_RESPONSE_CHARS or cut_by_sandbox:
        body = body[: MAX_TOOL_RESPONSE_CHARS - len(TRUNCATED_MARK)] + TRUNCATED_MARK
    return TOOL_RESPONSE_OPEN + body + TOOL_RESPONSE_CLOSE


def make_transcript(
    problem: Problem,
    rng: random.Random,
    *,
    use_tool: bool = True,
    retry_prob: float = 0.2,
    max_retries: int = 3,
) -> list[dict[str, str]]:
    """A full conversation for the warm start.

    ``use_tool=True``: call the tool, retry while it reports ``RETRY_ERROR_TEXT`` (each attempt
    fails with ``retry_prob``, at most ``max_retries`` failures), then answer correctly.
    ``use_tool=False``: answer at once with a guessed, wrong number (the behaviour RL should
    unlearn).
    """
    messages = prompt_messages(problem)
    if not use_tool:
        messages.append({"role": "assistant", "content": answer_text(_wrong_guess(problem, rng))})
        return messages
    call = tool_call_text(f"print({problem.expression})")
    failures = 0
    while failures < max_retries and rng.random() < retry_prob:
        messages.append({"role": "assistant", "content": call})
        messages.append({"role": "tool", "content": tool_response_text(RETRY_ERROR_TEXT)})
        failures += 1
    messages.append({"role": "assistant", "content": call})
    messages.append({"role": "tool", "content": tool_response_text(str(problem.answer))})
    messages.append({"role": "assistant", "content": answer_text(problem.answer)})
    return messages


def _wrong_guess(problem: Problem, rng: random.Random) -> int:
    """A plausible-looking number that is never the right answer."""
    spread = max(10, abs(problem.answer))
    while True:
        guess = problem.answer + rng.randint(-spread, spread)
        if guess != problem.answer:
            return guess


def transcripts(
    n: int,
    seed: int,
    *,
    tool_fraction: float = 1.0,
    retry_prob: float = 0.2,
    stream: str = "warmstart",
) -> Iterator[list[dict[str, str]]]:
    """``n`` deterministic transcripts; a ``tool_fraction`` share uses the tool, the rest guesses.

    ``stream`` names an independent random stream so warm-start problems and evaluation
    problems never share draws.
    """
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}: it is the share of tool-using transcripts")
    rng = random.Random(f"{stream}:{seed}")
    for _ in range(n):
        problem = make_problem(rng)
        use_tool = rng.random() < tool_fraction
        yield make_transcript(problem, rng, use_tool=use_tool, retry_prob=retry_prob)


def problems(n: int, seed: int, *, stream: str) -> list[Problem]:
    """``n`` deterministic problems from the named random stream (``train``, ``test``, ``eval``...)."""
    rng = random.Random(f"{stream}:{seed}")
    return [make_problem(rng) for _ in range(n)]
