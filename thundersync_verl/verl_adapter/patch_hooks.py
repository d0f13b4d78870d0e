"""Where runtime patches hook in: the record of what ran, and callbacks after a module is imported.

Why:
1. Patches of verl and of megatron-core must run right after the module they change is imported
   (verl imports its engines lazily, inside Ray workers), so they register a post-import callback
   (``when_imported``) instead of importing the module early.
2. ``APPLIED`` records which patches ran in this process, for tests and for the logs.
3. This module imports nothing of the package: ``verl_adapter.patches`` and the Megatron CPU patches
   (``backends/megatron/cpu_patches.py``) both use it without importing each other.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable

APPLIED: list[str] = []


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module finishes executing."""

    def __init__(self) -> None:
        self.hooks: dict[str, list[Callable]] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.hooks:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                loader, callbacks = spec.loader, self.hooks.pop(fullname)

                class _Loader(importlib.abc.Loader):
                    def create_module(self, spec):
                        return loader.create_module(spec)

                    def exec_module(self, module):
                        loader.exec_module(module)
                        for cb in callbacks:
                            cb(module)

                spec.loader = _Loader()
                return spec
        return None


_finder = _PostImportFinder()


def when_imported(module_name: str, callback: Callable) -> None:
    """Call ``callback(module)`` once ``module_name`` is imported (now, if it already is)."""
    if module_name in sys.modules:
        callback(sys.modules[module_name])
        return
    _finder.hooks.setdefault(module_name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
