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
from thundersync_verl.envs.swe import protocol
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
    assert "row 1 (owner__repo.abc1.bug): missing field(s) image_name" in error[0]
    assert "row 2 (owner__repo.abc2.bug): missing field(s) FAIL_TO_PASS, PASS_TO_PASS" in error[0]
    assert not (tmp_path / "out").exists()  # nothing written


def test_cli_refuses_unreadable_input_without_a_traceback(tmp_path):
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    for path in (tmp_path / "bad.jsonl", tmp_path / "absent.jsonl", tmp_path):
        out = _cli("--input", str(path), "--out", str(tmp_path / "o"))
        assert out.returncode == 2 and "Traceback" not in out.stderr and "error:" in out.stderr


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
