"""``python -m thundersync_verl.data.swe_synthetic --out <dir> [--n 24]``: a SWE-smith-format set that runs here.

Why:
1. The SWE path (agent loop, sandbox, verifier, trainer) must run end to end on a CPU machine with no
   download. This builds tiny Python repositories (``synthetic_catalog.py``: 8 repositories, 3 planted
   bugs each) and writes their instances in SWE-smith's exact row format.
2. The rows mean what SWE-smith's mean (see ``envs/swe/instance.py``): ``repo`` names a clean
   repository (``thundersync/synthetic__<package>.<content hash>``, like SWE-smith's mirror names)
   found at ``<out>/repos/<repo>`` by the local sandbox (``swe.repos_dir``), ``patch`` is the diff that
   introduces the bug, and the gold fix is that patch reversed; ``image_name`` names an image that is
   not built here; there is no ``base_commit``.
3. FAIL_TO_PASS / PASS_TO_PASS come from running the tests, as SWE-smith's validation harness does:
   per bug, the repository with the bug applied (failing tests -> FAIL_TO_PASS, passing ->
   PASS_TO_PASS) and with the gold fix applied (every test must pass, or generation stops).

Writes ``<out>/repos/``, ``<out>/instances.jsonl`` (the SWE-smith rows) and ``<out>/train.parquet``
(verl rows, through ``swe_smith.convert``); prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import difflib
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

from thundersync_verl.data.swe_smith import convert, write_parquet
from thundersync_verl.data.synthetic_catalog import FAMILIES, Bug, Family
from thundersync_verl.envs.swe.swe_config import DEFAULT_TEST_COMMAND
from thundersync_verl.envs.swe.instance import SWEInstance
from thundersync_verl.envs.swe.swe_sandbox import LocalWorkspace
from thundersync_verl.envs.swe.swe_verifier import PASSING, run_tests

TEST_FILE = "tests/test_core.py"
VALIDATION_TIMEOUT_S = 120.0
CONCURRENCY = 2
DATA_SOURCE = "swe_synthetic"


class GenerationError(RuntimeError):
    """The catalog produced an instance SWE-smith's validation would reject (a bug of the catalog)."""


def catalog_bugs() -> list[tuple[Family, Bug]]:
    """Every planted bug, first bugs of every family first (so a small ``--n`` covers every repository)."""
    depth = max(len(f.bugs) for f in FAMILIES)
    return [(f, f.bugs[k]) for k in range(depth) for f in FAMILIES if k < len(f.bugs)]


def repo_name(family: Family) -> str:
    digest = hashlib.sha1((family.source + family.tests).encode()).hexdigest()[:8]
    return f"thundersync/synthetic__{family.package}.{digest}"


def module_path(family: Family) -> str:
    return f"{family.package}/core.py"


def write_repository(family: Family, folder: Path) -> None:
    """The clean repository: the package, its tests, nothing else."""
    files = {module_path(family): family.source, f"{family.package}/__init__.py": "",
             TEST_FILE: family.tests, "tests/__init__.py": ""}
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)


def bug_patch(family: Family, bug: Bug) -> str:
    """The git-style diff that plants ``bug`` in the clean module."""
    if family.source.count(bug.old) != 1:
        raise GenerationError(f"{family.package}.{bug.name}: {bug.old!r} must occur exactly once in the module")
    path = module_path(family)
    after = family.source.replace(bug.old, bug.new, 1)
    lines = difflib.unified_diff(family.source.splitlines(keepends=True), after.splitlines(keepends=True),
                                 f"a/{path}", f"b/{path}", n=3)
    return f"diff --git a/{path} b/{path}\n" + "".join(lines)


def test_node_ids(family: Family) -> list[str]:
    return [f"{TEST_FILE}::{name}" for name in re.findall(r"^def (test_\w+)", family.tests, re.M)]


def draft_instance(family: Family, bug: Bug) -> SWEInstance:
    """The instance before validation: every test listed as FAIL_TO_PASS until the run says otherwise."""
    name = repo_name(family)
    return SWEInstance(instance_id=f"{name.split('/', 1)[1]}.{bug.name}", repo=name, patch=bug_patch(family, bug),
                       FAIL_TO_PASS=tuple(test_node_ids(family)), PASS_TO_PASS=(),
                       image_name=f"thundersync/swesmith.synthetic.{name.split('__', 1)[1]}",
                       problem_statement=bug.issue)


async def validate(draft: SWEInstance, repos_dir: Path) -> SWEInstance:
    """FAIL_TO_PASS / PASS_TO_PASS from the bugged run; the gold fix must pass every test (point 3)."""
    ids = list(draft.FAIL_TO_PASS)
    workspace = LocalWorkspace(draft, repos_dir)
    try:
        await workspace.start()
        bugged, _ = await run_tests(workspace, ids, command=DEFAULT_TEST_COMMAND, timeout_s=VALIDATION_TIMEOUT_S)
        await workspace.apply_patch(draft.patch, reverse=True)
        fixed, result = await run_tests(workspace, ids, command=DEFAULT_TEST_COMMAND, timeout_s=VALIDATION_TIMEOUT_S)
    finally:
        await workspace.close()
    broken_by_gold = [n for n in ids if fixed.get(n) not in PASSING]
    if broken_by_gold:
        raise GenerationError(f"{draft.instance_id}: with the gold fix, {broken_by_gold} do not pass: "
                              f"{result.text()[-600:]}")
    f2p = tuple(n for n in ids if bugged.get(n) not in PASSING)
    if not f2p:
        raise GenerationError(f"{draft.instance_id}: the planted bug breaks no test")
    p2p = tuple(n for n in ids if n not in f2p)
    return dataclasses.replace(draft, FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p)


async def generate_async(out: Path, n: int) -> list[SWEInstance]:
    chosen = catalog_bugs()[:n]
    repos_dir = out / "repos"
    if repos_dir.exists():
        shutil.rmtree(repos_dir)
    for family in dict.fromkeys(f for f, _ in chosen):
        write_repository(family, repos_dir / repo_name(family))
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(family: Family, bug: Bug) -> SWEInstance:
        async with gate:
            return await validate(draft_instance(family, bug), repos_dir)

    return list(await asyncio.gather(*(one(f, b) for f, b in chosen)))


def generate(out: str | Path, n: int = 24) -> dict:
    """Build the set under ``out`` (point 1); returns the summary the CLI prints."""
    out = Path(out)
    instances = asyncio.run(generate_async(out, n))
    rows = [inst.to_row() for inst in instances]
    (out / "instances.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = write_parquet(convert(rows, data_source=DATA_SOURCE), out / "train.parquet")
    return {"instances": len(rows), "repos": len({r["repo"] for r in rows}), "out": str(out),
            "parquet": str(parquet), "repos_dir": str(out / "repos")}


def main(argv: list[str] | None = None) -> dict:
    limit = len(catalog_bugs())
    ap = argparse.ArgumentParser(prog="python -m thundersync_verl.data.swe_synthetic", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder (repos/, instances.jsonl, train.parquet)")
    ap.add_argument("--n", type=int, default=limit, help=f"instances to build, 1..{limit} (default: all)")
    args = ap.parse_args(argv)
    if not 1 <= args.n <= limit:
        ap.error(f"--n must be between 1 and {limit} (the catalog holds {limit} planted bugs), got {args.n}")
    summary = generate(args.out, args.n)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
