"""SWE tools: tool-call parsing and bash / view_file / edit_file / submit on a real local workspace.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import asyncio

import pytest

from thundersync_verl.envs.swe import tools
from thundersync_verl.envs.swe import swe_protocol as protocol
from thundersync_verl.envs.swe.swe_protocol import Action, ActionError, parse_action
from thundersync_verl.envs.swe.swe_sandbox import LocalWorkspace


@pytest.mark.parametrize("text, expected", [
    ("I am done.", None),
    (protocol.tool_call_text("bash", command="ls"), Action("bash", {"command": "ls"})),
    ('<tool_call>{"name":"submit","arguments":"{}"}</tool_call>', Action("submit", {})),
    (protocol.tool_call_text("view_file", path="a.py", start=3), Action("view_file", {"path": "a.py", "start": 3})),
])
def test_parse_well_formed_calls(text, expected):
    assert parse_action(text) == expected


@pytest.mark.parametrize("text, reason", [
    ("<tool_call>{\"name\":\"bash\"", "not closed"),
    ("<tool_call>{oops}</tool_call>", "invalid JSON"),
    ('<tool_call>{"name":"python","arguments":{"code":"1"}}</tool_call>', "unknown tool 'python'"),
    ('<tool_call>{"name":"bash","arguments":{}}</tool_call>', "needs the argument 'command'"),
    ('<tool_call>{"name":"view_file","arguments":{"path":"a","start":"3"}}</tool_call>', "start must be a int"),
    ('<tool_call>{"name":"edit_file","arguments":{"path":"a","old_str":"x","new_str":"y","mode":1}}</tool_call>', "no argument(s) mode"),
])
def test_malformed_calls_become_errors_not_exceptions(text, reason):
    result = parse_action(text)
    assert isinstance(result, ActionError) and reason in result.reason


def _run(coro):
    return asyncio.run(coro)


async def _with_workspace(instance, repos_dir, body):
    ws = LocalWorkspace(instance, repos_dir)
    await ws.start()
    try:
        return await body(ws)
    finally:
        await ws.close()


@pytest.mark.slow  # waits out the 20 s tool timeout on purpose, and runs the instance's tests
def test_bash_view_edit_submit_on_a_workspace(synthetic_set):
    inst = synthetic_set["instances"][0]  # textkit: the slug join uses "_" after the bug
    do = lambda ws, name, **args: tools.execute(Action(name, args), ws, timeout_s=20, max_chars=2000)  # noqa: E731

    async def body(ws):
        view = await do(ws, "view_file", path="textkit/core.py", start=1, end=3)
        assert view.kind == "ok" and '   3     return "_".join(words)' in view.text
        missing = await do(ws, "edit_file", path="textkit/core.py", old_str="nowhere", new_str="x")
        twice = await do(ws, "edit_file", path="textkit/core.py", old_str="return", new_str="x")
        assert missing.text == "error: old_str found 0 times in textkit/core.py; nothing changed"
        assert twice.text.startswith("error: old_str found 4 times in textkit/core.py (include more lines")
        edit = await do(ws, "edit_file", path="textkit/core.py", old_str='"_".join', new_str='"-".join')
        assert edit.text == "edited textkit/core.py"
        diff = await do(ws, "bash", command="git diff --stat && python -m pytest -q -p no:cacheprovider tests")
        assert diff.kind == "ok" and "1 file changed" in diff.text and "6 passed" in diff.text
        created = await do(ws, "edit_file", path="notes/new.txt", old_str="", new_str="hello")
        assert created.text == "created notes/new.txt" and await ws.read_file("notes/new.txt") == "hello"
        failing = await do(ws, "bash", command="echo out; echo err >&2; exit 3")
        assert failing.kind == "error" and failing.text == "out\nerr\n(exit code 3)"
        escape = await do(ws, "view_file", path="../../etc/passwd")
        assert escape.kind == "error" and "stay inside" in escape.text
        slow = await do(ws, "bash", command="sleep 30")
        return slow, await do(ws, "submit")

    slow, submit = _run(_with_workspace(inst, synthetic_set["repos_dir"], body))
    assert slow.kind == "error" and "killed after 20 s" in slow.text and slow.duration_s < 25
    assert submit.submitted and submit.text == "submitted"


def test_tool_output_is_clipped_head_and_tail():
    text = "".join(f"line {i}\n" for i in range(1000))
    clipped = tools.clip(text, 200)
    assert clipped.startswith("line 0\n") and clipped.endswith("line 999\n") and "characters cut" in clipped
    assert len(clipped) < 260


def test_unavailable_workspace_and_bad_calls_answer_with_errors():
    down = _run(tools.execute(Action("bash", {"command": "ls"}), None, timeout_s=1, max_chars=100, unavailable="docker run failed"))
    assert down.kind == "error" and "unavailable: docker run failed" in down.text
    bad = _run(tools.execute(ActionError("invalid JSON in tool call", "{"), None, timeout_s=1, max_chars=100))
    assert bad.kind == "call_error" and bad.text == "error: invalid JSON in tool call"
