"""SWE data: the SWE-smith converter (both test-list shapes, refusals naming fields) and the synthetic set.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from thundersync_verl.data import swe_smith
from thundersync_verl.data.swe_synthetic import catalog_bugs
from thundersync_verl.envs.swe import swe_protocol as protocol
from thundersync_verl.envs.swe.instance import REQUIRED_FIELDS, InstanceError, SWEInstance, instance_from_extra_info


def _row(i: int = 0, **changes) -> dict:
    row = {"instance_id": f"owner__repo.abc{i}.bug", "repo": "swesmith/owner__repo.abc", "patch": "diff --git a/x b/x\n",
           "FAIL_TO_PASS": ["tests/test_x.py::test_a", "tests/test_x.py::test_b[1-2]"],
           "PASS_TO_PASS": ["tests/test_x.py::test_c"], "image_name": "img/owner__repo.abc",
           "problem_statement": "x is wrong"}
    row.update(changes)
    return {k: v for k, v in row.items() if v is not ...}


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "thundersync_verl.data.swe_smith", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def test_list_and_json_string_test_ids_read_the_same():
    as_list = SWEInstance.from_row(_row())
    as_json = SWEInstance.from_row(_row(FAIL_TO_PASS=json.dumps(_row()["FAIL_TO_PASS"]), PASS_TO_PASS='["tests/test_x.py::test_c"]'))
    assert as_list == as_json
    assert as_list.FAIL_TO_PASS == ("tests/test_x.py::test_a", "tests/test_x.py::test_b[1-2]")
    assert as_list.base_commit is None and "base_commit" not in as_list.to_row()
    assert SWEInstance.from_row(_row(base_commit="deadbeef")).to_row()["base_commit"] == "deadbeef"
    assert as_list.test_files() == ["tests/test_x.py"]


@pytest.mark.parametrize("changes, named", [
    ({"image_name": ...}, "image_name"),
    ({"FAIL_TO_PASS": ..., "patch": None}, "patch, FAIL_TO_PASS"),
    ({"problem_statement": "  "}, "problem_statement"),
    ({"FAIL_TO_PASS": "tests/test_x.py::test_a"}, "not a JSON list"),
    ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS is empty"),
    ({"PASS_TO_PASS": [1, 2]}, "PASS_TO_PASS must be a list of pytest node ids"),
])
def test_bad_rows_are_refused_naming_the_fields(changes, named):
    with pytest.raises(InstanceError, match="missing field|must|empty|JSON") as err:
        SWEInstance.from_row(_row(**changes))
    assert named in str(err.value)


def test_convert_writes_verl_rows_and_the_instance_round_trips(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(_row(0)) + "\n" + json.dumps(_row(1, FAIL_TO_PASS='["tests/test_x.py::test_a"]', base_commit="c0ffee")) + "\n")
    out = _cli("--input", str(src), "--out", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"rows": 2, "out": str(tmp_path / "out" / "train.parquet")}
    frame = pd.read_parquet(tmp_path / "out" / "train.parquet")
    assert list(frame["agent_name"]) == [protocol.AGENT_NAME] * 2
    assert frame["prompt"][0][1]["content"] == "x is wrong" and frame["prompt"][0][0]["content"] == protocol.SYSTEM_PROMPT
    back = [instance_from_extra_info(e) for e in frame["extra_info"]]
    assert back[0] == SWEInstance.from_row(_row(0))
    assert back[1].FAIL_TO_PASS == ("tests/test_x.py::test_a",) and back[1].base_commit == "c0ffee"
    assert [e["index"] for e in frame["extra_info"]] == [0, 1]


def test_parquet_input_is_read(tmp_path):
    pd.DataFrame([_row(0), _row(1)]).to_parquet(tmp_path / "in.parquet")
    rows = swe_smith.convert(swe_smith.read_rows(tmp_path / "in.parquet"))
    assert [r["extra_info"]["instance_id"] for r in rows] == ["owner__repo.abc0.bug", "owner__repo.abc1.bug"]


def test_cli_refuses_missing_fields_as_one_usage_line(tmp_path):
    src = tmp_path / "in.json"
    src.write_text(json.dumps([_row(0), _row(1, image_name=...), _row(2, FAIL_TO_PASS=..., PASS_TO_PASS=...)]))
    out = _cli("--input", str(src), "--out", str(tmp_path / "out"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    error = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(error) == 1, out.stderr
    assert "refused 2 of 3 rows" in error[0]
    assert "row 2 (owner__repo.abc1.bug): missing field(s) image_name" in error[0]  # counted from 1, as a reader counts
    assert "row 3 (owner__repo.abc2.bug): missing field(s) FAIL_TO_PASS, PASS_TO_PASS" in error[0]
    assert not (tmp_path / "out").exists()  # nothing written


def test_cli_refuses_unreadable_input_without_a_traceback(tmp_path):
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    (tmp_path / "object.json").write_text(json.dumps(_row(0)))
    for path in (tmp_path / "bad.jsonl", tmp_path / "absent.jsonl", tmp_path, tmp_path / "object.json"):
        out = _cli("--input", str(path), "--out", str(tmp_path / "o"))
        assert out.returncode == 2 and "Traceback" not in out.stderr and "error:" in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr  # one usage-error line


def _refusal(capsys, *argv: str) -> str:
    """The one stderr line of a refused in-process run (exit 2, no traceback)."""
    with pytest.raises(SystemExit) as exited:
        swe_smith.main(list(argv))
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("python -m thundersync_verl.data.swe_smith: error: "), err
    return err


def test_cli_numbers_jsonl_rows_by_their_line_in_the_file(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    lines = ["", json.dumps(_row(0)), "", json.dumps(_row(3, problem_statement="")), json.dumps(_row(4, PASS_TO_PASS="")),
             json.dumps(_row(5, FAIL_TO_PASS=["tests/test_x.py::test_a", "  "]))]
    src.write_text("\n".join(lines) + "\n")
    err = _refusal(capsys, "--input", str(src), "--out", str(tmp_path / "out"))
    assert "refused 3 of 4 rows: line 4 (owner__repo.abc3.bug): empty field(s) problem_statement; " \
           "line 5 (owner__repo.abc4.bug): empty field(s) PASS_TO_PASS; " \
           "line 6 (owner__repo.abc5.bug): FAIL_TO_PASS must be a list of pytest node ids: item 2 is empty" in err, err
    assert "''" not in err and "[]" not in err  # an empty field is called empty, not shown as a repr
    assert not (tmp_path / "out").exists()


def test_cli_names_the_line_of_a_jsonl_line_that_is_not_json(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(_row(0)) + "\n\n" + json.dumps(_row(1))[:-1] + "\n")
    assert "is not valid UTF-8 JSON: line 3 column" in _refusal(capsys, "--input", str(src), "--out", str(tmp_path / "o"))


@pytest.mark.parametrize("content, kind", [(json.dumps(_row(0)), "an object"), ('"rows"', "a string"), ("7", "a number"),
                                           ("null", "null")])
def test_cli_refuses_a_json_file_that_is_not_an_array(tmp_path, capsys, content, kind):
    src = tmp_path / "in.json"
    src.write_text(content)
    err = _refusal(capsys, "--input", str(src), "--out", str(tmp_path / "out"))
    assert f"{src} holds {kind}, not a JSON array" in err and "wrap the instance(s) in [ ]" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, says", [
    (["--limit", "0"], "--limit: 0 is not a positive whole number"),
    (["--limit", "two"], "--limit: 'two' is not a whole number"),
    (["--name", "a/b"], "--name: 'a/b' is not a file name"),
    (["--name", ""], "--name: '' is not a file name"),
])
def test_cli_refuses_bad_arguments_in_one_line(tmp_path, capsys, args, says):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(_row(0)) + "\n")
    assert says in _refusal(capsys, "--input", str(src), "--out", str(tmp_path / "out"), *args)


def test_cli_refuses_an_output_folder_it_cannot_create(tmp_path, capsys):
    src, blocker = tmp_path / "in.jsonl", tmp_path / "a_file"
    src.write_text(json.dumps(_row(0)) + "\n")
    blocker.write_text("not a folder")
    err = _refusal(capsys, "--input", str(src), "--out", str(blocker / "sub"))
    assert f"--out {blocker / 'sub'}: cannot write train.parquet there" in err, err


def test_cli_limit_keeps_the_line_numbers_of_the_rows_it_keeps(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("\n\n" + json.dumps(_row(0)) + "\n" + json.dumps(_row(1, repo="")) + "\n" + json.dumps(_row(2, repo="")))
    err = _refusal(capsys, "--input", str(src), "--out", str(tmp_path / "out"), "--limit", "2")
    assert "refused 1 of 2 rows: line 4 (owner__repo.abc1.bug): empty field(s) repo" in err, err


def test_synthetic_set_is_swe_smith_rows_validated_by_running_the_tests(synthetic_set):
    rows, out = synthetic_set["rows"], synthetic_set["out"]
    assert synthetic_set["summary"]["instances"] == 3 and synthetic_set["summary"]["repos"] == 3
    for row in rows:
        assert set(row) == set(REQUIRED_FIELDS)  # SWE-smith's published fields, no base_commit
        assert (out / "repos" / row["repo"]).is_dir()
        assert row["patch"].startswith("diff --git a/") and row["FAIL_TO_PASS"]
        assert not set(row["FAIL_TO_PASS"]) & set(row["PASS_TO_PASS"])
        assert len(row["FAIL_TO_PASS"]) + len(row["PASS_TO_PASS"]) == 6
    assert rows[0]["FAIL_TO_PASS"] == ["tests/test_core.py::test_slugify_words"]  # what the join bug breaks
    frame = pd.read_parquet(out / "train.parquet")
    assert [e["instance_id"] for e in frame["extra_info"]] == [r["instance_id"] for r in rows]


def test_synthetic_catalog_covers_every_repository_first():
    bugs = catalog_bugs()
    assert len(bugs) == 24 and len({f.package for f, _ in bugs[:8]}) == 8


@pytest.mark.slow  # a fresh interpreter runs the CLI (about 7 s of CPU before it refuses)
def test_synthetic_cli_refuses_n_out_of_range(tmp_path):
    out = subprocess.run([sys.executable, "-m", "thundersync_verl.data.swe_synthetic", "--out", str(tmp_path), "--n", "99"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--n must be between 1 and 24" in out.stderr and "Traceback" not in out.stderr
