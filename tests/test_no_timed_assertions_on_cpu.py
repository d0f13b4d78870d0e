"""No assertion in the test suite depends on how fast this machine runs.

Why:
1. CI runs on shared machines whose speed moves by tens of percent between runs. An assertion on
   an upper bound of elapsed or CPU time, or on a ratio of two timings, passes or fails by chance
   there, and one red run keeps everything else off main. Speed claims live in ``benchmarks/``
   scripts, which print their figures; tests assert what is deterministic.
2. The scan is static (``ast``). An expression is *clocked* when it calls a clock
   (``time.time``, ``perf_counter``, ``monotonic``, ``process_time``, ``thread_time``,
   ``os.times``, ``resource.getrusage``) or reads a name bound to a clocked expression
   (followed through assignments, loops, ``append`` and the return values of helper functions in the
   same file), or reads a measured duration (``MEASURED``: ``.duration_s``, ``["verifier_s"]``, ...).
3. A noisy machine only makes things slower, so a *lower* bound on a clocked value (it slept at
   least 0.4 s) cannot flake. Flagged are: an upper bound or an equality on a clocked value, a
   clocked value on both sides of a comparison (a ratio of timings), and the words of a speed claim
   (``faster``, ``cheaper``, ``speedup``, ``slower``) anywhere in an assertion.
4. Hang guards stay: an upper bound that only stops a test from waiting for ever is allowed where
   it is listed in ``HANG_GUARDS`` with the call's own timeout and the slowest time seen for it; its
   margin over the timeout is at least 5x the slowest overrun seen. A bound that compares a
   measurement with the window it was taken in holds on any machine and is listed in ``ANY_MACHINE``.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time", "thread_time",
          "getrusage", "times", "time", "time_ns"}
MEASURED = {"duration_s", "elapsed", "elapsed_s", "test_s", "verifier_s", "in_step_s", "wall_s", "cpu_s"}
SPEED_WORDS = re.compile(r"\b\w*(faster|cheaper|speedup|slower)\w*\b", re.IGNORECASE)

# (file relative to tests/, the assertion's first line stripped) ->
#   (bound s, the call's own timeout s, slowest seen s, the wait it guards against s or None for ever, what it guards)
# A guard must sit between the timeout and the hang, with a margin over the timeout at least 5x the slowest overrun seen.
HANG_GUARDS: dict[tuple[str, str], tuple[float, float, float, float | None, str]] = {
    ("test_faults_on_cpu.py",
     'assert hung.score == 0.0 and "timeout" in hung.reason and hung.duration_s < 10'):
        (10.0, 1.0, 1.1, None, "an injected verifier hang is killed at its 1 s timeout"),
    ("envs/test_sandbox_on_cpu.py", "assert 0.9 <= elapsed < 10.0"):
        (10.0, 1.0, 1.05, 30.0, "a sleeping program is killed at its 1 s timeout, not after its 30 s sleep"),
    ("envs/test_sandbox_escape_on_cpu.py", "assert time.perf_counter() - started < 15.0"):
        (15.0, 1.0, 1.1, None, "a program sleeping for ever is killed at its 1 s timeout"),
    ("envs/test_sandbox_escape_on_cpu.py",
     "assert result.duration_s < 15.0  # the call ends with its process, not at the timeout"):
        (15.0, 0.0, 0.5, 30.0, "the call ends with its process, not at its 30 s timeout"),
    ("envs/test_sandbox_escape_on_cpu.py",
     "assert quick.duration_s < 15.0  # bash's exit ends the call: its children do not hold it to the timeout"):
        (15.0, 0.0, 0.5, 30.0, "bash's exit ends the call, not its 30 s timeout"),
    ("envs/test_verifier_reward_on_cpu.py", "assert result.duration_s < 10.0"):
        (10.0, 0.5, 0.6, None, "a verifier looping for ever is killed at its 0.5 s timeout"),
    ("envs/swe/test_swe_tools_on_cpu.py",
     'assert slow.kind == "error" and "killed after 20 s" in slow.text and slow.duration_s < 25'):
        (25.0, 20.0, 20.3, 30.0, "the bash tool's 20 s timeout kills a 30 s command"),
    ("envs/swe/test_swe_local_sandbox_on_cpu.py",
     'assert hung.timed_out and hung.duration_s < 10 and "never" not in hung.stdout'):
        (10.0, 1.0, 1.2, None, "a hung command is killed at its 1 s timeout"),
    ("envs/swe/test_swe_verifier_on_cpu.py", "assert verdict.score == 0.0 and verdict.timed_out and verdict.test_s < 10"):
        (10.0, 1.0, 1.3, 30.0, "a 30 s test run is killed at the 1 s verifier timeout"),
    ("backends/test_replay_on_cpu.py",
     'assert max(_completion_times(_replay_server(tmp_path / "rec.jsonl", time_scale=0), prompts)) < 2.5'):
        (2.5, 0.0, 0.1, 5.0, "time_scale=0 serves at once instead of sleeping the recorded 5 s"),
}

# Bounds that compare a measurement with the window it was taken in: they hold on any machine, however loaded.
# (file, the assertion's first line stripped) -> why
ANY_MACHINE: dict[tuple[str, str], str] = {
    ("test_core_load_on_cpu.py", "assert set(busy) == set(cpu_ticks()), busy"):
        "which cores are reported, not how busy",
    ("test_core_load_on_cpu.py",
     "assert 0.5 <= busy[cpu] <= (t1 - t0) + 0.2, busy  # other jobs on the machine may add, never past the window"):
        "a core kept busy through a window is busy for most of it (load only adds), and never longer than it",
    ("test_core_load_on_cpu.py", "assert 0.4 <= by.get(script.name, 0.0) <= (t1 - t0) + 0.2, by"):
        "a process that spent 0.8 CPU-s inside the window is counted at least half of that, never past the window",
    ("test_core_load_on_cpu.py", "assert list(by.values()) == sorted(by.values(), reverse=True), by"):
        "the report's order, not its figures",
    ("sim/test_emulated_tail_on_cpu.py",
     'assert wide["tail_speedup_vs_thundersync"] > 0 and wide["deferred_prompt_share"] is not None'):
        "a simulated ratio of a synthetic trace (no clock read)",
    ("sim/test_emulated_tail_on_cpu.py",
     'assert tail.predict_speedup(path)["tail_speedup_vs_thundersync"] == pytest.approx(1.0)'):
        "the simulator's eta-1 identity on a synthetic trace (no clock read)",
    ("sim/test_emulated_tail_on_cpu.py", 'assert out["tail_speedup_vs_thundersync"] == 1.2'):
        "arithmetic on step times the test gives",
    ("sim/test_emulated_tail_on_cpu.py",
     'assert out["prediction_rel_err"] == pytest.approx(out["tail_speedup_predicted"] / 1.2 - 1, abs=1e-4)'):
        "arithmetic on step times the test gives",
}


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class _Taint:
    """Which names of one scope hold clocked values: a fixpoint over the scope's assignments.

    Helper functions anywhere in the file whose return value is clocked are followed file-wide
    (``functions``, from ``_clocked_helpers``); names are followed within one top-level function, so a ``result`` timed in
    one test does not taint another test's ``result``.
    """

    def __init__(self, scope: ast.AST, functions: set[str] | None = None):
        self.names: set[str] = set()
        self.functions: set[str] = set(functions or ())
        changed = True
        while changed:
            changed = False
            for node in ast.walk(scope):
                for target, value in _bindings(node):
                    if self.clocked(value):
                        for sub in ast.walk(target):
                            if isinstance(sub, ast.Name) and sub.id not in self.names:
                                self.names.add(sub.id)
                                changed = True

    def clocked(self, expr: ast.AST) -> bool:
        for node in ast.walk(expr):
            if isinstance(node, ast.Call):
                called = _name(node.func)
                if (isinstance(node.func, ast.Name) and called in self.functions) or called == "getrusage":
                    return True
                if called in CLOCKS and (called != "time" or isinstance(node.func, ast.Attribute)) and not node.args:
                    return True
            elif isinstance(node, ast.Name) and node.id in self.names | MEASURED:
                return True
            elif isinstance(node, ast.Attribute) and node.attr in MEASURED:
                return True
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in MEASURED:
                return True
        return False


def _bindings(node: ast.AST):
    """(target, value) pairs a statement binds: assignments (a tuple of values element-wise) and for loops."""
    if isinstance(node, ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) and \
                    len(target.elts) == len(node.value.elts):
                yield from zip(target.elts, node.value.elts)
            else:
                yield target, node.value
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
        yield node.target, node.value
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        it = node.iter
        if isinstance(node.target, ast.Tuple) and isinstance(it, ast.Call) and _name(it.func) == "zip" and \
                len(it.args) == len(node.target.elts):
            yield from zip(node.target.elts, it.args)  # for got, want in zip(times, plan): only ``got`` is clocked
        else:
            yield node.target, it
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
            node.func.attr in ("append", "extend", "add", "insert", "update"):
        for arg in node.args:  # xs.append(clocked) makes xs clocked
            yield node.func.value, arg


def _clocked_helpers(tree: ast.Module) -> set[str]:
    """Functions anywhere in the file that return a clocked value, each judged by its own names."""
    functions: set[str] = set()
    defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    changed = True
    while changed:
        changed = False
        for fn in defs:
            if fn.name in functions:
                continue
            taint = _Taint(fn, functions)
            if any(isinstance(r, ast.Return) and r.value is not None and taint.clocked(r.value) for r in ast.walk(fn)):
                functions.add(fn.name)
                changed = True
    return functions


def _scopes(tree: ast.Module):
    """Top-level functions and methods, and the module's own statements, each as one scope."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            yield from (n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        else:
            yield node


def _speed_sensitive(test: ast.expr, taint: _Taint) -> bool:
    """True when noise on the machine could make ``test`` fail (see point 3)."""
    for node in ast.walk(test):
        if not isinstance(node, ast.Compare):
            continue
        left = node.left
        for op, right in zip(node.ops, node.comparators):
            lc, rc = taint.clocked(left), taint.clocked(right)
            if lc and rc:
                return True
            if isinstance(op, (ast.Eq, ast.NotEq)) and (lc or rc):
                return True
            if (lc and isinstance(op, (ast.Lt, ast.LtE))) or (rc and isinstance(op, (ast.Gt, ast.GtE))):
                return True
            left = right
    return False


def timed_assertions(path: Path) -> list[tuple[int, str]]:
    """(line, the assertion's first line) of every speed-sensitive assertion in one test file."""
    source = path.read_text()
    tree = ast.parse(source)
    helpers = _clocked_helpers(tree)
    lines = source.splitlines()
    found = []
    for scope in _scopes(tree):
        taint = _Taint(scope, helpers)
        for node in ast.walk(scope):
            if not isinstance(node, ast.Assert):
                continue
            text = ast.get_source_segment(source, node) or ""
            if _speed_sensitive(node.test, taint) or SPEED_WORDS.search(text.split("#")[0]):
                found.append((node.lineno, lines[node.lineno - 1].strip()))
    return found


def _suite_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.name != Path(__file__).name)


def test_no_assertion_depends_on_the_machines_speed():
    offending = []
    for path in _suite_files():
        rel = path.relative_to(TESTS).as_posix()
        for line, text in timed_assertions(path):
            if (rel, text) not in HANG_GUARDS and (rel, text) not in ANY_MACHINE:
                offending.append(f"{rel}:{line}: {text}")
    assert not offending, ("assertions on elapsed/CPU time or speed ratios (move the claim to a benchmark, or list "
                           "a hang guard in HANG_GUARDS):\n" + "\n".join(offending))


def test_every_hang_guard_is_generous_and_still_in_the_suite():
    present = {(p.relative_to(TESTS).as_posix(), text) for p in _suite_files() for _, text in timed_assertions(p)}
    assert all(key in present and why for key, why in ANY_MACHINE.items()), set(ANY_MACHINE) - present
    for key, (bound, timeout, slowest, hang, why) in HANG_GUARDS.items():
        assert key in present, f"stale HANG_GUARDS entry (assertion gone or changed): {key}"
        assert why and timeout < bound and (hang is None or bound < hang), (key, "must sit between timeout and hang")
        assert bound - timeout >= 5 * (slowest - timeout), (key, "the margin over the timeout is under 5x the overrun")


def test_the_scan_catches_what_it_is_for(tmp_path):
    bad = tmp_path / "t.py"
    bad.write_text(
        "import os, time\n"
        "def cost():\n    a = os.times()\n    return a[0]\n"
        "def test():\n"
        "    t0 = time.perf_counter()\n"
        "    elapsed = time.perf_counter() - t0\n"
        "    assert elapsed < 1.0\n"                 # upper bound on a clocked name: flagged
        "    assert elapsed >= 0.4\n"                # lower bound: a slow machine cannot break it
        "    assert cost() < 0.6 * cost()\n"         # ratio of timings via a helper: flagged
        "    assert 2.0 > time.monotonic() - t0\n"   # upper bound written the other way: flagged
        "    assert result.duration_s < 3\n"         # measured duration: flagged
        "    assert fork_is_cheaper\n"               # a speed claim by name: flagged
        "    assert clip_ratio == 0.2\n"             # a PPO ratio, no clock: not flagged
        "    orders = []\n"
        "    for _ in range(2):\n"
        "        orders.append(cost())\n"
        "    assert orders[0] == orders[1]\n"       # timings collected in a list: flagged
        "    assert out['verifier_s'] < 1.0\n"      # a measured duration under a key: flagged
    )
    assert [line for line, _ in timed_assertions(bad)] == [8, 10, 11, 12, 13, 18, 19]
