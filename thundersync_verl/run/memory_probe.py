"""Where a long run's driver memory goes: ``THUNDERSYNC_MEMORY_PROBE=<file.jsonl>``.

Why:
1. A run that lasts days must keep its host memory flat. When the soak (``benchmarks/soak.py``)
   shows a process growing, the question is which allocation site grows; RSS alone cannot say.
   With the variable set, the trainer (verl's driver process) traces Python allocations from
   ``start_step`` on and, every ``every`` steps, writes the sites whose memory grew most since
   then: file:line of the allocating frame and of the three callers above it, bytes and block
   counts.
2. It is off by default: tracing every allocation slows the driver (about 2x on its Python work),
   so it is a diagnostic for a short run, not a setting for production. Memory held outside
   Python's allocator (torch tensors, C++ libraries, the allocator's own fragmentation) is not
   seen; a process that grows while the traced total stays flat points there.
3. The baseline is taken after the first steps, not at start-up: the first step builds the
   pools and caches that are meant to stay.
"""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from pathlib import Path

ENV = "THUNDERSYNC_MEMORY_PROBE"
FRAMES = 8


class MemoryProbe:
    def __init__(self, path: str | Path, *, start_step: int = 2, every: int = 20, top: int = 15):
        self.path = Path(path)
        self.start_step, self.every, self.top = int(start_step), max(int(every), 1), int(top)
        self._base: tracemalloc.Snapshot | None = None

    @classmethod
    def from_env(cls) -> MemoryProbe | None:
        """The probe the environment asks for (``THUNDERSYNC_MEMORY_PROBE=<file>``), or None."""
        path = os.environ.get(ENV)
        return cls(path, every=int(os.environ.get(ENV + "_EVERY", "20"))) if path else None

    def on_step(self, step: int) -> dict | None:
        """Call once per finished step; returns the record it wrote, if any."""
        if step == self.start_step:
            tracemalloc.start(FRAMES)
        if step < self.start_step or (self._base is not None and (step - self.start_step) % self.every):
            return None
        snap = self._snapshot()
        if self._base is None:  # the baseline: written too, so that the traced total's growth can be read off
            self._base, grew = snap, []
        else:
            grew = [s for s in snap.compare_to(self._base, "traceback") if s.size_diff > 0][: self.top]
        record = {"step": step, "t": time.time(), "traced_mb": round(tracemalloc.get_traced_memory()[0] / 2**20, 2),
                  "grown": [{"kb": round(s.size_diff / 1024, 1), "blocks": s.count_diff,
                             "where": [f"{f.filename}:{f.lineno}" for f in reversed(s.traceback)][:4]} for s in grew]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return record

    @staticmethod
    def _snapshot() -> tracemalloc.Snapshot:
        return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])

    def close(self) -> None:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
