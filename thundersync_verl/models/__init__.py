"""Tiny HF-format student/teacher models for CPU runs, built offline and deterministically.

1. ``ensure_tiny_models()`` returns ``{"student": path, "teacher": path}``, taking what is
   missing from the copy shipped in the package (``shipped/``) when it matches the current specs,
   else building it (``python -m thundersync_verl.models --rebuild`` always builds).
2. ``evaluate_policy(path, n_problems, seed)`` measures a model's reward with an agent loop
   built on plain HF ``generate`` and the real sandbox.
3. Imports are lazy: importing this package does not import torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ensure_tiny_models": "thundersync_verl.models.factory",
    "build_model": "thundersync_verl.models.factory",
    "load_tiny_model": "thundersync_verl.models.factory",
    "default_root": "thundersync_verl.models.factory",
    "evaluate_policy": "thundersync_verl.models.evaluate",
    "VARIANTS": "thundersync_verl.models.variants",
    "version_hash": "thundersync_verl.models.variants",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
