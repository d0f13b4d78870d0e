"""One deployment of the tail-batching study: every mode at the split the planner picks for it.

Why this module exists:
1. The question "does tail batching beat plain ThunderSync at fleet scale?" must not be
   answered on a layout that favours one mode: a rollout-bound pipeline wants more rollout
   GPUs, a learner-bound one more learner GPUs. Each mode (and the tail policy) gets the
   learner/rollout split `planner.plan_split` finds fastest for it, on the same GPUs, batch
   and prompts (prompts.py: every mode draws the same prompts; the tail policy's re-runs are
   new samples of the same prompts).
2. The scale preset ties the batch to the rollout fleet and caps it at 16k sequences, which is
   8 per rollout GPU at 4,096 GPUs. Here the batch is a parameter (`batch_per_gpu` per
   rollout GPU of the half/half layout, b x GPUs / 2 trajectories, the same for every mode and
   split) and the rollout engines hold `SLOTS_PER_ROLLOUT_GPU` sequences per GPU (the
   calibrated 64 per B200), so the cap can be swept instead of assumed.
3. Each row holds what the study reports: step time, GPU-hours per million trained tokens,
   staleness, wasted tokens (rollout) and wasted learner work, deferral statistics, and the
   trained response lengths (Sync trains every prompt's first attempt: the unbiased draw).
4. Sync with the same tail policy is the fair reference for what streaming adds to it: the tail policy at
   batch granularity (`SYNC_TAIL`: every kept group trains after the round's batch is complete, one
   chunk, as Sync's `update_actor`), on its own planned split. It trains the same groups as the streamed
   tail policy (the same prompts, launches and aborts), only later.
5. What bounds a zero-staleness round is in the workload itself (`workload_times`): every kept
   group starts at the round's weight push and the round lasts until its slowest kept group has
   all its rewards, so a round costs about a group's completion time (a quantile of it when the
   first P of ceil(eta P) are kept), while a pipeline that may run ahead (Fully Async) pays about
   one trajectory's duration per batch in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thundersync_verl.sim import presets
from thundersync_verl.sim.planner import plan_split, split_candidates
from thundersync_verl.sim.prompts import PromptSource
from thundersync_verl.sim.sim_engine import simulate
from thundersync_verl.sim.tail import length_summary

SLOTS_PER_ROLLOUT_GPU = 64  # sequences per rollout B200 at the calibrated decode speed (presets.PAPER_ROLLOUT)
BASE_MODES = ("sync", "async", "fully_async", "thundersync")
TAIL = "thundersync_tail"
SYNC_TAIL = "sync_tail"  # the tail policy with Sync's learner (point 4)


@dataclass(frozen=True)
class Deployment:
    gpus: int
    model: str  # presets.SCALE_MODELS key
    tail: str  # "lognormal" or "pareto"
    batch_per_gpu: int | None  # per rollout GPU of the half/half layout; None: the scale preset's batch

    @property
    def label(self) -> str:
        b = "preset" if self.batch_per_gpu is None else f"b{self.batch_per_gpu}"
        return f"{self.gpus}/{self.model}/{self.tail}/{b}"

    def reference(self):
        """The scale preset at the half/half split (its batch unless batch_per_gpu is given)."""
        batch = None if self.batch_per_gpu is None else self.batch_per_gpu * (self.gpus // 2)
        return presets.scale_setting(self.gpus, self.model, self.tail, batch=batch)

    def setting(self, learner_gpus: int):
        batch = self.reference().workload.batch_size
        return presets.scale_setting(self.gpus, self.model, self.tail, learner_gpus=learner_gpus, batch=batch,
                                     slots=SLOTS_PER_ROLLOUT_GPU * (self.gpus - learner_gpus))


@dataclass(frozen=True)
class Variant:
    """A tail policy: launch factor eta, deferrals K, when queued prompts run."""

    eta: float
    k: int
    rounds: str = "dedicated"

    @property
    def label(self) -> str:
        return f"eta{self.eta:g}_K{self.k}_{self.rounds}"

    def config(self) -> dict:
        return {"tail_eta": self.eta, "tail_max_deferrals": self.k, "tail_rounds": self.rounds}


def run_deployment(dep: Deployment, variants: list[Variant], steps: int, plan_steps: int, seed: int = 0,
                   warmup: int = 3) -> list[dict]:
    """Rows for every base mode and tail variant (module docstring); the first variant sets the tail's split."""
    ref = dep.reference()
    source = PromptSource(ref.workload, ref.rollout, seed=seed)
    candidates = split_candidates(dep.gpus, ref.cluster.replica_gpus)
    rows = []
    for mode, extra in [(m, {}) for m in BASE_MODES] + [(TAIL, variants[0].config())]:
        # the tail's rounds come in cycles (a queued round every few), so its split is scored on the full window
        plan = steps if mode == TAIL else plan_steps
        res, learner, tried = _planned(dep, source, candidates, mode, extra, steps, plan, warmup)
        rows.append(_row(dep, mode, variants[0].label if mode == TAIL else "", res, learner, tried, source, warmup))
        if mode == TAIL:
            for v in variants[1:]:
                cfg = dep.setting(learner).sim_config(TAIL, "grpo", steps, warmup_steps=warmup, **v.config())
                rows.append(_row(dep, TAIL, v.label, simulate(cfg, source, dep.setting(learner).costs), learner,
                                 {}, source, warmup))
    sync_tail = {**variants[0].config(), "granularity": "batch"}
    res, learner, tried = _planned(dep, source, candidates, TAIL, sync_tail, steps, steps, warmup)
    rows.append(_row(dep, SYNC_TAIL, variants[0].label, res, learner, tried, source, warmup))
    times = workload_times(source, range(warmup, steps), variants[0].eta)
    for r in rows:
        r["workload"] = times
    sync = next(r["step_s"] for r in rows if r["mode"] == "sync")
    plain = next(r["step_s"] for r in rows if r["mode"] == "thundersync")
    fa = next(r["step_s"] for r in rows if r["mode"] == "fully_async")
    for r in rows:
        r.update(x_sync=sync / r["step_s"], x_thundersync=plain / r["step_s"], rate_over_fully_async=fa / r["step_s"])
    return rows


def _planned(dep, source, candidates, mode, extra, steps, plan_steps, warmup):
    """(result at the chosen split, learner GPUs, the split search's scores)."""
    seen = {}

    def score(learner: int) -> float:
        s = dep.setting(learner)
        seen[learner] = simulate(s.sim_config(mode, "grpo", plan_steps, warmup_steps=warmup, **extra), source, s.costs)
        return seen[learner].step_time_s

    choice = plan_split(score, candidates)
    res = seen[choice.learner_gpus]
    if steps != plan_steps:
        s = dep.setting(choice.learner_gpus)
        res = simulate(s.sim_config(mode, "grpo", steps, warmup_steps=warmup, **extra), source, s.costs)
    return res, choice.learner_gpus, choice.tried


def _row(dep: Deployment, mode: str, variant: str, res, learner: int, tried: dict, source, warmup: int) -> dict:
    tail = res.extra.get("tail", {})
    window = range(res.warmup_steps, len(res.step_end))
    if mode in (TAIL, SYNC_TAIL):
        tokens = tail["trained_tokens_per_step"]
        lengths = tail["response_tokens"]
    else:
        tokens = float(np.mean([source.batch(k).seq_tokens.sum() for k in window]))
        lengths = response_lengths(source, window) if mode == "sync" else None
    stale = res.staleness_summary()
    return {
        "deployment": dep.label, "gpus": dep.gpus, "model": dep.model, "tail": dep.tail,
        "batch_per_gpu": dep.batch_per_gpu, "batch": source.batch_size, "mode": mode, "variant": variant,
        "learner_gpus": learner, "split_tried": tried, "step_s": res.step_time_s,
        "gpu_hours_per_mtoken": dep.gpus * res.step_time_s / 3600.0 / (tokens / 1e6),
        "staleness_max": stale["max"], "staleness_mean": stale["mean"],
        "wasted_token_share": tail.get("wasted_token_share", 0.0),
        "learner_wasted_share": tail.get("learner_wasted_share", 0.0),
        "deferred_prompt_share": tail.get("deferred_prompt_share", 0.0),
        "delay_rounds_mean": tail.get("delay_rounds_mean", 0.0), "delay_rounds_max": tail.get("delay_rounds_max", 0),
        "pinned_groups_per_step": tail.get("pinned_groups_per_step", 0.0),
        "queued_round_share": tail.get("queued_round_share", 0.0), "queued_round_s": tail.get("queued_round_s"),
        "fresh_round_s": tail.get("fresh_round_s"), "response_tokens": lengths,
        "rollout_idle_tail": res.summary()["rollout_share"]["idle_tail"], "learner_util": res.learner_util,
    }


def response_lengths(source: PromptSource, steps) -> dict:
    """mean / p50 / p90 response tokens of the first attempts of the given steps' prompts (what Sync trains)."""
    parts = []
    for k in steps:
        b = source.batch(k)
        parts.append(b.seq_tokens - (b.prompt_tokens if b.prompt_tokens is not None else 0))
    return length_summary(np.concatenate(parts))


def workload_times(source: PromptSource, steps, eta: float) -> dict:
    """Seconds from a round's start (slots free) to a trajectory's reward, and to a group's last reward (point 4)."""
    traj, group = [], []
    for k in steps:
        b = source.batch(k)
        land = b.dur_s + b.reward_s  # [N] a trajectory started at the push has its reward this much later
        closes = np.full(b.n_groups, -np.inf)
        np.maximum.at(closes, b.group, land)
        traj.append(land)
        group.append(closes)
    traj, group = np.concatenate(traj), np.concatenate(group)
    return {"trajectory_mean_s": float(traj.mean()), "group_completion_mean_s": float(group.mean()),
            "group_completion_p50_s": float(np.percentile(group, 50)),
            "group_completion_at_1_over_eta_s": float(np.percentile(group, 100 / eta)),
            "group_completion_max_s": float(group.max())}
