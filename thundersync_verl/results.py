"""The one JSON line every benchmark and the demo end with, also written to benchmarks/results/."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def write_result(script_name: str, obj: dict, results_dir: Path | None = None) -> Path:
    folder = Path(results_dir) if results_dir is not None else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    line = json.dumps(obj)
    path = folder / f"{script_name}.json"
    path.write_text(line + "\n")
    print(line, flush=True)
    return path
