"""The tiny models shipped in the package: current, intact, installed instead of built, carried by installs. CPU only."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from thundersync_verl.models import factory, shipped
from thundersync_verl.models.variants import version_hash

REPO = Path(__file__).resolve().parents[2]
MAX_SHIPPED_BYTES = 16 * 2**20  # package data stays "a few MB"


def _refuse_builds(monkeypatch):
    def build_model(*args, **kwargs):
        raise AssertionError("a model was built although the shipped copy matches the specs")

    monkeypatch.setattr(factory, "build_model", build_model)


def test_shipped_models_match_the_current_specs():
    manifest = shipped.read_manifest()
    assert manifest is not None, "the package carries no shipped models"
    assert manifest["version"] == version_hash(seed=0), (
        "the specs changed since the models were shipped; rebuild and ship them: "
        "`python -m thundersync_verl.models --rebuild --ship`")
    assert set(manifest["variants"]) <= {"student", "teacher"} and "student" in manifest["variants"]


def test_shipped_files_match_their_manifest_and_stay_small():
    manifest = shipped.read_manifest()
    total = 0
    for variant, files in manifest["variants"].items():
        assert set(files) == set(shipped.VARIANT_FILES)
        for name, digest in files.items():
            data = (shipped.SHIPPED_DIR / variant / name).read_bytes()
            assert hashlib.sha256(data).hexdigest() == digest, f"{variant}/{name}"
            total += len(data)
        marker = json.loads((shipped.SHIPPED_DIR / variant / factory.MARKER_FILE).read_text())
        assert marker["variant"] == variant and marker["seed"] == manifest["seed"]
    assert total <= MAX_SHIPPED_BYTES


def test_a_cold_cache_gets_the_shipped_copy_without_building(tmp_path, monkeypatch):
    _refuse_builds(monkeypatch)
    monkeypatch.setenv(factory.ENV_MODEL_DIR, str(tmp_path / "cold"))
    messages = []
    monkeypatch.setattr(factory, "_logger", lambda progress: messages.append)
    variants = tuple(shipped.read_manifest()["variants"])
    paths = factory.ensure_tiny_models(variants=variants)
    for variant in variants:
        assert paths[variant] == tmp_path / "cold" / version_hash() / variant and factory.is_built(paths[variant])
        for name in shipped.VARIANT_FILES:
            assert (paths[variant] / name).read_bytes() == (shipped.SHIPPED_DIR / variant / name).read_bytes()
    assert any("using the shipped copy" in m for m in messages)
    assert sorted(p.name for p in paths["student"].parent.iterdir()) == sorted(variants)  # no staging left
    model, tokenizer = factory.load_tiny_model(paths["student"])
    assert model.config.vocab_size == len(tokenizer)


def test_a_shipped_copy_of_other_specs_is_not_used_and_the_log_says_why(tmp_path):
    messages = []
    assert not shipped.install_shipped("student", tmp_path / "student", seed=1, log=messages.append)
    assert not (tmp_path / "student").exists()
    assert version_hash(seed=1) in messages[0] and shipped.read_manifest()["version"] in messages[0]
    assert not shipped.install_shipped("student", tmp_path / "student", shipped_dir=tmp_path / "empty",
                                       log=messages.append)
    assert "carries no shipped models" in messages[1]


def test_a_damaged_shipped_file_is_refused(tmp_path):
    copy = tmp_path / "shipped"
    shutil.copytree(shipped.SHIPPED_DIR, copy)
    weights = copy / "student" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="must match its sha256") as info:
        shipped.install_shipped("student", tmp_path / "cache" / "student", shipped_dir=copy)
    assert "fix: reinstall the package" in str(info.value)
    assert list((tmp_path / "cache").iterdir()) == []  # neither the model nor a staging folder


def test_ship_writes_what_install_reads(tmp_path):
    built = {"student": shipped.SHIPPED_DIR / "student"}
    target = shipped.ship(built, shipped_dir=tmp_path / "package")
    written = shipped.read_manifest(target)
    assert written["version"] == version_hash(seed=0) and list(written["variants"]) == ["student"]
    assert written["variants"]["student"] == shipped.read_manifest()["variants"]["student"]
    assert shipped.install_shipped("student", tmp_path / "cache" / "student", shipped_dir=target)


def test_regular_install_carries_the_shipped_models(tmp_path):
    """``setup.py build_py`` lays out what a wheel installs: the package data must be in it."""
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    built = tmp_path / "thundersync_verl" / "models" / "shipped"
    manifest = json.loads((built / shipped.MANIFEST).read_text())
    assert manifest == shipped.read_manifest()
    for variant, files in manifest["variants"].items():
        for name in files:
            assert (built / variant / name).read_bytes() == (shipped.SHIPPED_DIR / variant / name).read_bytes()
    assert "recursive-include thundersync_verl/models/shipped *" in (REPO / "MANIFEST.in").read_text()


def test_cli_refuses_ship_without_rebuild():
    out = subprocess.run([sys.executable, "-m", "thundersync_verl.models", "--ship", "path"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "--rebuild" in out.stderr


def test_concurrent_installs_into_one_cache_all_succeed_and_none_removes_anothers(tmp_path):
    """Test workers (or several runs) on one machine share the model cache: each installs through its own
    staging folder; one rename wins, the others find the same verified files and keep them."""
    from concurrent.futures import ThreadPoolExecutor

    from thundersync_verl.models.shipped import install_shipped

    dest = tmp_path / "cache" / "student"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: install_shipped("student", dest), range(4)))
    assert results == [True] * 4
    assert install_shipped("student", dest)  # once more over the finished folder: kept, not replaced
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".")]  # no staging folder left
    assert (dest / "config.json").is_file()
