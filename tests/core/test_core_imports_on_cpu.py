"""The pure-math packages import no framework: ``core`` torch and the standard library only, ``sim`` numpy,
matplotlib and the standard library (plus ``core`` and the CLI's argument types).

The exactness math and the simulator must stay importable and testable on any CPU box, without verl, Ray,
Megatron, omegaconf or transformers: checked at runtime (a fresh interpreter's sys.modules)
and statically (every import statement in the sources).

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "thundersync_verl" / "core"
FORBIDDEN = ("verl", "ray", "megatron", "omegaconf", "transformers", "hydra", "tensordict", "vllm", "sglang")


PACKAGE = CORE.parent
PURE = {  # package -> what its sources may import besides the standard library
    "core": ({"torch"}, set()),
    "sim": ({"numpy", "matplotlib"}, {"thundersync_verl.sim", "thundersync_verl.core", "thundersync_verl.cli_args"}),
}


@pytest.mark.parametrize("package", sorted(PURE))
def test_fresh_interpreter_loads_no_forbidden_module(package):
    code = (
        f"import json, sys, pkgutil, importlib; import thundersync_verl.{package} as pkg; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.')]; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not loaded & set(FORBIDDEN), sorted(loaded & set(FORBIDDEN))


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _own_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("thundersync_verl"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("thundersync_verl")}
    return names


@pytest.mark.parametrize("package", sorted(PURE))
def test_sources_import_only_what_their_rule_allows(package):
    third_party, own = PURE[package]
    allowed = set(sys.stdlib_module_names) | third_party | {"__future__", "thundersync_verl"}
    files = sorted((PACKAGE / package).glob("*.py"))
    assert len(files) >= 10
    for path in files:
        extra = _top_level_imports(path) - allowed
        assert not extra, f"{package}/{path.name} imports {sorted(extra)}"
        foreign = {m for m in _own_imports(path) if not any(m == o or m.startswith(o + ".") for o in own | {f"thundersync_verl.{package}"})}
        assert not foreign, f"{package}/{path.name} imports {sorted(foreign)} from the framework side of the package"
