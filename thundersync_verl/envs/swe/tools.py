"""The SWE tools (bash, view_file, edit_file, submit) over a :class:`Workspace`.

Why:
1. The agent loop, the tests and any evaluation script must run tool calls the same way (same
   limits, same error texts), or rewards measured in one place would not transfer to another.
2. Nothing here raises on model output: a bad path, a missing ``old_str``, a command that times out
   or a workspace that failed to start become an ``error: ...`` text the model reads and reacts to.
3. ``edit_file`` replaces exactly one occurrence of ``old_str`` (SWE-agent's str-replace editor): zero
   or several matches are refused with the count, so an edit never lands somewhere unintended. An
   empty ``old_str`` creates a file that does not exist yet.
4. Observations are cut to ``max_chars`` keeping the head and the tail (a traceback's last line and
   pytest's summary live at the end); the model is told how much was cut.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from thundersync_verl.envs.swe.swe_protocol import Action, ActionError
from thundersync_verl.envs.swe.swe_sandbox import Workspace, WorkspaceError

VIEW_LINES = 200  # view_file shows at most this many lines per call


@dataclass(frozen=True)
class ToolResult:
    """One tool call's outcome. ``kind``: ok, error (the call ran and failed), call_error, submit."""

    text: str
    kind: str
    duration_s: float

    @property
    def submitted(self) -> bool:
        return self.kind == "submit"


def clip(text: str, max_chars: int) -> str:
    """``text`` cut to about ``max_chars``, keeping its head and tail (point 4)."""
    if len(text) <= max_chars:
        return text
    head = max_chars * 2 // 5
    tail = max_chars - head
    return f"{text[:head]}\n... [{len(text) - head - tail} characters cut] ...\n{text[-tail:]}"


async def execute(action: Action | ActionError, workspace: Workspace | None, *, timeout_s: float,
                  max_chars: int, unavailable: str = "") -> ToolResult:
    """Run one parsed call; ``workspace`` None means it failed to start (``unavailable`` says why)."""
    t0 = time.perf_counter()
    if isinstance(action, ActionError):
        return ToolResult(f"error: {action.reason}", "call_error", 0.0)
    if action.name == "submit":
        return ToolResult("submitted", "submit", 0.0)
    if workspace is None:
        return ToolResult(clip(f"error: the workspace is unavailable: {unavailable}", max_chars), "error", 0.0)
    try:
        if action.name == "bash":
            text, kind = await _bash(workspace, action.arguments["command"], timeout_s)
        elif action.name == "view_file":
            text, kind = await _view(workspace, action.arguments), "ok"
        else:
            text, kind = await _edit(workspace, action.arguments)
    except WorkspaceError as exc:
        text, kind = f"error: {exc}", "error"
    return ToolResult(clip(text, max_chars), kind, time.perf_counter() - t0)


async def _bash(workspace: Workspace, command: str, timeout_s: float) -> tuple[str, str]:
    result = await workspace.run(command, timeout_s=timeout_s)
    output = result.text().rstrip("\n")
    if result.timed_out:
        return f"{output}\nerror: the command was killed after {timeout_s:g} s".lstrip("\n"), "error"
    status = "" if result.exit_code == 0 else f"\n(exit code {result.exit_code})"
    return (output + status).strip("\n") or "(no output)", "ok" if result.exit_code == 0 else "error"


async def _view(workspace: Workspace, arguments: dict) -> str:
    lines = (await workspace.read_file(arguments["path"])).splitlines()
    start = max(1, int(arguments.get("start", 1)))
    end = min(len(lines), int(arguments.get("end", start + VIEW_LINES - 1)), start + VIEW_LINES - 1)
    if not lines:
        return "(empty file)"
    if start > len(lines):
        raise WorkspaceError(f"{arguments['path']} has {len(lines)} lines; start={start} is past the end")
    body = "\n".join(f"{n:>4} {lines[n - 1]}" for n in range(start, end + 1))
    more = f"\n({len(lines) - end} more lines; view_file with start={end + 1})" if end < len(lines) else ""
    return body + more


async def _edit(workspace: Workspace, arguments: dict) -> tuple[str, str]:
    path, old, new = arguments["path"], arguments["old_str"], arguments["new_str"]
    try:
        text = await workspace.read_file(path)
    except WorkspaceError:
        if old:
            raise
        await workspace.write_file(path, new)
        return f"created {path}", "ok"
    if not old:
        return f"error: {path} exists; give old_str to replace part of it", "error"
    count = text.count(old)
    if count != 1:
        hint = "" if count == 0 else " (include more lines so it is unique)"
        return f"error: old_str found {count} times in {path}{hint}; nothing changed", "error"
    await workspace.write_file(path, text.replace(old, new, 1))
    return f"edited {path}", "ok"
