"""PACE as verl's replay buffer: effective-staleness control for the separate-async (fully-async) trainer.

Why this module exists:
1. verl's V1 separate-async trainer samples finished prompt groups from a ``ReplayBufferAsync``
   and accepts a custom one through ``trainer.v1.sampler.custom_sampler.{path,name}``; that is
   the seam PACE plugs into, so verl's trainer loop, eviction and refill stay verl's own:
       trainer.v1.sampler.custom_sampler.path=pkg://thundersync_verl.algos.pace.pace_sampler
       trainer.v1.sampler.custom_sampler.name=PaceReplayBufferAsync
       +trainer.v1.sampler.sampler_kwargs.pace.{target_pool,gain,waiting_weight,drift_per_version,
                                                prefix_carry,min_score,nats_per_version,per_turn_versions,
                                                log_path,decide_every,scorer,scorer_server_prefix,
                                                rescore}=...
2. At each sample, after verl's own evictions (its drop threshold still applies when set), every
   sampleable group gets the effective-staleness score of ``core/pace.py`` (formulas there); the
   budget comes from the pool's excess over ``target_pool``, and the worst groups within it are
   evicted exactly as verl evicts stale ones (``_clear_groups``) and regenerated through verl's
   ``refill_fn``: never silently lost, and counted (``pace/rejected``, ``pace/rejected_total``).
3. Per-token versions: the project's rollout servers stamp every generate call with the weight
   versions it ran on (``min/max_global_steps``) and the ``thundersync_tool_agent`` loop keeps them
   per turn in ``extra_fields.thundersync_events.turns``; verl's own tool agent keeps only the
   trajectory's min/max, so other agent loops fall back to two half segments (``segments_from_span``).
   Counted per sample as ``pace/per_turn_share``.
4. Metrics (verl's logger): ``pace/rejected``, ``pace/budget``, ``pace/pool``, ``pace/rejected_total``,
   ``pace/rejected_share``, the selected groups' mean score, and the staleness histogram of the
   selected trajectories (verl's ``(global_steps - 1) - max_global_steps``) as ``pace/staleness_hist/<k>``
   counts. ``log_path`` adds one JSON line per decision (the benchmark reads it).
5. ``gain=0`` scores and logs without rejecting: the same buffer measures unfiltered and
   threshold-only runs.
6. Measured drift (``scorer=rollout_server``; default ``none``, the version-count proxy): each trajectory
   is re-scored once, when its group is first scored, by the rollout server holding the newest weights
   (``algos/pace/pace_scorer.py``: cost, and why the servers), and its segments carry the mean absolute log-prob
   gap (formula (3m) of ``core/pace.py``) instead of delta * lag. Counted as ``pace/scored``,
   ``pace/scorer_s`` (seconds on the sample path), ``pace/drift_nats/mean``, ``pace/nats_per_version``
   and ``pace/scored_version`` (the version that re-scored). ``rescore=decision`` (default ``landing``)
   re-scores every pooled trajectory again at each new learner version, so m_j also covers the drift
   while it waited: set ``waiting_weight=0`` with it, or the wait counts twice.
   A landed trajectory's per-turn versions (``extra_fields``) and the tensors the scorer needs come from
   one TransferQueue read (``_read_stored``), and a decision re-scores everything it needs in one call.
7. ``decide_every=step`` (default) spends the budget at the first sample of each training step, so
   the rejected groups are regenerated together, in one refill; ``sample`` decides at every
   mini-batch sample (measured with ``benchmarks/pace.py --quick`` on 2 shared CPU cores: deciding
   at every sample, the trickle of small refills made PACE's steps 12.8-15.9 s, learner compute ~2x;
   once per step, 5.9-8.1 s like the other fully-async runs, at the same tokens).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import pace as pc
from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError, rule_message
from thundersync_verl.algos.pace.pace_scorer import DEFAULT_SERVER_PREFIX, RolloutServerScorer
from thundersync_verl.step.samplers import FastPollReplayBufferAsync

OPTIONS_KEY = "pace"
HIST_LABELS = ("0", "1", "2", "3", "4plus")
DECIDE_EVERY = ("step", "sample")
SCORERS = ("none", "rollout_server")
SCORE_FIELDS = ["prompts", "responses", "response_mask", "rollout_log_probs"]
SAMPLER_KEYS = {"per_turn_versions", "log_path", "decide_every", "scorer", "scorer_server_prefix", "rescore"}
RESCORE = ("landing", "decision")


def pace_options(sampler_kwargs) -> tuple[pc.PaceSettings, bool, str | None, str, str, str, str]:
    """``(settings, per_turn_versions, log_path, decide_every, scorer, scorer_server_prefix, rescore)``
    from ``sampler_kwargs.pace``."""
    options = dict((sampler_kwargs or {}).get(OPTIONS_KEY) or {})
    per_turn = bool(options.pop("per_turn_versions", True))
    log_path = options.pop("log_path", None)
    every = str(options.pop("decide_every", "step"))
    scorer = str(options.pop("scorer", "none"))
    prefix = str(options.pop("scorer_server_prefix", DEFAULT_SERVER_PREFIX))
    rescore = str(options.pop("rescore", "landing"))
    known = set(pc.PaceSettings.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise StreamingConfigError(rule_message(
            f"unknown PACE option(s) {unknown} in trainer.v1.sampler.sampler_kwargs.pace",
            "a misspelt knob would silently run PACE with its default",
            f"use only {sorted(known | SAMPLER_KEYS)}"))
    if every not in DECIDE_EVERY:
        raise StreamingConfigError(rule_message(
            f"pace.decide_every must be one of {DECIDE_EVERY}, got {every!r}",
            "the budget is spent once per training step or at every mini-batch sample",
            "set pace.decide_every=step (default) or sample"))
    if scorer not in SCORERS:
        raise StreamingConfigError(rule_message(
            f"pace.scorer must be one of {SCORERS}, got {scorer!r}",
            "the drift is the version-count proxy or measured by re-scoring on the rollout servers",
            "set pace.scorer=none (default) or rollout_server"))
    if rescore not in RESCORE:
        raise StreamingConfigError(rule_message(
            f"pace.rescore must be one of {RESCORE}, got {rescore!r}",
            "a trajectory is re-scored once when its group lands, or again at every new learner version",
            "set pace.rescore=landing (default) or decision"))
    settings = pc.PaceSettings(**options).validate()
    return settings, per_turn, (str(log_path) if log_path else None), every, scorer, prefix, rescore


def _turn_segments(turns) -> list[pc.Segment] | None:
    """Segments from the agent loop's per-turn versions; a turn that spanned a push is split in two halves."""
    if not turns or any("min_version" not in t for t in turns):
        return None
    segments: list[pc.Segment] = []
    for turn in turns:
        segments += pc.segments_from_span(int(turn["gen_tokens"]), int(turn["min_version"]), int(turn["max_version"]))
    return segments


def _read_stored(keys: list[str], partition_id: str, plain: list[str], tensors: list[str]) -> list[dict]:
    """``plain`` and ``tensors`` fields of stored trajectories in ONE TransferQueue read (``verl_adapter``)."""
    return va.replay_buffer_read(keys, partition_id, plain, tensors)


class PaceReplayBufferAsync(FastPollReplayBufferAsync):
    """verl's ReplayBufferAsync (with the project's short poll) plus PACE's ranking and rejection."""

    def __init__(self, *args, sampler_kwargs=None, **kwargs):
        super().__init__(*args, sampler_kwargs=sampler_kwargs, **kwargs)
        (self.pace, self.per_turn, self.log_path, self.decide_every, self.scorer_kind, self.scorer_prefix,
         self.rescore) = pace_options(sampler_kwargs)
        temperature = va.rollout_temperature_of(self.refill_fn)
        if self.scorer_kind != "none" and temperature is not None and float(temperature) != 1.0:
            raise StreamingConfigError(rule_message(
                f"pace.scorer={self.scorer_kind} with actor_rollout_ref.rollout.temperature={temperature}",
                "the servers' prompt log-probs are at temperature 1 and the rollout's at its own temperature, so the "
                "measured drift would compare different distributions (algos/pace/pace_scorer.py point 4)",
                "set pace.scorer=none (the version-count proxy), or sample at temperature 1"))
        self._scored_at: dict[str, int] = {}  # trajectory key -> learner version when it was last re-scored
        self.scorer: RolloutServerScorer | None = None  # built at the first measurement (the servers exist then)
        self.calibration = pc.DriftCalibration()
        if self.pace.gain > 0 and self.refill_fn is None:
            raise StreamingConfigError(rule_message(
                "PACE with gain > 0 needs verl's refill_fn",
                "a rejected group must be regenerated, never silently lost",
                "build the buffer through verl's trainer (it passes refill_fn), or set pace.gain=0"))
        self._landed: dict[str, int] = {}  # uid -> learner version when its group was first seen finished
        self._segments: dict[str, tuple[list[pc.Segment], bool]] = {}  # trajectory key -> (segments, per turn)
        self._step: int | None = None
        self._decided_step: int | None = None  # decide_every=step: the step whose budget was spent
        self._metrics: dict = {}
        self.rejected_total = 0
        self.sampled_total = 0

    # -- verl's hooks ------------------------------------------------------------------------
    def _terminal_eviction_reasons(self, global_steps: int, partition_id: str):
        reasons = super()._terminal_eviction_reasons(global_steps, partition_id)
        if partition_id != "val":
            self._note_landings(global_steps, partition_id)
        return reasons

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        self._step, self._metrics = global_steps, {}
        try:
            batch, metrics = super().sample(global_steps=global_steps, partition_id=partition_id, batch_size=batch_size)
        finally:
            self._step = None
        metrics.update(self._metrics)
        return batch, metrics

    def _select_prompt_uids(self, partition_id: str, sampleable_keys: set[str], batch_size: int):
        if partition_id == "val" or self._step is None:
            return super()._select_prompt_uids(partition_id, sampleable_keys, batch_size)
        keep, decision, scores = self._reject(partition_id, set(sampleable_keys), batch_size)
        selected, partition_snapshot, steps_snapshot = super()._select_prompt_uids(partition_id, keep, batch_size)
        self._record(decision, scores, selected, partition_snapshot)
        return selected, partition_snapshot, steps_snapshot

    # -- PACE --------------------------------------------------------------------------------
    def _note_landings(self, global_steps: int, partition_id: str) -> None:
        finished = self.finished_keys[partition_id]
        for uid in finished:
            self._landed.setdefault(uid, global_steps - 1)
        live = finished | self.failure_keys[partition_id]
        for uid in [u for u in self._landed if u not in live]:
            del self._landed[uid]
        for key in [k for k in self._segments if k.split("_")[0] not in live]:
            del self._segments[key]
            self._scored_at.pop(key, None)

    def _reject(self, partition_id: str, sampleable: set[str], batch_size: int):
        learner_version = self._step - 1
        members: dict[str, list[str]] = {uid: [] for uid in sampleable}
        for key in self.partitions[partition_id]:
            uid = key.split("_")[0]
            if uid in members:
                members[uid].append(key)
        self._load_segments(partition_id, [k for keys in members.values() for k in keys])
        scores = {uid: self._group_score(uid, keys, learner_version) for uid, keys in members.items()}
        spent = self.decide_every == "step" and self._decided_step == self._step
        settings = replace(self.pace, gain=0.0) if spent else self.pace
        self._decided_step = self._step
        decision = pc.decide(scores, batch_size, settings, self.prompt_global_steps[partition_id])
        if decision.rejected:
            self._clear_groups(partition_id, set(decision.rejected))  # verl's eviction of a stale group
            self.refill_fn(len(decision.rejected))  # ...and verl's refill: the prompts are generated again
            self.rejected_total += len(decision.rejected)
        return sampleable - set(decision.rejected), decision, scores

    def _load_segments(self, partition_id: str, keys: list[str]) -> None:
        """Segments of the newly landed ``keys`` and, with a scorer, their measured drift (plus, with
        ``rescore=decision``, the pooled ones not re-scored at this learner version): every field
        needed comes from ONE TransferQueue read (``_read_stored``)."""
        missing = [k for k in keys if k not in self._segments]
        measure = self.scorer_kind != "none"
        again = [k for k in keys if k in self._segments and self._scored_at.get(k, -1) < self._step - 1] \
            if measure and self.rescore == "decision" else []
        plain = ["extra_fields"] if self.per_turn and missing else []
        tensors = SCORE_FIELDS if measure else []
        read = missing + again if tensors else (missing if plain else [])
        stored = dict(zip(read, _read_stored(read, partition_id, plain, tensors))) if read else {}
        for key in missing:
            events = (stored.get(key, {}).get("extra_fields") or {}).get("thundersync_events") or {}
            per_turn = _turn_segments(events.get("turns"))
            if per_turn is None:
                tag = self.partitions[partition_id][key]
                lo, hi = tag.get("min_global_steps"), tag.get("max_global_steps")
                lo = int(lo if lo is not None else tag.get("global_steps", 0))
                hi = int(hi if hi is not None else lo)
                self._segments[key] = (pc.segments_from_span(int(tag.get("response_len", 1)), lo, hi), False)
            else:
                self._segments[key] = (per_turn, True)
        if measure and read:
            self._measure(read, [stored[k] for k in read])

    def _measure(self, keys: list[str], rows: list[dict]) -> None:
        """(3m): re-score ``keys`` (their stored ``SCORE_FIELDS`` in ``rows``) on the rollout servers; their
        segments carry the measured drift in nats."""
        if self.scorer is None:
            self.scorer = RolloutServerScorer.discover(self.scorer_prefix)
        t0 = time.perf_counter()
        current, version = self.scorer.score([(r["prompts"].tolist(), r["responses"].tolist()) for r in rows])
        spent = time.perf_counter() - t0
        drifts = []
        for key, row, lp in zip(keys, rows, current):
            if lp.shape != row["rollout_log_probs"].shape:
                raise StreamingInputError(rule_message(
                    f"trajectory {key}: {tuple(lp.shape)} re-scored log-probs for {tuple(row['rollout_log_probs'].shape)} "
                    "rollout log-probs", "the measured drift compares the two token by token",
                    "check that the rollout stores rollout_log_probs for every response token"))
            segments, per_turn = self._segments[key]
            measured = pc.measured_drift_nats(segments, row["rollout_log_probs"], lp, row["response_mask"])
            # m_j spans the versions from u_j to the one that re-scored (the landing one, unless rescored later)
            scored = version if version is not None else self._landed.get(key.split("_")[0], self._step - 1)
            self.calibration.observe(measured, scored)
            self._scored_at[key] = self._step - 1
            self._segments[key] = (measured, per_turn)
            drifts += [s.drift for s in measured for _ in range(s.tokens)]
        self._metrics["pace/scored"] = self._metrics.get("pace/scored", 0) + len(keys)
        self._metrics["pace/scorer_s"] = self._metrics.get("pace/scorer_s", 0.0) + spent
        self._metrics["pace/drift_nats/mean"] = sum(drifts) / max(len(drifts), 1)
        self._metrics["pace/scorer_parked"] = len(self.scorer.parked)
        if version is not None:
            self._metrics["pace/scored_version"] = version

    def _group_score(self, uid: str, keys: list[str], learner_version: int) -> float:
        landed = self._landed.get(uid, learner_version)
        waiting = pc.waiting_staleness(learner_version, landed)
        if not keys:
            return pc.effective_staleness(0.0, waiting, self.pace)
        per_version = self.calibration.per_version(self.pace)
        values = [pc.effective_staleness(pc.generation_staleness(
            pc.in_version_units(self._segments[k][0], per_version, self.pace), landed, self.pace),
            waiting, self.pace) for k in keys]
        return sum(values) / len(values)

    def _record(self, decision: pc.PaceDecision, scores: dict, selected: list[str], snapshot: dict) -> None:
        """Metrics for verl's logger and, with ``log_path``, one JSON line per decision."""
        chosen = set(selected)
        keys = [k for k in snapshot if k.split("_")[0] in chosen]
        learner_version = self._step - 1
        staleness = [learner_version - int(snapshot[k].get("max_global_steps") or 0) for k in keys]
        per_turn = [self._segments[k][1] for k in keys if k in self._segments]
        self.sampled_total += len(selected)
        hist = pc.histogram(staleness)
        self._metrics.update({
            "pace/rejected": len(decision.rejected), "pace/budget": decision.budget, "pace/pool": decision.pool,
            "pace/rejected_total": self.rejected_total, "pace/sampled_total": self.sampled_total,
            "pace/rejected_share": self.rejected_total / max(self.rejected_total + self.sampled_total, 1),
            "pace/score_selected/mean": sum(scores[u] for u in selected) / max(len(selected), 1),
            "pace/per_turn_share": sum(per_turn) / max(len(per_turn), 1),
            "pace/nats_per_version": self.calibration.per_version(self.pace),
            **{f"pace/staleness_hist/{label}": n for label, n in zip(HIST_LABELS, hist)},
        })
        if self.log_path:
            line = {"t": time.time(), "step": self._step, "pool": decision.pool, "needed": decision.needed,
                    "budget": decision.budget, "rejected": {u: scores[u] for u in decision.rejected},
                    "selected": {u: scores[u] for u in selected}, "selected_staleness": staleness,
                    "per_turn_share": self._metrics["pace/per_turn_share"],
                    "scored": self._metrics.get("pace/scored", 0), "scorer_s": self._metrics.get("pace/scorer_s", 0.0),
                    "nats_per_version": self._metrics["pace/nats_per_version"]}
            os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
            with open(self.log_path, "a") as f:
                f.write(json.dumps(line) + "\n")
