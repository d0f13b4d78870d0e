"""Write a trace in the trainer's schema from a simulated run (test fixture and demo).

Why this module exists:
1. The loader, the cost fit and the replay must be tested without a real training run.
   A simulated run with known learner costs, written in exactly the trainer's JSONL schema,
   is a fixture whose right answer is known: replaying it must give back its step time.
2. The same records document the schema by example (see trace.py for the field meanings).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from thundersync_verl.sim.sim_config import SimConfig
from thundersync_verl.sim.sim_engine import simulate
from thundersync_verl.sim.hardware import LearnerCosts
from thundersync_verl.sim.trace import write_trace

_LEARNER_OPS = {"compute": "backward", "optimizer": "optimizer", "weight_sync": "weight_sync"}


def trace_records(cfg: SimConfig, source, costs: LearnerCosts) -> list[dict]:
    """Simulate cfg on source and return the run as trace records."""
    if costs.s_per_token_sq:
        raise ValueError("synthetic traces need s_per_token_sq == 0: the trainer's records carry chunk token "
                         "totals only, so a quadratic attention term could not be fitted back from them")
    res = simulate(replace(cfg, record_timeline=True), source, costs)
    mode = cfg.mode if cfg.mode != "thundersync" else f"thundersync:{res.granularity}"
    ends = res.step_end
    records: list[dict] = []
    spans = {(b, i): (t0, t1) for _slot, t0, t1, b, i in res.timeline["rollout"]}
    batches: dict[int, object] = {}
    for b, i, learner_v, policy_v in res.timeline["trained"]:
        if b not in batches:
            batches[b] = source.batch(b)
        t0, t1 = spans[(b, i)]
        records.append(_trajectory(batches[b], i, b, t0, t1, cfg.algo, mode, learner_v, policy_v))
    for t0, t1, kind, tokens in res.timeline["learner"]:
        if kind in _LEARNER_OPS:
            step = int(min(np.searchsorted(ends, t0, side="right"), len(ends) - 1))
            records.append({"kind": "learner", "mode": mode, "step": step, "lane": "0", "op": _LEARNER_OPS[kind],
                            "t0": t0, "t1": t1, "tokens": int(tokens)})
    for k, (a, b) in enumerate(zip(res.step_start, res.step_end)):
        records.append({"kind": "step", "mode": mode, "algo": cfg.algo, "step": k, "t_start": float(a),
                        "t_end": float(b), "n_rollout_slots": cfg.rollout_slots})
    return records


def _trajectory(batch, i: int, b: int, t0: float, t1: float, algo: str, mode: str, learner_v: int,
                policy_v: int) -> dict:
    lo, hi = batch.turn_ptr[i], batch.turn_ptr[i + 1]
    gen_tok = batch.turn_gen_tokens[lo:hi]
    turns = [{"gen_s": float(g), "gen_tokens": int(n), "tool_s": float(tl), "prompt_tokens": int(h - n)}
             for g, n, tl, h in zip(batch.turn_gen_s[lo:hi], gen_tok, batch.turn_tool_s[lo:hi], batch.turn_hi[lo:hi])]
    reward = float(batch.reward_s[i]) if algo == "grpo" else float(batch.turn_score_s[lo:hi].sum())
    land = float(batch.reward_s[i]) if algo == "grpo" else float(batch.last_score_s[i])  # trainer has it
    prompt = int(batch.turn_hi[lo] - gen_tok[0])
    return {"kind": "trajectory", "mode": mode, "algo": algo, "step": int(learner_v),
            "group_id": f"{b}-{batch.group[i]}",
            "traj_id": f"{b}-{i}", "t_submit": float(t0), "t_done": float(t1), "t_reward": float(t1) + land,
            "turns": turns, "reward_s": reward, "response_tokens": int(batch.seq_tokens[i]) - prompt,
            "prompt_tokens": prompt, "policy_version": int(policy_v), "learner_version": int(learner_v)}


def write_synthetic_trace(path, cfg: SimConfig, source, costs: LearnerCosts) -> float:
    """Write the trace; returns the simulated step time it encodes."""
    records = trace_records(cfg, source, costs)
    write_trace(path, records)
    ends = sorted(r["t_end"] for r in records if r["kind"] == "step")
    return (ends[-1] - ends[0]) / (len(ends) - 1)
