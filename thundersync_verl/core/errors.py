"""Exceptions raised by the streaming exactness core.

Why:
1. Every way streaming can silently diverge from the batch-synchronous update must stop the
   run with a message that states the rule, why the rule exists, and how to fix it. One small
   hierarchy lets callers catch "anything from the streaming core" or one family of faults.
2. Config errors are found before training starts (wrong verl settings); input errors are
   caused by one bad call (a NaN reward, a gradient of the wrong shape); state errors are
   calls made at the wrong moment (an optimizer step while a group is still open). A caller
   can retry after a state error; it must change code or config after the other two.
3. The exceptions also derive from the matching builtin (ValueError / RuntimeError) so code
   that already catches those keeps working.
4. Every method that raises promises that no accumulator state changed: the failed call can
   be corrected and repeated.
5. Counts and sizes are checked by one predicate (``int_at_least``), so a bool or a float
   never passes for a count anywhere in the core.
"""

from __future__ import annotations


class StreamingError(Exception):
    """Base class of every error raised by ``thundersync_verl.core``."""


class StreamingConfigError(StreamingError, ValueError):
    """A setting makes the streamed update differ from the synchronous one."""


class StreamingInputError(StreamingError, ValueError):
    """One call received data that breaks an exactness rule (shape, reward, id)."""


class StreamingStateError(StreamingError, RuntimeError):
    """A call came at a moment when it would break exactness (open group, open batch)."""


class AccumulatorBudgetError(StreamingStateError):
    """A trajectory needs accumulator buffers that the byte budget cannot hold right now.

    The trajectory must wait until a group closes; nothing was changed. Callers that follow
    ``StreamingGradientAccumulator.rank_ready`` never see this error.
    """


def rule_message(rule: str, reason: str, fix: str) -> str:
    """Format an error as three labelled lines: the rule, why it exists, how to fix it."""
    return f"{rule}\n  why: {reason}\n  fix: {fix}"


def fail(rule: str, reason: str, fix: str, cls: type[StreamingError] = StreamingInputError):
    """Raise ``cls`` (an input error unless told) with the rule / why / fix message."""
    raise cls(rule_message(rule, reason, fix))


def int_at_least(value: object, minimum: int) -> bool:
    """Whether ``value`` is an int (a bool is not) no smaller than ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
