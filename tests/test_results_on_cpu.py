"""Where results go: the named folder, the env var, the checkout's benchmarks/results/, else a refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thundersync_verl.run.results import RESULTS_ENV, find_results_dir, write_result

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_an_explicit_folder_wins_over_the_env_var(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path / "from_env"))
    path = write_result("bench", {"x": 1.5}, tmp_path / "named")
    assert path == tmp_path / "named" / "bench.json"
    assert json.loads(path.read_text()) == {"x": 1.5}
    assert capsys.readouterr().out.strip().splitlines()[-1] == '{"x": 1.5}'  # the run's last line
    assert not (tmp_path / "from_env").exists()


def test_the_env_var_wins_over_the_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path / "from_env"))
    assert find_results_dir(cwd=REPO_ROOT) == tmp_path / "from_env"


def test_inside_a_checkout_results_go_to_its_benchmarks_results(monkeypatch):
    monkeypatch.delenv(RESULTS_ENV, raising=False)
    assert find_results_dir(cwd=REPO_ROOT / "benchmarks") == REPO_ROOT / "benchmarks" / "results"
    assert find_results_dir(cwd=REPO_ROOT / "thundersync_verl" / "sim") == REPO_ROOT / "benchmarks" / "results"


def test_outside_a_checkout_nothing_is_written_and_the_error_says_how_to_fix_it(tmp_path, monkeypatch):
    monkeypatch.delenv(RESULTS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"--results-dir DIR, or set {RESULTS_ENV}=DIR"):
        write_result("bench", {"x": 1})
    assert list(tmp_path.iterdir()) == []
