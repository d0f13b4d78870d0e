"""How long the learner's queued calls will take: when to plan the next one so that it is queued in time.

Why:
1. A streamed step coalesces: rows that land while the learner computes wait, so that they share the next
   call (each call has a fixed cost). But the next call must be QUEUED before the learner goes idle: planning
   it, building its chunk and dispatching it take tens of milliseconds, and planning only once the learner
   is idle leaves it idle for that long on every call (measured on the emulated device: 0.3-0.7 s a step,
   ~20 gaps of 20-100 ms with rows ready).
2. So the driver plans just in time: at the moment the calls in flight are expected to end, minus the
   lead it takes to get a call from a plan onto the learner. Planned earlier, the call takes fewer rows;
   later, the learner waits. A wrong estimate costs one of the two, never exactness: any partition of the
   rows into calls gives the same batch gradient.
3. A call's duration is ``fixed + per_token * tokens`` for backwards (least squares over recent calls, each
   older call weighing ``decay`` times less: the machine's speed drifts) and a mean for folds (no tokens).
   The lead is the time from the start of a plan (the listing it reads) to the worker starting the call,
   measured on calls that found the learner idle; the margin is the recent mean error of the predictions,
   as planning a little early costs less than a gap. Nothing is predicted before the first observations:
   the driver then plans as it would without a model.
4. An idle learner does not always take what is ready at once (``call_waits``): a call whose rows' work is small
   against its fixed cost spends most of its time on the fixed part (dispatch, the framework's per-op overhead),
   which a batched backward pays once. While more rows are still to land than would make the call efficient,
   it waits until its rows' predicted work is ``efficiency`` of the call (fixed part at most ``1 - efficiency``),
   or a full chunk. The call is the chunk the planner would send, not everything ready: open groups' rows share
   a call only within their bucket, so their rows wait for the group to close and go direct with others. It
   never waits when the rows still to land could not fill the call, nor once a whole such call's work is ready
   (the backlog): waiting delays at most one efficient call's rows. On the streaming benchmark's tiny model
   (fixed cost 2-3 rows of work) that took a learner whose rows land over one batched backward from 0.81 of
   batched throughput to 0.87 with no longer a tail; a learner whose rows outweigh its fixed cost (a GPU's rows of
   thousands of tokens) never waits. On the emulated device, whose rows land in bursts, it made ThunderSync's step
   no shorter (about 2% longer in alternating runs), so ``thundersync.call_efficiency`` is 0 (off) by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Decayed:
    """Decayed sums for a weighted least-squares line y = a + b x."""

    w: float = 0.0
    x: float = 0.0
    xx: float = 0.0
    y: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float, decay: float) -> None:
        self.w, self.x, self.xx = decay * self.w + 1.0, decay * self.x + x, decay * self.xx + x * x
        self.y, self.xy = decay * self.y + y, decay * self.xy + x * y

    def line(self) -> tuple[float, float] | None:
        """(a, b), both >= 0; a single size seen so far gives the line through the origin."""
        if self.w <= 0.0:
            return None
        det = self.w * self.xx - self.x * self.x
        if det > 1e-9 * max(self.w * self.xx, 1e-30):
            b = (self.w * self.xy - self.x * self.y) / det
            a = (self.y - b * self.x) / self.w
            if a >= 0.0 and b >= 0.0:
                return a, b
        if self.x > 0.0:
            return 0.0, self.y / self.x  # the mean cost per token
        return self.y / self.w, 0.0


@dataclass
class CallCost:
    """Online duration model of learner calls (module docstring, point 3), shared by a run's steps."""

    decay: float = 0.95
    lead_decay: float = 0.8
    _lines: dict = field(default_factory=dict)  # kind -> _Decayed
    _lead: float | None = None
    _error: float = 0.0  # decayed mean |predicted - measured| seconds of a call

    def __post_init__(self) -> None:
        for name in ("decay", "lead_decay"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"CallCost.{name} must be in (0, 1], got {value!r}")

    def observe(self, kind: str, tokens: int, seconds: float) -> None:
        """One finished call of ``kind`` ("backward", "fold") with ``tokens`` tokens took ``seconds`` on the learner."""
        if seconds >= 0.0 and tokens >= 0:
            predicted = self.predict(kind, tokens)
            if predicted is not None:
                self._error = self.lead_decay * self._error + (1 - self.lead_decay) * abs(predicted - seconds)
            self._lines.setdefault(kind, _Decayed()).add(float(tokens), float(seconds), self.decay)

    def observe_lead(self, seconds: float) -> None:
        """A call that found the learner idle started ``seconds`` after its plan began."""
        if seconds >= 0.0:
            self._lead = seconds if self._lead is None else self.lead_decay * self._lead + (1 - self.lead_decay) * seconds

    def predict(self, kind: str, tokens: int) -> float | None:
        """Expected seconds of a call, or None before any call of that kind was observed."""
        line = self.line(kind)
        return None if line is None else line[0] + line[1] * tokens

    def line(self, kind: str) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of a ``kind`` call, or None before any was observed."""
        return self._lines[kind].line() if kind in self._lines else None

    @property
    def lead_s(self) -> float | None:
        return self._lead

    @property
    def margin_s(self) -> float:
        """How much earlier than the expected end to plan: the lead plus the recent mean prediction error."""
        return (self._lead or 0.0) + self._error


def queue_end(model: CallCost, learner_free_at: float, queued: list[tuple[str, int, float]]) -> float | None:
    """When the learner will finish the ``queued`` calls ``(kind, tokens, t_submitted)``, in order.

    ``learner_free_at``: when it finished the last call handed back. Each call starts when the learner is free
    and the call has reached it (its submit time plus the lead); None if any duration is not known yet.
    """
    lead = model.lead_s or 0.0
    t = learner_free_at
    for kind, tokens, t_submitted in queued:
        seconds = model.predict(kind, tokens)
        if seconds is None:
            return None
        t = max(t, t_submitted + lead) + seconds
    return t


def call_waits(model: CallCost, *, chunk_tokens: float, ready_tokens: float, coming_tokens: float,
               full_tokens: float, efficiency: float, backlog: float = 1.0) -> bool:
    """Whether an idle learner's next backward should wait for more rows (point 4).

    ``chunk_tokens``: the call's rows if it went now; ``ready_tokens``: every ready row's (open groups' rows share a
    call only within their bucket); ``coming_tokens``: the rows still to land (an estimate: rows x mean tokens);
    ``full_tokens``: a full chunk's; ``efficiency``: the least share of a call its rows' work should be (0: never
    wait). It waits while the call is below that, what is still to land could fill it, and less than ``backlog``
    such calls are ready (what waiting can add to the tail). False without a fitted fixed cost.
    """
    line = model.line("backward") if efficiency > 0.0 else None
    if line is None or line[1] <= 0.0:
        return False
    fixed, per_token = line
    wanted = min(float(full_tokens), fixed * efficiency / (1.0 - efficiency) / per_token)
    return chunk_tokens < wanted <= coming_tokens and ready_tokens < backlog * wanted
