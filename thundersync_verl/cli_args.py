"""Argument types and the parser class every ``thundersync`` subcommand uses.

Why:
1. A user's first contact is a command line. A bad argument (``--steps 0``, ``--params abc``, a
   trace that is not there) must say what is wrong and how to fix it in one line and exit 2 before
   any work starts, never print a traceback or start a run.
2. :class:`Parser` prints exactly one line (``thundersync <command>: error: <what> (see
   thundersync <command> --help)``) where argparse would print its usage block and an error.
3. :func:`usage_errors` turns the refusals that need several arguments at once (the simulator's
   ``ValueError``s such as ``tp*pp*cp`` not dividing the learner GPUs, each worded as rule and fix)
   into the same one line; it is used only around argument checking, never around a run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

USAGE_EXIT = 2


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit 2."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        usage_error(self.prog, message)


def usage_error(prog: str, message: str):
    print(f"{prog}: error: {message} (see {prog} --help)", file=sys.stderr)
    raise SystemExit(USAGE_EXIT)


@contextlib.contextmanager
def usage_errors(prog: str, *kinds: type[BaseException]):
    """Run argument checks that span several arguments; their refusals become one-line usage errors."""
    try:
        yield
    except kinds or (ValueError,) as err:
        usage_error(prog, str(err).splitlines()[0] if str(err) else type(err).__name__)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive whole number (give 1 or more)")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def param_count(text: str) -> float:
    """``30B``, ``235b``, ``700M``, ``1.5T`` or a plain number of parameters (``3e10``)."""
    t = text.strip().upper()
    scale = {"B": 1e9, "M": 1e6, "T": 1e12}.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if t[-1:] in ("B", "M", "T") else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count (write e.g. 8B, 700M or 3e10)") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive parameter count")
    return value


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a file (give the path of an existing file)")
    return text


def choice_list(choices: tuple[str, ...]):
    """A comma-separated subset of ``choices`` (order kept), e.g. ``sync,thundersync``."""

    def parse(text: str) -> str:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"{', '.join(map(repr, unknown)) or 'nothing'} is not among {', '.join(choices)}")
        return ",".join(names)

    return parse
