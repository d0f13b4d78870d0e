"""The bad-input catalogue: each malformed input gets a message naming the problem and the fix, and loses nothing.

GPUs needed: 0 (CPU only). Cases: malformed SWE-smith files (missing fields, wrong types, empty or
damaged files), tool output that is huge or binary, a verifier that returns NaN, raises or prints
garbage, a NaN reward reaching the ThunderSync planner, and a prompt over ``rollout.prompt_length``
(both agent loops keep verl's left truncation and its warning; verl's dataset drops such prompts first
when ``data.filter_overlong_prompts`` is on, its default). The sandbox escapes have their own file
(``tests/envs/test_sandbox_escape_on_cpu.py``).
"""

from __future__ import annotations

import json
import math

import pytest

from thundersync_verl.core.errors import StreamingInputError
from thundersync_verl.data import swe_smith
from thundersync_verl.envs import protocol
from thundersync_verl.envs.reward import _as_dict, compute_score
from thundersync_verl.envs.sandbox import SandboxResult
from thundersync_verl.envs.verifier import GroundTruthError, verify
from thundersync_verl.step.stream_plan import BackwardOp, FinalizeOp, StreamPlanner


def _row(i: int = 0, **changes) -> dict:
    row = {"instance_id": f"owner__repo.abc{i}.bug", "repo": "owner/repo", "patch": "--- a/x.py\n+++ b/x.py\n",
           "FAIL_TO_PASS": ["tests/test_x.py::test_a"], "PASS_TO_PASS": ["tests/test_x.py::test_b"],
           "image_name": "img", "problem_statement": "x is wrong"}
    row.update(changes)
    return {k: v for k, v in row.items() if v is not ...}


def _jsonl(*rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


# --- malformed SWE-smith datasets -------------------------------------------------------------

@pytest.mark.parametrize("name, content, problem", [
    ("missing.jsonl", _jsonl(_row(0), _row(1, image_name=..., patch=...)), "line 2 (owner__repo.abc1.bug): missing field(s) patch, image_name"),
    ("wrong_type.jsonl", _jsonl(_row(0, instance_id=7)), "line 1: field(s) instance_id must be strings"),
    ("blank_lines.jsonl", b"\n" + _jsonl(_row(0)) + b"\n\n" + _jsonl(_row(3, repo="")), "line 5 (owner__repo.abc3.bug): empty field(s) repo"),
    ("bad_line.jsonl", _jsonl(_row(0)) + b"\n{not json\n", "is not valid UTF-8 JSON: line 3 column 2"),
    ("empty_field.json", json.dumps([_row(0), _row(1, problem_statement="", patch=...)]).encode(), "row 2 (owner__repo.abc1.bug): missing field(s) patch; empty field(s) problem_statement"),
    ("empty_test_id.json", json.dumps([_row(0, FAIL_TO_PASS=["tests/test_x.py::test_a", ""])]).encode(), "row 1 (owner__repo.abc0.bug): FAIL_TO_PASS must be a list of pytest node ids: item 2 is empty"),
    ("object.json", json.dumps(_row(0)).encode(), "holds an object, not a JSON array"),
    ("number.json", b"5", "holds a number, not a JSON array"),
    ("wrong_list.jsonl", _jsonl(_row(0, PASS_TO_PASS=[1, 2])), "PASS_TO_PASS must be a list of pytest node ids"),
    ("not_a_row.json", b'["just a string"]', "an instance is a mapping of fields, got str"),
    ("empty.jsonl", b"", "is empty (0 bytes)"),
    ("blank.jsonl", b"\n \n", "the input holds no rows"),
    ("empty_array.json", b"[]", "the input holds no rows"),
    ("empty.json", b"", "is empty (0 bytes)"),
    ("binary.jsonl", bytes(range(256)), "is not valid UTF-8 JSON"),
    ("empty.parquet", b"", "is empty (0 bytes)"),
    ("damaged.parquet", b"PAR1 this is not parquet", "is not a readable parquet file"),
    ("rows.csv", b"instance_id\nx\n", "not .jsonl, .json or .parquet"),
], ids=lambda v: v if isinstance(v, str) and "." in v and len(v) < 20 else "")
def test_malformed_swe_smith_files_are_refused_naming_problem_and_fix(tmp_path, name, content, problem):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(swe_smith.ConversionError) as err:
        swe_smith.convert(swe_smith.read_rows(path))
    message = str(err.value)
    assert problem in message, message
    assert "\n  why: " in message and "\n  fix: " in message, message


def test_swe_smith_cli_refuses_a_partly_bad_file_whole_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl(_row(0), _row(1), _row(2, FAIL_TO_PASS=...), _row(3)))
    with pytest.raises(SystemExit) as exited:
        swe_smith.main(["--input", str(src), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    assert "refused 1 of 4 rows" in err and "FAIL_TO_PASS" in err and "fix: fix or remove the named rows" in err
    assert not (tmp_path / "out").exists()  # never a silently shorter dataset


def test_swe_smith_good_rows_all_arrive():
    rows = swe_smith.convert([_row(i) for i in range(5)])
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["extra_info"]["instance_id"] for r in rows] == [f"owner__repo.abc{i}.bug" for i in range(5)]


# --- tool output that is huge or binary ------------------------------------------------------

def test_huge_tool_output_is_cut_with_a_marker():
    capped = SandboxResult("7" * 512, "", 0, False, True, 0.1, None)  # the sandbox cut stdout at its cap
    text = protocol.tool_response_text(capped)
    assert text.endswith(protocol.TRUNCATED_MARK + protocol.TOOL_RESPONSE_CLOSE)
    assert len(text) == len(protocol.TOOL_RESPONSE_OPEN + protocol.TOOL_RESPONSE_CLOSE) + protocol.MAX_TOOL_RESPONSE_CHARS
    assert protocol.tool_response_text("9" * 1000).endswith(protocol.TRUNCATED_MARK + protocol.TOOL_RESPONSE_CLOSE)
    short = SandboxResult("42\n", "", 0, False, False, 0.1, None)
    assert protocol.tool_response_text(short) == "<tool_response>42</tool_response>"  # nothing added when nothing was cut


def test_binary_tool_output_becomes_text_the_agent_can_read():
    raw = bytes(range(256)).decode("utf-8", errors="replace")  # what the sandbox's buffer gives back
    text = protocol.tool_response_text(SandboxResult(raw, "", 0, False, False, 0.1, None))
    assert text.startswith(protocol.TOOL_RESPONSE_OPEN) and "\ufffd" in text
    assert protocol.parse_tool_call(text) is None  # the next turn's parser is not confused by it


# --- a verifier that returns NaN, raises or prints garbage ------------------------------------

@pytest.mark.parametrize("program, reason", [
    ("print('{\"score\": NaN, \"reason\": \"x\"}')", "score nan outside [0, 1]"),
    ("print('{\"score\": Infinity}')", "score inf outside [0, 1]"),
    ("raise RuntimeError('checker crashed')", "RuntimeError: checker crashed"),
    ("print('not json at all')", "verifier output unreadable"),
    ("import sys\nsys.stdout.buffer.write(bytes(range(256)))", "verifier output unreadable"),
], ids=["nan", "inf", "raises", "garbage", "binary"])
def test_a_broken_verifier_is_a_counted_zero_with_its_reason(program, reason):
    result = verify("<answer>4</answer>", "4", program=program, timeout_s=30.0)
    assert result.score == 0.0 and reason in result.reason, result
    row = _as_dict(result)  # what verl receives: a finite score, the reason kept for the dumps
    assert row["score"] == 0.0 and row["acc"] == 0.0 and math.isfinite(row["score"]) and reason in row["reason"]


@pytest.mark.parametrize("ground_truth", [None, "", "twelve", True, 2.5, "nan"], ids=["none", "empty", "word", "bool", "float", "nan"])
def test_a_row_without_an_integer_ground_truth_is_a_loud_dataset_error(ground_truth):
    # Scoring it 0 would look like a model that never answers right: the run must stop instead.
    with pytest.raises(GroundTruthError) as err:
        verify("<answer>12</answer>", ground_truth)
    message = str(err.value)
    assert repr(ground_truth) in message and "reward_model.ground_truth" in message and "\n  fix: " in message
    with pytest.raises(GroundTruthError):
        compute_score("thundersync_arith", "<answer>12</answer>", ground_truth, {"verifier_latency": {"kind": "constant", "median_s": 0.0}})


# --- a NaN reward reaching the planner --------------------------------------------------------

@pytest.mark.parametrize("reward", [math.nan, math.inf, None, "1.0x", True], ids=["nan", "inf", "none", "text", "bool"])
def test_a_non_finite_reward_stops_the_step_clearly_and_loses_nothing(reward):
    planner = StreamPlanner()
    planner.begin_batch({"g": 2})
    planner.arrive("g", "t0", 1.0, 3)
    with pytest.raises(StreamingInputError) as err:
        planner.arrive("g", "t1", reward, 4)
    message = str(err.value)
    assert "('g', 't1')" in message and "must be a finite number" in message and "\n  fix: " in message
    # Nothing was recorded: the same trajectory, rescored, still closes its group and is folded.
    assert planner.ready_count == 1
    planner.arrive("g", "t1", 0.0, 4)
    ops = planner.next_ops()
    planned = sorted(item for op in ops if isinstance(op, BackwardOp) for item in op.items)
    assert planned == [("g", "t0"), ("g", "t1")]
    assert isinstance(planner.finalize(), FinalizeOp)  # the batch completes: no trajectory was dropped


# --- a prompt over the context limit ------------------------------------------------------------

class _LongPromptBuilder:
    """Stands in for the chat-template tokenizer: every prompt renders to ``n`` token ids."""

    def __init__(self, n: int):
        self.n = n

    def build_initial_tokens(self, messages, **kwargs):
        return list(range(self.n))


@pytest.mark.parametrize("loop_module, loop_class", [
    ("thundersync_verl.envs.agent_loop", "ThunderSyncToolAgentLoop"),
    ("thundersync_verl.envs.swe.swe_agent_loop", "SWEAgentLoop"),
], ids=["tool", "swe"])
def test_a_prompt_over_the_limit_is_left_truncated_as_verl_does_with_a_warning(loop_module, loop_class, caplog):
    import asyncio
    import importlib
    from types import SimpleNamespace

    cls = getattr(importlib.import_module(loop_module), loop_class)
    loop = object.__new__(cls)  # only the prompt path runs: no server, no tokenizer

    async def build(n: int) -> list[int]:
        loop.loop = asyncio.get_running_loop()
        loop.continuous_token_builder = _LongPromptBuilder(n)
        loop.rollout_config = SimpleNamespace(prompt_length=8)
        return await loop.ct_build_initial_tokens([{"role": "user", "content": "long"}])

    with caplog.at_level("WARNING"):
        assert asyncio.run(build(6)) == list(range(6)) and not caplog.records  # within the limit: untouched
        assert asyncio.run(build(20)) == list(range(12, 20))  # the last prompt_length tokens, as verl keeps
    assert any("20 tokens exceeds rollout.prompt_length=8" in r.getMessage() for r in caplog.records)
