"""What a ThunderSync step did, measured: learner lanes, trajectory events, ``thundersync/*`` metrics.

1. Every learner operation (backward chunk, fold, optimizer step, weight sync) is timed on the
   driver's clock; every trajectory carries its agent-loop timings (generation and tool turns)
   and the moment its reward reached the driver.
2. From those: learner busy fraction and bubble seconds over the step, reward-to-backward
   latency per trajectory, a JSONL event trace in the simulator's schema, and a timeline PNG.
3. Reporting stays off the step's critical path: ``flush`` runs inside verl's step timer (from
   ``on_step_end``), so it only appends the trace lines and queues the PNG for the background
   drawer (``timeline.TimelineDrawer``). The seconds it did spend are logged per step in
   ``report_cost.jsonl`` (``in_step_s``), beside the drawer's own ``timelines/draw_cost.jsonl``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from thundersync_verl.run.timeline import TimelineDrawer, busy_fraction, step_png


SIM_OPS = {"fold": "other", "critic_update": "other"}  # the simulator's learner-op vocabulary (sim/trace.py)
REPORT_COST_FILE = "report_cost.jsonl"  # one {"step", "in_step_s"} line per flushed step


def first_rank(result):
    """Rank 0's row of a learner call's result (a list per rank from the worker group, or one row)."""
    return result[0] if isinstance(result, list) else result


class StepRecorder:
    def __init__(self, run_dir: str | None, *, mode: str, algo: str = "grpo", n_rollout_slots: int = 0,
                 timeline_every: int = 1):
        """timeline_every: draw every N-th step's timeline PNG (0: never); the traces are written every step."""
        self.n_rollout_slots = int(n_rollout_slots)
        self.timeline_every = int(timeline_every)
        self.run_dir = Path(run_dir) if run_dir else None
        self.mode, self.algo = mode, algo
        self.step = 0
        self.t_step_start = time.time()
        self.ops: list[dict] = []
        self.trajectories: dict[str, dict] = {}
        self.backward_start: dict[str, float] = {}
        self.drawer = TimelineDrawer() if self.run_dir is not None and self.timeline_every > 0 else None

    def begin_step(self, step: int) -> None:
        self.flush()  # a step whose weight push was never recorded
        self.step, self.t_step_start = int(step), time.time()
        self.ops, self.trajectories, self.backward_start = [], {}, {}

    def learner_op(self, op: str, t0: float, t1: float, items=(), tokens: int = 0, forward_s: float | None = None) -> None:
        """forward_s: the call's forwards, measured on the learner (``forward_clock.py``); None: not measured."""
        self.ops.append({"op": op, "t0": t0, "t1": t1, "n": len(items), "tokens": int(tokens)})
        if forward_s is not None:
            self.ops[-1]["forward_s"] = float(forward_s)
        for _, traj_id in items:
            self.backward_start.setdefault(traj_id, t0)

    def trajectory(self, key: str, extra: dict, reward: float, *, t_reward: float) -> None:
        events = dict((extra or {}).get("thundersync_events") or {})
        events.update({"traj_id": key, "group_id": key.split("_")[0], "reward": reward, "t_reward": t_reward})
        events.setdefault("t_submit", self.t_step_start)
        events.setdefault("t_done", t_reward)
        events.setdefault("turns", [])
        self.trajectories[key] = events

    def finish_step(self, worker_metrics, planner_memory: dict) -> dict:
        t_end = time.time()
        first = first_rank(worker_metrics)
        busy = busy_fraction(self.ops, self.t_step_start, t_end)
        latency = [self.backward_start[k] - t["t_reward"] for k, t in self.trajectories.items() if k in self.backward_start]
        metrics = {
            "thundersync/learner_busy_fraction": busy,
            "thundersync/bubble_s": (1 - busy) * (t_end - self.t_step_start),
            "thundersync/open_groups_peak": planner_memory.get("peak_open_groups", 0),
            "thundersync/accumulator_bytes_peak": first.get("stream/peak_bytes", 0),
            "thundersync/reward_to_backward_s/mean": sum(latency) / max(len(latency), 1),
            "thundersync/reward_to_backward_s/max": max(latency, default=0.0),
            "thundersync/chunks": first.get("stream/chunks", 0),
            "actor/grad_norm": first.get("grad_norm", 0.0),
            "actor/lr": first.get("lr", 0.0),
        }
        self._pending = (t_end, metrics)  # written by flush(), after the weight push joins the step's ops
        return metrics

    def flush(self) -> None:
        """Write the finished step's trace records and timeline (call after its weight push)."""
        pending, self._pending = getattr(self, "_pending", None), None
        if pending is not None:
            t0 = time.perf_counter()
            t_end, metrics = pending
            self._write(max([t_end] + [op["t1"] for op in self.ops]), metrics)
            if self.run_dir is not None:
                with open(self.run_dir / REPORT_COST_FILE, "a") as f:
                    f.write(json.dumps({"step": self.step, "in_step_s": time.perf_counter() - t0}) + "\n")

    def close(self, timeout_s: float = 120.0) -> None:
        """Write a pending step and wait for its timeline (tests, the end of a run)."""
        self.flush()
        if self.drawer is not None:
            self.drawer.close(timeout_s)

    def _write(self, t_end: float, metrics: dict) -> None:
        if self.run_dir is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / f"{self.algo}_{self.mode}.jsonl", "a") as f:
            for t in self.trajectories.values():
                f.write(json.dumps({"kind": "trajectory", "mode": self.mode, "algo": self.algo, "step": self.step,
                                    "reward_s": max(0.0, t["t_reward"] - t["t_done"]),  # verifier + queue, as seen
                                    "learner_version": self.step - 1, "policy_version": self.step - 1,
                                    **t}) + "\n")
            for op in self.ops:
                measured = {"forward_s": op["forward_s"]} if "forward_s" in op else {}
                f.write(json.dumps({"kind": "learner", "mode": self.mode, "step": self.step, "lane": "learner0",
                                    "op": SIM_OPS.get(op["op"], op["op"]), "t0": op["t0"], "t1": op["t1"], "tokens": op["tokens"],
                                    "rows": op["n"], **measured}) + "\n")
            f.write(json.dumps({"kind": "step", "mode": self.mode, "algo": self.algo, "step": self.step,
                                "t_start": self.t_step_start, "t_end": t_end, "n_rollout_slots": self.n_rollout_slots,
                                **metrics}) + "\n")
        if self.drawer is None or self.step % self.timeline_every:
            return
        png, title = step_png(self.run_dir / "timelines", self.mode, self.step)
        self.drawer.submit(list(self.trajectories.values()), list(self.ops), self.t_step_start, t_end, png, title,
                           step=self.step)
