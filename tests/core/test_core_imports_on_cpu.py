"""thundersync_verl.core imports torch and the standard library only.

The exactness math must stay importable and testable on any CPU box, without verl, Ray,
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

CORE = Path(__file__).resolve().parents[2] / "thundersync_verl" / "core"
FORBIDDEN = ("verl", "ray", "megatron", "omegaconf", "transformers", "hydra", "tensordict", "vllm", "sglang")


def test_fresh_interpreter_loads_no_forbidden_module():
    code = (
        "import json, sys; import thundersync_verl.core as core; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "torch" in loaded
    assert not loaded & set(FORBIDDEN), sorted(loaded & set(FORBIDDEN))


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_sources_import_only_torch_and_stdlib():
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        extra = _top_level_imports(path) - allowed
        assert not extra, f"{path.name} imports {sorted(extra)}"
