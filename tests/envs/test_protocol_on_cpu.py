"""Task text conventions: problems, transcripts and robust parsers. CPU only."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync_verl.envs import protocol
from thundersync_verl.envs.protocol import ToolCall, ToolCallError, parse_answer, parse_tool_call
from thundersync_verl.envs.sandbox import SandboxResult


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_problem_answer_matches_python_arithmetic(seed):
    problem = protocol.make_problem(random.Random(seed))
    assert problem.answer == eval(problem.expression)  # noqa: S307 - our own generated text
    assert problem.expression.count("+") + problem.expression.count("-") + problem.expression.count("*") in (1, 2)
    assert problem.ground_truth == str(problem.answer)


def test_prompt_is_system_plus_user_with_quoted_expression():
    problem = protocol.Problem("37+45*2", 127)
    messages = protocol.prompt_messages(problem)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"] == "Compute `37+45*2`."


def test_tool_call_round_trip():
    text = protocol.tool_call_text("print(37+45*2)")
    assert text == '<tool_call>{"name":"python","arguments":{"code":"print(37+45*2)"}}</tool_call>'
    assert parse_tool_call(text) == ToolCall(name="python", code="print(37+45*2)", arguments={"code": "print(37+45*2)"})


def test_tool_call_with_spaces_and_string_arguments_is_accepted():
    spaced = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    assert parse_tool_call(spaced).code == "print(1)"
    as_string = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(2)\\"}"}</tool_call>'
    assert parse_tool_call(as_string).code == "print(2)"


def test_malformed_tool_calls_become_errors_not_exceptions():
    cases = {
        '<tool_call>{"name":"python","arguments":{"code":"print(1)"}': "not closed",
        '<tool_call>{"name":"python","arguments":{"code":"print(1)"</tool_call>': "invalid JSON",
        "<tool_call>[1, 2]</tool_call>": "JSON object",
        '<tool_call>{"name":"bash","arguments":{"code":"ls"}}</tool_call>': "unknown tool",
        '<tool_call>{"name":"python","arguments":{"src":"print(1)"}}</tool_call>': "arguments must be",
        '<tool_call>{"name":"python","arguments":"not json"}</tool_call>': "not JSON",
    }
    for text, expected in cases.items():
        parsed = parse_tool_call(text)
        assert isinstance(parsed, ToolCallError), text
        assert expected in parsed.reason, (text, parsed.reason)
        assert protocol.tool_response_text(parsed).startswith("<tool_response>error: ")


def test_text_without_tool_call_is_a_final_answer():
    assert parse_tool_call("<answer>5</answer>") is None
    assert parse_tool_call("") is None


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<>/{}[]":,tool_call answer0123456789\\')), max_size=80))
def test_parsers_never_raise(text):
    assert parse_tool_call(text) is None or isinstance(parse_tool_call(text), (ToolCall, ToolCallError))
    answer = parse_answer(text)
    assert answer is None or isinstance(answer, str)
    assert parse_tool_call("<tool_call>" + text) is not None


def test_parse_answer_takes_the_last_tag_and_strips():
    assert parse_answer("<answer>1</answer> then <answer> 127 </answer>") == "127"
    assert parse_answer("The answer is 127") is None
    assert parse_answer("<answer>127") is None
    assert parse_answer("<answer></answer>") == ""


def test_tool_response_text_for_results_and_strings():
    ok = SandboxResult("127\n", "", 0, False, False, 0.01, None)
    assert protocol.tool_response_text(ok) == "<tool_response>127</tool_response>"
    failed = SandboxResult("", "Traceback...\nZeroDivisionError: division by zero\n", 1, False, False, 0.01, "nonzero_exit")
    assert protocol.tool_response_text(failed) == "<tool_response>error: ZeroDivisionError: division by zero</tool_response>"
    hung = SandboxResult("", "", -9, True, False, 5.0, "timeout")
    assert protocol.tool_response_text(hung) == "<tool_response>error: timeout</tool_response>"
    long = protocol.tool_response_text("9" * 1000)
    assert len(long) == len("<tool_response></tool_response>") + protocol.MAX_TOOL_RESPONSE_CHARS


def test_tool_transcript_calls_retries_then_answers():
    problem = protocol.Problem("3*4", 12)
    rng = random.Random(0)
    many_retries = protocol.make_transcript(problem, rng, retry_prob=0.999, max_retries=3)
    roles = [m["role"] for m in many_retries]
    assert roles == ["system", "user"] + ["assistant", "tool"] * 4 + ["assistant"]
    assert [m["content"] for m in many_retries[3:9:2]] == ["<tool_response>error: sandbox busy, retry</tool_response>"] * 3
    assert many_retries[-2]["content"] == "<tool_response>12</tool_response>"
    assert many_retries[-1]["content"] == "<answer>12</answer>"
    assert parse_tool_call(many_retries[2]["content"]).code == "print(3*4)"
    no_retry = protocol.make_transcript(problem, rng, retry_prob=0.0)
    assert [m["role"] for m in no_retry] == ["system", "user", "assistant", "tool", "assistant"]


def test_guess_transcript_is_always_wrong():
    rng = random.Random(1)
    for problem in protocol.problems(300, 0, stream="guess-test"):
        messages = protocol.make_transcript(problem, rng, use_tool=False)
        assert [m["role"] for m in messages] == ["system", "user", "assistant"]
        assert int(parse_answer(messages[-1]["content"])) != problem.answer


def test_transcripts_are_deterministic_and_mix_as_asked():
    first = list(protocol.transcripts(400, 7, tool_fraction=0.5))
    assert first == list(protocol.transcripts(400, 7, tool_fraction=0.5))
    assert first != list(protocol.transcripts(400, 8, tool_fraction=0.5))
    tool_share = sum(any(m["role"] == "tool" for m in t) for t in first) / len(first)
    assert 0.42 < tool_share < 0.58
    retried = [t for t in first if sum(m["role"] == "tool" for m in t) > 1]
    assert 0.05 < len(retried) / len(first) < 0.2  # ~ 0.5 * 0.2 of transcripts retry at least once
    json.dumps(first)  # plain data, serialisable


def test_problem_streams_are_independent():
    train = protocol.problems(50, 0, stream="train")
    assert train == protocol.problems(50, 0, stream="train")
    assert train != protocol.problems(50, 0, stream="test")
