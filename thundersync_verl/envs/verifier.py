"""Score a finished trajectory by running the answer check in the sandbox.

Why:
1. Verifiers in agentic RL are programs (unit tests, checkers) with their own latency and
   failure modes; running ours as a real subprocess makes the reward stage behave like one,
   including the time it takes, which is what streaming overlaps with the backward passes.
2. A verifier that crashes, hangs or prints garbage yields score 0.0 and a logged reason,
   never an exception: an exception would lose the whole trajectory (and stall its group).
3. The check program is self-contained source (the isolated interpreter cannot import this
   package); the answer pattern reaches it as data from :mod:`protocol`, so the parser and
   the verifier always agree.
4. The one exception is a dataset error: a ground truth that is not an integer (a missing or
   malformed ``reward_model.ground_truth``) would score every answer 0 and train on a constant
   reward without a word, so it raises, naming the value and the fix.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from thundersync_verl.run import faults
from thundersync_verl.core.errors import rule_message
from thundersync_verl.envs import protocol
from thundersync_verl.envs.sandbox import run_blocking, run_python_async

logger = logging.getLogger(__name__)

# Reads {"response", "ground_truth", "pattern"} on stdin; prints one JSON line.
CHECK_PROGRAM = r"""
import json, re, sys
job = json.loads(sys.stdin.read())
found = re.findall(job["pattern"], job["response"], re.DOTALL)
def as_int(text):
    text = text.strip().replace(",", "")
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value == value and abs(value) != float("inf") and value.is_integer() else None
if not found:
    out = {"score": 0.0, "reason": "no answer tag", "pred": None}
else:
    pred = found[-1].strip()
    got, want = as_int(pred), as_int(str(job["ground_truth"]))
    if got is None:
        out = {"score": 0.0, "reason": "answer is not an integer", "pred": pred}
    elif got == want:
        out = {"score": 1.0, "reason": "correct", "pred": pred}
    else:
        out = {"score": 0.0, "reason": "wrong answer", "pred": pred}
print(json.dumps(out))
"""


@dataclass(frozen=True)
class VerifierResult:
    """``score`` in [0, 1]; ``reason`` says why (``correct``, ``wrong answer``, a failure...)."""

    score: float
    reason: str
    duration_s: float
    pred: str | None = None


class GroundTruthError(ValueError):
    """A dataset row whose ground truth no answer can match (point 4)."""


def check_ground_truth(ground_truth: object) -> None:
    """Raise :class:`GroundTruthError` unless ``ground_truth`` reads as an integer, as the check program reads it."""
    text = str(ground_truth).strip().replace(",", "")
    try:
        value = float(text)
        ok = not isinstance(ground_truth, bool) and value.is_integer()
    except ValueError:
        ok = False
    if not ok:
        raise GroundTruthError(rule_message(
            f"the arithmetic task's ground truth must be an integer, got {ground_truth!r}",
            "no answer can match it: every trajectory would score 0 and the run would train on a constant "
            "reward without saying why",
            "fix the dataset rows' reward_model.ground_truth (envs/dataset.py writes each problem's integer "
            "answer), or point reward.custom_reward_function at the verifier of your own task"))


def _job(response_text: str, ground_truth: str) -> str:
    return json.dumps({"response": response_text, "ground_truth": str(ground_truth), "pattern": protocol.ANSWER_PATTERN})


def _interpret(result, started: float) -> VerifierResult:
    """Turn a sandbox result into a score; every failure is score 0 with a reason."""
    duration = time.perf_counter() - started
    if not result.ok:
        lines = [line for line in result.stderr.strip().splitlines() if line]
        if result.timed_out:
            detail = f"killed after {result.duration_s:.2f} s"
        else:
            detail = lines[-1] if lines else f"returncode {result.returncode}"
        reason = f"verifier {result.error}: {detail}"
        logger.warning("verifier failed, scoring 0.0: %s", reason)
        return VerifierResult(0.0, reason, duration)
    try:
        verdict = json.loads(result.stdout.strip().splitlines()[-1])
        score = float(verdict["score"])
        if not 0.0 <= score <= 1.0:
            raise ValueError(f"score {score} outside [0, 1]")
        pred = verdict.get("pred")
        return VerifierResult(score, str(verdict.get("reason", "")), duration, None if pred is None else str(pred))
    except (IndexError, KeyError, TypeError, ValueError) as exc:
        reason = f"verifier output unreadable ({type(exc).__name__}: {exc}): {result.stdout[:80]!r}"
        logger.warning("verifier failed, scoring 0.0: %s", reason)
        return VerifierResult(0.0, reason, duration)


async def verify_async(
    response_text: str,
    ground_truth: str,
    *,
    timeout_s: float = 5.0,
    extra_latency_s: float = 0.0,
    program: str = CHECK_PROGRAM,
) -> VerifierResult:
    """Check the last ``<answer>`` of ``response_text`` against ``ground_truth`` in the sandbox.

    ``program`` replaces the check program (tests use it to simulate broken verifiers).
    """
    check_ground_truth(ground_truth)  # a dataset error raises (point 4); every other failure scores 0
    started = time.perf_counter()
    if faults.ACTIVE:  # $THUNDERSYNC_FAULTS: verifier_raise / verifier_hang
        program = faults.verifier_program(program)
    try:
        result = await run_python_async(
            program, stdin=_job(response_text, ground_truth), timeout_s=timeout_s, extra_latency_s=extra_latency_s
        )
    except Exception as exc:  # noqa: BLE001 - a verifier must never lose a trajectory
        logger.warning("verifier could not run, scoring 0.0: %r", exc)
        return VerifierResult(0.0, f"verifier could not run: {type(exc).__name__}: {exc}", time.perf_counter() - started)
    return _interpret(result, started)


def verify(response_text: str, ground_truth: str, **kwargs) -> VerifierResult:
    """Blocking :func:`verify_async` (same arguments): the same code behind a private event loop."""
    return run_blocking(verify_async(response_text, ground_truth, **kwargs))
