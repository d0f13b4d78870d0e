"""The SWE verifier: gold 1, no-op 0, a broken PASS_TO_PASS 0, tampered tests restored, a timeout 0 with reason.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from thundersync_verl.envs.swe import swe_verifier as verifier
from thundersync_verl.envs.swe.swe_config import DEFAULT_TEST_COMMAND
from thundersync_verl.envs.swe.swe_sandbox import LocalWorkspace


async def _verdict(instance, repos_dir, change=None, *, command=DEFAULT_TEST_COMMAND, timeout_s=60.0):
    """Start a workspace, let ``change(ws)`` act as the agent, then verify."""
    ws = LocalWorkspace(instance, repos_dir)
    await ws.start()
    try:
        snapshot = await verifier.snapshot_tests(ws, instance)
        if change is not None:
            await change(ws)
        return await verifier.verify(ws, instance, snapshot, command=command, timeout_s=timeout_s)
    finally:
        await ws.close()


def _verify(instance, repos_dir, change=None, **kwargs):
    return asyncio.run(_verdict(instance, repos_dir, change, **kwargs))


async def _gold(ws):
    await ws.apply_patch(ws.instance.patch, reverse=True)


def test_gold_patch_scores_one_and_no_op_scores_zero(synthetic_set):
    inst, repos = synthetic_set["instances"][2], synthetic_set["repos_dir"]
    gold = _verify(inst, repos, _gold)
    noop = _verify(inst, repos)
    assert gold.score == 1.0 and gold.reason.startswith("resolved")
    assert (gold.f2p_passed, gold.f2p_total, gold.p2p_passed, gold.p2p_total) == (1, 1, 5, 5)
    assert noop.score == 0.0 and noop.reason.startswith("unresolved: FAIL_TO_PASS 0/1 passed, PASS_TO_PASS 5/5 passed")
    assert noop.f2p_passed == 0 and noop.test_s > 0 and not noop.timed_out
    extra = gold.extra()
    assert extra["score"] == 1.0 and extra["acc"] == 1.0 and extra["test_s"] > 0 and extra["verifier_timed_out"] is False


def test_fixing_the_bug_but_breaking_a_pass_to_pass_test_scores_zero(synthetic_set):
    inst, repos = synthetic_set["instances"][0], synthetic_set["repos_dir"]  # textkit

    async def fix_and_break(ws):
        await _gold(ws)
        source = await ws.read_file("textkit/core.py")
        await ws.write_file("textkit/core.py", source.replace('in "aeiou"', 'in "aei"'))

    verdict = _verify(inst, repos, fix_and_break)
    assert verdict.score == 0.0 and verdict.f2p_passed == verdict.f2p_total == 1
    assert verdict.p2p_passed == verdict.p2p_total - 1
    assert "first: tests/test_core.py::test_count_vowels FAILED" in verdict.reason


def test_edited_tests_are_restored_before_the_run(synthetic_set):
    inst, repos = synthetic_set["instances"][0], synthetic_set["repos_dir"]

    async def weaken_the_test(ws):
        await ws.write_file("tests/test_core.py", "def test_slugify_words():\n    assert True\n")

    assert _verify(inst, repos, weaken_the_test).score == 0.0


def test_a_timeout_scores_zero_with_its_reason_logged(synthetic_set, caplog):
    inst, repos = synthetic_set["instances"][0], synthetic_set["repos_dir"]
    with caplog.at_level(logging.WARNING, logger=verifier.__name__):
        verdict = _verify(inst, repos, _gold, command=f"sleep 30; {DEFAULT_TEST_COMMAND}", timeout_s=1.0)
    assert verdict.score == 0.0 and verdict.timed_out and verdict.test_s < 10
    assert verdict.reason == "verifier timed out after 1 s (swe.verifier_timeout_s)"
    assert any("timed out" in r.getMessage() and inst.instance_id in r.getMessage() for r in caplog.records)
    assert verdict.extra()["verifier_timed_out"] is True


def test_a_verifier_that_cannot_run_scores_zero():
    class Broken:
        instance = None

        async def write_file(self, path, text):
            raise OSError("disk gone")

    inst = type("I", (), {"instance_id": "x", "FAIL_TO_PASS": ("t::a",), "PASS_TO_PASS": ()})()
    verdict = asyncio.run(verifier.verify(Broken(), inst, {"t": "x"}, command="true", timeout_s=1))
    assert verdict.score == 0.0 and verdict.reason == "verifier could not run: OSError: disk gone"


@pytest.mark.parametrize("line, node, verdict", [
    ("PASSED tests/test_a.py::test_x", "tests/test_a.py::test_x", "PASSED"),
    ("FAILED tests/test_a.py::test_x - AssertionError: 1 - 2", "tests/test_a.py::test_x", "FAILED"),
    ("FAILED tests/test_a.py::test_p[a - b] - assert 0", "tests/test_a.py::test_p[a - b]", "FAILED"),
    ("XFAIL tests/test_a.py::test_y - known", "tests/test_a.py::test_y", "XFAIL"),
    ("ERROR tests/test_a.py::test_z - fixture 'db' not found", "tests/test_a.py::test_z", "ERROR"),
])
def test_outcomes_are_read_from_the_summary_lines(line, node, verdict):
    assert verifier.test_outcomes(f"....\n=== short test summary info ===\n{line}\n1 passed")[node] == verdict


def test_unreported_node_ids_count_as_failing():
    assert verifier.test_outcomes("ERROR: not found: tests/test_a.py::test_gone\n") == {}
