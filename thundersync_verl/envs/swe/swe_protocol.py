"""Text conventions of the SWE task: the prompt, the tool calls the model writes, the tool turns it reads.

Why one module:
1. The data converters write the prompt and the agent loop parses the replies; if the two drifted, a
   model would be told one tool syntax and scored on another.
2. Tool calls use the Hermes layout of the embedded task (``<tool_call>{"name": ..., "arguments":
   {...}}</tool_call>``), which verl's ``hermes`` parser and chat-tuned models already know; tool
   results come back as a ``tool`` chat turn wrapped in ``<tool_response>``.
3. Parsing never raises on model output: a malformed call becomes an :class:`ActionError` whose text
   goes back to the model as the tool's answer, so a trajectory is never lost to a typo.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

AGENT_NAME = "thundersync_swe_agent"
DATA_SOURCE = "swe_smith"
ABILITY = "swe"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

# tool -> {argument: (type, required)}
TOOLS: dict[str, dict[str, tuple[type, bool]]] = {
    "bash": {"command": (str, True)},
    "view_file": {"path": (str, True), "start": (int, False), "end": (int, False)},
    "edit_file": {"path": (str, True), "old_str": (str, True), "new_str": (str, True)},
    "submit": {},
}

SYSTEM_PROMPT = (
    "Fix the issue in the repository (the current folder). One tool call per turn:\n"
    '<tool_call>{"name":"bash","arguments":{"command":"..."}}</tool_call>\n'
    'view_file {"path"}; edit_file {"path","old_str","new_str"} replaces old_str once; '
    "submit {} when the tests pass."
)


@dataclass(frozen=True)
class Action:
    """A well-formed tool call."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ActionError:
    """A tool call the model attempted but got wrong; ``reason`` goes back as the tool's answer."""

    reason: str
    raw: str


def prompt_messages(problem_statement: str) -> list[dict[str, str]]:
    """The chat prompt of one instance, as verl's dataset stores it."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem_statement.strip()}]


def tool_call_text(name: str, **arguments: Any) -> str:
    """The assistant's tool-call text for ``name(arguments)`` (compact JSON, Hermes layout)."""
    return TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + TOOL_CALL_CLOSE


def parse_action(text: str) -> Action | ActionError | None:
    """The first tool call of an assistant turn: None without one, an :class:`ActionError` when malformed."""
    if TOOL_CALL_OPEN not in text:
        return None
    match = _TOOL_CALL_RE.search(text)
    if match is None:
        return ActionError("tool call not closed with </tool_call>", text)
    body = match.group(1).strip()
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        return ActionError(f"invalid JSON in tool call: {exc}", body)
    if not isinstance(payload, dict):
        return ActionError("a tool call is a JSON object with name and arguments", body)
    name, arguments = payload.get("name"), payload.get("arguments", {})
    if name not in TOOLS:
        return ActionError(f"unknown tool {name!r}; the tools are {', '.join(TOOLS)}", body)
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ActionError("arguments is a string that is not JSON", body)
    if not isinstance(arguments, dict):
        return ActionError("arguments must be a JSON object", body)
    problem = _check_arguments(name, arguments)
    return ActionError(problem, body) if problem else Action(name, arguments)


def _check_arguments(name: str, arguments: dict) -> str | None:
    spec = TOOLS[name]
    unknown = sorted(set(arguments) - set(spec))
    if unknown:
        return f"{name} takes no argument(s) {', '.join(unknown)}; it takes {', '.join(spec) or 'none'}"
    for arg, (kind, required) in spec.items():
        if arg not in arguments:
            if required:
                return f"{name} needs the argument {arg!r}"
            continue
        value = arguments[arg]
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{name}: {arg} must be a {kind.__name__}"
    return None


def tool_turn_text(body: str) -> str:
    """The tool turn appended after an action (chat markup included), ending where the next action starts."""
    return f"\n<|im_start|>tool\n{TOOL_RESPONSE_OPEN}{body}{TOOL_RESPONSE_CLOSE}<|im_end|>\n<|im_start|>assistant\n"
