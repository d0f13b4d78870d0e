"""Score a SWE trajectory: run the instance's FAIL_TO_PASS and PASS_TO_PASS tests in its workspace.

Why:
1. The reward is SWE-smith's "resolved": 1 only if every FAIL_TO_PASS test passes and no
   PASS_TO_PASS test breaks, judged by pytest in the trajectory's own workspace after the agent
   submits (or runs out of turns), so the reward sees exactly the code the agent left.
2. The test files the node ids name are put back as they were when the workspace started before the
   run (:func:`snapshot_tests` / :func:`restore_tests`): an agent cannot pass by editing the tests.
3. Outcomes are read per node id from pytest's ``-rA`` summary lines (``PASSED path::name``,
   ``FAILED path::name - message``); PASSED and XFAIL count as passing (SWE-bench's rule). A node id
   that does not appear (not collected, a collection error, a crash) counts as failing.
4. Nothing here raises: a verifier that times out or cannot run scores 0.0 with a logged reason, and
   the row still reaches the learner; the test time and the counts are kept per trajectory.
"""

from __future__ import annotations

import logging
import shlex
import time
from dataclasses import dataclass

from thundersync_verl.envs.swe.instance import SWEInstance
from thundersync_verl.envs.swe.swe_sandbox import CommandResult, Workspace, WorkspaceError

logger = logging.getLogger(__name__)
PASSING = ("PASSED", "XFAIL")
VERDICTS = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
TEST_OUTPUT_BYTES = 16 << 20


@dataclass(frozen=True)
class TestVerdict:
    """What the verifier found; :meth:`extra` is the per-trajectory record (reward extra fields)."""

    __test__ = False  # a result type, not a pytest test class

    score: float
    reason: str
    f2p_passed: int = 0
    f2p_total: int = 0
    p2p_passed: int = 0
    p2p_total: int = 0
    test_s: float = 0.0
    timed_out: bool = False

    def extra(self) -> dict:
        return {"score": float(self.score), "acc": float(self.score == 1.0), "reason": self.reason,
                "f2p_passed": self.f2p_passed, "f2p_total": self.f2p_total, "p2p_passed": self.p2p_passed,
                "p2p_total": self.p2p_total, "test_s": float(self.test_s), "verifier_timed_out": bool(self.timed_out)}


async def snapshot_tests(workspace: Workspace, instance: SWEInstance) -> dict[str, str | None]:
    """The named test files as the workspace started (None: the file did not exist then)."""
    snapshot: dict[str, str | None] = {}
    for path in instance.test_files():
        try:
            snapshot[path] = await workspace.read_file(path)
        except WorkspaceError:
            snapshot[path] = None
    return snapshot


async def restore_tests(workspace: Workspace, snapshot: dict[str, str | None]) -> None:
    for path, text in snapshot.items():
        if text is not None:
            await workspace.write_file(path, text)
        else:
            await workspace.run(f"rm -f -- {shlex.quote(path)}", timeout_s=30.0)


def test_outcomes(output: str) -> dict[str, str]:
    """``{node id: verdict}`` from pytest's ``-rA`` summary lines (point 3)."""
    outcomes: dict[str, str] = {}
    for line in output.splitlines():
        verdict, _, rest = line.strip().partition(" ")
        if verdict not in VERDICTS or not rest:
            continue
        outcomes.setdefault(rest, verdict)
        at = rest.find(" - ")
        while at != -1:  # "FAILED id - message": every prefix before a " - " may be the id
            outcomes.setdefault(rest[:at], verdict)
            at = rest.find(" - ", at + 3)
    return outcomes


async def run_tests(workspace: Workspace, node_ids: list[str], *, command: str,
                    timeout_s: float) -> tuple[dict[str, str], CommandResult]:
    """Run ``command`` on ``node_ids``; the verdict of each id that pytest reported, and the raw result."""
    line = f"{command} {' '.join(shlex.quote(n) for n in node_ids)}"
    result = await workspace.run(line, timeout_s=timeout_s, max_output_bytes=TEST_OUTPUT_BYTES)
    found = test_outcomes(result.stdout)
    return {n: found[n] for n in node_ids if n in found}, result


async def verify(workspace: Workspace, instance: SWEInstance, snapshot: dict[str, str | None] | None, *,
                 command: str, timeout_s: float) -> TestVerdict:
    """The reward of the workspace's current state (points 1-4); never raises."""
    t0 = time.perf_counter()
    try:
        if snapshot:
            await restore_tests(workspace, snapshot)
        ids = list(dict.fromkeys((*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS)))
        outcomes, result = await run_tests(workspace, ids, command=command, timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - a verifier must never lose a trajectory
        reason = f"verifier could not run: {type(exc).__name__}: {exc}"
        logger.warning("%s: scoring 0.0: %s", instance.instance_id, reason)
        return TestVerdict(0.0, reason, test_s=time.perf_counter() - t0)
    test_s = time.perf_counter() - t0
    f2p = sum(outcomes.get(n) in PASSING for n in instance.FAIL_TO_PASS)
    p2p = sum(outcomes.get(n) in PASSING for n in instance.PASS_TO_PASS)
    counts = dict(f2p_passed=f2p, f2p_total=len(instance.FAIL_TO_PASS), p2p_passed=p2p,
                  p2p_total=len(instance.PASS_TO_PASS), test_s=test_s)
    if result.timed_out:
        reason = f"verifier timed out after {timeout_s:g} s (swe.verifier_timeout_s)"
        logger.warning("%s: scoring 0.0: %s", instance.instance_id, reason)
        return TestVerdict(0.0, reason, **counts, timed_out=True)
    summary = (f"FAIL_TO_PASS {f2p}/{len(instance.FAIL_TO_PASS)} passed, "
               f"PASS_TO_PASS {p2p}/{len(instance.PASS_TO_PASS)} passed")
    if f2p == len(instance.FAIL_TO_PASS) and p2p == len(instance.PASS_TO_PASS):
        return TestVerdict(1.0, f"resolved: {summary}", **counts)
    first = next(n for n in ids if outcomes.get(n) not in PASSING)
    detail = outcomes.get(first, f"not reported (pytest exit code {result.exit_code})")
    return TestVerdict(0.0, f"unresolved: {summary}; first: {first} {detail}", **counts)
