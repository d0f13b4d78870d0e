"""The package's shape: a small root, one concept per folder, files and functions a reader can hold.

Why:
1. A newcomer finds a thing by its folder: the root holds only the plugin, the config, the CLI and the demo;
   the driver side of a streamed step is ``step/``, the learner's actor ``learner/``, each algorithm beyond
   GRPO ``algos/<name>/``, the verl reach-ins and patches ``verl_adapter/``, a run's records ``run/``.
2. A file name says what it is wherever it appears (a traceback, a search result), so no two modules share
   one; files stay under 500 lines and functions under 80, so each reads in one sitting.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "thundersync_verl"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
ROOT_MODULES = {"__init__.py", "plugin.py", "config.py", "cli.py", "cli_args.py", "demo.py"}


def test_the_root_holds_only_the_plugin_the_config_and_the_commands():
    root = {p.name for p in PACKAGE.glob("*.py")}
    assert root == ROOT_MODULES and len(root) <= 6, sorted(root - ROOT_MODULES)


def test_no_two_modules_share_a_file_name():
    by_name = defaultdict(list)
    for path in MODULES:
        if path.name not in ("__init__.py", "__main__.py"):
            by_name[path.name].append(str(path.relative_to(PACKAGE)))
    assert not {n: p for n, p in by_name.items() if len(p) > 1}


def test_files_and_functions_stay_short():
    long_files = [f"{p.relative_to(PACKAGE)}: {n}" for p in MODULES if (n := len(p.read_text().splitlines())) > 500]
    assert not long_files, long_files
    long_functions = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long_functions.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert not long_functions, long_functions


def test_the_old_history_folders_are_gone():
    assert not (PACKAGE / "trainer").exists() and not (PACKAGE / "agent").exists()
    for folder in ("step", "learner", "learner/engines", "algos/opd", "algos/sao", "algos/pace", "run", "recipes"):
        assert (PACKAGE / folder / "__init__.py").is_file(), folder


def test_paths_found_from_a_module_still_point_where_they_did():
    """A module that moved folders must not lose the paths it finds from its own file."""
    from thundersync_verl.demo import REPO_ROOT
    from thundersync_verl.recipes.check import DEFAULT_ROOT

    assert DEFAULT_ROOT == REPO_ROOT / "recipes" and (DEFAULT_ROOT / "cpu_tiny" / "grpo.yaml").is_file()
