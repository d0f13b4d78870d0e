"""The benchmark scripts as modules for tests: ``benchmarks/`` on the path while one is imported (its siblings too)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` imported (once per process, as ``name``)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
