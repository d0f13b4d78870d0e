"""Where benchmark and demo results go, and the one JSON line each run ends with.

Why:
1. Every benchmark and the demo end with ONE line of JSON (their headline figures) and write the
   same object to ``<results dir>/<script>.json``; ``write_result`` is the single place that does it.
2. Results belong to a checkout, never to the installed package (a non-editable install's tree is
   site-packages). The folder is, the first that is given: the caller's ``results_dir`` (the
   scripts' ``--results-dir``), ``$THUNDERSYNC_RESULTS_DIR``, or ``benchmarks/results/`` of the
   checkout that holds the current working directory (the nearest folder, the current one or a
   parent, with both ``thundersync_verl/`` and ``benchmarks/``).
3. With none of these the write is refused with a message saying how to name a folder, instead of
   landing somewhere nobody will look.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

RESULTS_ENV = "THUNDERSYNC_RESULTS_DIR"


def find_results_dir(results_dir: str | Path | None = None, *, cwd: str | Path | None = None) -> Path:
    """The results folder (point 2), not created; raises ``FileNotFoundError`` when none can be found."""
    if results_dir is not None and str(results_dir):
        return Path(results_dir).expanduser()
    if os.environ.get(RESULTS_ENV):
        return Path(os.environ[RESULTS_ENV]).expanduser()
    start = Path(cwd if cwd is not None else os.getcwd()).resolve()
    for folder in (start, *start.parents):
        if (folder / "thundersync_verl").is_dir() and (folder / "benchmarks").is_dir():
            return folder / "benchmarks" / "results"
    from thundersync_verl.core.errors import rule_message

    raise FileNotFoundError(
        rule_message(
            f"no results folder: no --results-dir, no ${RESULTS_ENV}, and {start} is not inside a checkout "
            "of thundersync_verl (a folder holding thundersync_verl/ and benchmarks/)",
            "results belong to a checkout, not to the installed package's folder",
            f"run from a checkout, pass --results-dir DIR, or set {RESULTS_ENV}=DIR",
        )
    )


def add_results_dir_argument(parser: argparse.ArgumentParser) -> None:
    """``--results-dir DIR`` on a benchmark's or the demo's command line (default: point 2)."""
    parser.add_argument("--results-dir", default=None, metavar="DIR",
                        help=f"where <script>.json goes (default: ${RESULTS_ENV}, else benchmarks/results/ "
                             "of the checkout holding the current directory)")


def write_result(script_name: str, obj: dict, results_dir: str | Path | None = None) -> Path:
    """Print ``obj`` as the LAST line of output and write it to ``<results dir>/<script_name>.json``."""
    folder = find_results_dir(results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    line = json.dumps(obj)
    path = folder / f"{script_name}.json"
    path.write_text(line + "\n")
    print(line, flush=True)
    return path
