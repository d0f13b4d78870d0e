"""Fixtures of the SWE tests: a small synthetic set, built once per session (CPU only, ~10 s)."""

from __future__ import annotations

import json

import pytest

from thundersync_verl.data.swe_synthetic import catalog_bugs, generate
from thundersync_verl.envs.swe.instance import SWEInstance


@pytest.fixture(scope="session")
def synthetic_set(tmp_path_factory):
    """Three validated instances (three repositories) from ``swe_synthetic``, with their catalog bugs."""
    out = tmp_path_factory.mktemp("swe_synthetic")
    summary = generate(out, n=3)
    rows = [json.loads(line) for line in (out / "instances.jsonl").read_text().splitlines()]
    bugs = {f"{inst['instance_id']}": bug for inst, (_, bug) in zip(rows, catalog_bugs())}
    return {"out": out, "repos_dir": out / "repos", "rows": rows, "summary": summary, "bugs": bugs,
            "instances": [SWEInstance.from_row(r) for r in rows]}
