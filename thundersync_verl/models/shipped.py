"""The tiny student and teacher as they ship inside the package, so a first run builds nothing.

Why:
1. Building the models on a fresh 2-core machine takes minutes (student) to tens of minutes
   (teacher) before the demo reaches its first step. The built folders are a few MB of
   safetensors and tokenizer files, so they ship as package data under ``models/shipped/``.
2. A shipped copy is used only when it is what a build would produce now: ``MANIFEST.json``
   records the ``version_hash`` of the specs it was built from and the sha256 of every file.
   If the specs change, the hash no longer matches and the loader builds instead, saying why.
3. ``install_shipped`` copies a variant into the cache folder a build would write
   (``<root>/<hash>/<variant>``), through a staging folder and one rename like a build, so
   every caller that computes that path finds it; a file whose sha256 differs is refused.
4. ``ship`` writes built folders into the package (``python -m thundersync_verl.models
   --rebuild --ship``): the one way the shipped copy changes, recorded with its hash.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from thundersync_verl.models.variants import version_hash

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
MANIFEST = "MANIFEST.json"
VARIANT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "thundersync_model.json")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(shipped_dir: Path | None = None) -> dict | None:
    """The shipped models' manifest, or None when the package carries none."""
    path = (shipped_dir or SHIPPED_DIR) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def mismatch(variant: str, seed: int = 0, shipped_dir: Path | None = None) -> str | None:
    """Why the shipped ``variant`` cannot stand in for a build with ``seed`` now; None if it can."""
    manifest = read_manifest(shipped_dir)
    if manifest is None:
        return "this installation carries no shipped models"
    if variant not in manifest["variants"]:
        return f"the shipped models do not include {variant!r}"
    wanted = version_hash(seed=seed)
    if manifest["version"] != wanted:
        return (f"the shipped models are version {manifest['version']} (seed {manifest['seed']}) and the current "
                f"specs hash to {wanted}: a spec, seed, data or protocol version changed since they were shipped")
    return None


def install_shipped(variant: str, dest: str | Path, seed: int = 0, *, shipped_dir: Path | None = None,
                    log: Callable[[str], None] = lambda _: None) -> bool:
    """Copy the shipped ``variant`` to ``dest`` if it matches the current specs; False (and why, logged) if not."""
    shipped_dir = shipped_dir or SHIPPED_DIR
    reason = mismatch(variant, seed, shipped_dir)
    if reason is not None:
        log(f"{variant}: not using the shipped copy ({reason})")
        return False
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.installing-", dir=dest.parent))  # one per installer
    try:
        expected = read_manifest(shipped_dir)["variants"][variant]
        for name, digest in expected.items():
            shutil.copyfile(shipped_dir / variant / name, staging / name)
            if _sha256(staging / name) != digest:
                from thundersync_verl.core.errors import rule_message

                raise ValueError(rule_message(
                    f"shipped file {shipped_dir / variant / name} must match its sha256 in {MANIFEST}",
                    "a damaged or hand-edited copy would train a different model under the same version hash",
                    "reinstall the package, or rebuild with `python -m thundersync_verl.models --rebuild`"))
        complete = lambda: all((dest / name).is_file() for name in expected)  # noqa: E731
        if dest.exists() and not complete():
            shutil.rmtree(dest, ignore_errors=True)  # what an interrupted install left
        try:
            staging.rename(dest)
        except OSError:  # another process installed the same verified files first: use theirs, never remove them
            if not complete():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"{variant}: using the shipped copy (version {version_hash(seed=seed)}), installed at {dest}")
    return True


def ship(built: dict[str, Path], seed: int = 0, shipped_dir: Path | None = None) -> Path:
    """Replace the package's shipped models with the built folders in ``built`` ({variant: path})."""
    shipped_dir = shipped_dir or SHIPPED_DIR
    manifest = {"version": version_hash(seed=seed), "seed": seed, "variants": {}}
    for variant, folder in sorted(built.items()):
        target = shipped_dir / variant
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for name in VARIANT_FILES:
            shutil.copyfile(Path(folder) / name, target / name)
        manifest["variants"][variant] = {name: _sha256(target / name) for name in VARIANT_FILES}
    (shipped_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return shipped_dir
