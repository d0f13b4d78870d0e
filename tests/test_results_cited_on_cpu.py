"""Every entry of ``benchmarks/results/`` is cited somewhere, and every cited result exists.

Why:
1. Result files pile up: each run of a benchmark writes ``<script>.json`` (and variants with a
   suffix), and a folder of results that nothing points to is a run history nobody can read. A file
   or folder directly under ``benchmarks/results/`` stays only while one of these names it: the
   README, a documentation page (``docs/*.md``), or a Python file under ``benchmarks/``, ``tests/`` or
   ``thundersync_verl/`` (a script that writes or reads it). Superseded results are deleted; git
   history keeps them.
2. The match is on the entry's name as a whole word: ``traces_emulated_paper`` does not count as a
   citation of ``traces_emulated_paper_paired``, nor ``pace.json`` of ``sao_pace.json``.
3. Entries that ``.gitignore`` keeps out of the repository (``benchmarks/results/...`` patterns there)
   are local scratch and are not checked.
4. The other direction: a path ``benchmarks/results/<name>`` written in the README or a documentation
   page, and every result file named on ``docs/results.md``, must exist.

GPUs needed: 0 (CPU only). Reads a few hundred small text files.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CODE_FOLDERS = ("benchmarks", "tests", "thundersync_verl")
NAME_CHARS = r"A-Za-z0-9_\-"


def citing_texts() -> dict[Path, str]:
    """README.md, docs/*.md and every .py under the code folders (this file excluded: it names no result)."""
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for folder in CODE_FOLDERS:
        paths += sorted(p for p in (REPO / folder).rglob("*.py") if p.resolve() != Path(__file__).resolve())
    return {p: p.read_text(encoding="utf-8", errors="replace") for p in paths if p.is_file()}


def ignored_patterns() -> list[str]:
    """The ``.gitignore`` patterns for entries directly under benchmarks/results/."""
    gitignore = REPO / ".gitignore"
    if not gitignore.is_file():
        return []
    prefix = "benchmarks/results/"
    lines = [line.strip().lstrip("/") for line in gitignore.read_text().splitlines()]
    return [line[len(prefix):].rstrip("/") for line in lines if line.startswith(prefix)]


def cited(name: str, corpus: str) -> bool:
    """``name`` occurs in ``corpus`` as a whole word (not inside a longer file or folder name)."""
    return re.search(rf"(?<![{NAME_CHARS}]){re.escape(name)}(?![{NAME_CHARS}])", corpus) is not None


def test_every_entry_under_benchmarks_results_is_cited():
    corpus = "\n".join(citing_texts().values())
    skip = ignored_patterns()
    entries = sorted(p.name for p in RESULTS.iterdir() if not any(fnmatch.fnmatch(p.name, pat) for pat in skip))
    assert entries, f"{RESULTS} is empty or missing"
    uncited = [name for name in entries if not cited(name, corpus)]
    assert not uncited, (
        f"{len(uncited)} entr{'y' if len(uncited) == 1 else 'ies'} of benchmarks/results/ cited by none of README.md, "
        f"docs/*.md or a .py file under {', '.join(CODE_FOLDERS)}: {uncited}. Cite each on docs/results.md (or the "
        "page that uses it), or delete it if a newer result supersedes it (git history keeps it)")


def test_every_cited_result_exists():
    pages = {p: t for p, t in citing_texts().items() if p.suffix == ".md"}
    missing = set()
    for path, text in pages.items():
        for name in re.findall(rf"benchmarks/results/([{NAME_CHARS}.]+)", text):
            name = name.rstrip(".")
            if name and not (RESULTS / name).exists():
                missing.add(f"{path.relative_to(REPO)}: benchmarks/results/{name}")
    results_page = REPO / "docs" / "results.md"
    if results_page.is_file():
        for name in re.findall(rf"`([{NAME_CHARS}.]+\.(?:json|png))`", results_page.read_text()):
            if not (RESULTS / name).exists():
                missing.add(f"docs/results.md: {name}")
    assert not missing, f"results cited but not in benchmarks/results/: {sorted(missing)}"
