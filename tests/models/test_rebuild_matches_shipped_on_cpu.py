"""A full rebuild of each shipped tiny model reproduces it: the builder is kept honest. CPU only, slow.

The build is deterministic (seeded data, order and init; a fixed thread count), so on a machine like
the one that shipped them the rebuilt files equal the shipped ones byte for byte, the cheap and strict
check. Float reductions can differ between CPU instruction sets, so where the weights differ the
rebuilt model must instead reach the shipped one's task score (same held-out problems, same seed).
Minutes per model on 2 cores (student ~4, teacher ~19 on a quiet machine; 45 and 40 on a busy one), too long
for every test run: it runs when ``THUNDERSYNC_REBUILD_TESTS=1`` is set, e.g. after changing a model spec.
"""

from __future__ import annotations

import os

import pytest

from thundersync_verl.models import factory, shipped

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("THUNDERSYNC_REBUILD_TESTS") != "1",
    reason="a full model rebuild takes 20-80 minutes on 2 cores; set THUNDERSYNC_REBUILD_TESTS=1 to run it")]
SCORE_PROBLEMS = 400
SCORE_TOLERANCE = 0.08  # about 3 standard errors of a mean reward over 400 problems


@pytest.mark.timeout(7200)
@pytest.mark.parametrize("variant", ["student", "teacher"])
def test_rebuild_reproduces_the_shipped_model(variant, tmp_path):
    manifest = shipped.read_manifest()
    if variant not in manifest["variants"]:
        pytest.skip(f"this package ships no {variant}")
    rebuilt = factory.build_model(tmp_path / variant, variant, manifest["seed"], progress=False)
    original = shipped.SHIPPED_DIR / variant
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                 "generation_config.json", factory.MARKER_FILE):
        assert (rebuilt / name).read_bytes() == (original / name).read_bytes(), name
    if (rebuilt / "model.safetensors").read_bytes() == (original / "model.safetensors").read_bytes():
        return
    from thundersync_verl.models.evaluate import evaluate_policy

    shipped_score = evaluate_policy(original, SCORE_PROBLEMS, seed=0)["reward"]
    rebuilt_score = evaluate_policy(rebuilt, SCORE_PROBLEMS, seed=0)["reward"]
    assert rebuilt_score >= shipped_score - SCORE_TOLERANCE, (rebuilt_score, shipped_score)
