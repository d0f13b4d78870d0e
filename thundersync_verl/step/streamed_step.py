"""One streamed step for every algorithm: arrivals in, planned backwards out, one optimizer step.

Why:
1. GRPO and OPD stream the same way: poll what landed in verl's TransferQueue, hand it to a
   planner, send the planner's ops to the learner (queued, ``OpPipeline``), and take ONE optimizer
   step once the batch is complete. Only what "landed" means differs (whole trajectories, or scored
   turns plus finished trajectories) and which planner turns it into ops. So there is one loop here
   (``StreamedStep.run``), one timeout, one polling interval and one coalescing rule, and a small
   algorithm object per algorithm (``GRPOArrivals`` below, ``OPDArrivals`` in ``opd_trainer_step.py``).
2. Per-step state lives in one ``StepState``; the step reads what it needs from ``StepContext``
   (given by the trainer) and writes nothing back onto the trainer.
3. Stages, each in one file: arrival (``trajectory_source.py``, ``opd_trainer_step.TurnSource``) ->
   plan (``stream_plan.py`` / ``opd_stream.py``) -> backward/fold (``stream_exec.py`` -> the learner's
   ``streaming_worker.py``) -> barrier (the planner's ``finalize``) -> step (``finalize_step``) -> push
   (the trainer's ``on_step_end``).
   With several mini-batches (``minibatch_plan.py``) the planner's ``StepOp`` s come in the op stream:
   the pipeline drains, the learner steps (no LR step) and a new learner batch opens for the next
   mini-batch; the last step is still ``finalize``'s.
4. The next learner call is planned just in time (``_plan_at``): when the calls the learner holds are expected to
   end (``core/call_cost.py``, learnt from the run's own calls) minus the lead a plan takes to reach the learner,
   the driver lists the TransferQueue once and queues what landed. Planned only once the learner was idle, each
   call left it waiting for the plan, the chunk and the dispatch (0.48 s a step on the emulated device; 0.25-0.29
   s with this planning). The free-slot GRPO planning uses it; the batch-order gate, OPD and SAO plan as before.
   With ``thundersync.call_efficiency`` (off by default) an idle learner's call waits for more rows while they would
   make it efficient (``call_cost.call_waits``): with a fixed cost per call that outweighs a row's work, taking one
   or two rows at a time spends most of the learner on that fixed part. It waits only while less than one
   efficient call's rows are ready, so it delays at most that much work.
5. Nothing is half-applied: every failure (a trajectory that never lands, a refused op, a missing turn)
   raises before ``finalize_step``, so the optimizer never steps on part of a batch. With several
   mini-batches the steps of the mini-batches already complete stay applied (each is a whole mini-batch).
6. A lost Ray node is noticed while the driver waits (``StepContext.lost_nodes``, asked every ``NODE_WATCH_S``
   of fruitless waiting): an agent loop that died with its node reports nothing, so without the watch the step
   stopped only at ``trajectory_timeout_s`` (600 s by default). The watch raises ``NodeLeft`` as soon as Ray's
   head has declared the node dead (its health checks, ~15-30 s); the trainer turns it into the stop that names
   the node (``run/resume.py`` point 4). A node-table read is one GCS call: every 5 s it costs nothing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from thundersync_verl.core.call_cost import call_waits
from thundersync_verl.run.step_record import StepRecorder, first_rank
from thundersync_verl.step.contracts import Algorithm, AlgorithmDefaults, Planner
from thundersync_verl.step.stream_exec import OpPipeline, fetch_rows, op_kind, rollout_as_old_log_probs
from thundersync_verl.step.minibatch_plan import StepOp
from thundersync_verl.step.stream_plan import INDEPENDENT_BUCKETS_KEY, StreamPlanner
from thundersync_verl.step.tail_gate import TailGate, TailRound
from thundersync_verl.step.trajectory_source import ArrivalSource, Arrivals, BatchOrderGate, TrajectorySource


POLL_CAP_S = 0.08  # the longest pause between two empty TransferQueue listings (``StreamedStep._wait``)
LISTING_SHARE = 0.02  # listings take at most about this share of the driver's waiting time (``StreamedStep._wait``)
LISTING_SHARE_MIN_BATCH = 1024  # ... in batches of at least this many trajectories (smaller ones list on the pause)
NODE_WATCH_S = 5.0  # while waiting for rows, how often the driver asks Ray whether a node has left (point 6)


class NodeLeft(RuntimeError):
    """A Ray node alive when the run started left while the step waited for its rows (point 6)."""

    def __init__(self, nodes: list[str]):
        super().__init__(f"Ray node(s) {'; '.join(nodes)} left the cluster while the step waited for trajectories")
        self.nodes = list(nodes)


@dataclass
class StepContext:
    """What a streamed step needs from the trainer (read only)."""

    worker_group: Any  # the streaming learner (``streaming_worker.StreamingActorWorker`` group)
    tq: Any  # verl's TransferQueue client module
    recorder: StepRecorder
    make_pipeline: Callable[[Callable], OpPipeline]  # on_done -> the batch's learner queue
    forward_at_theta_k: Callable[[list, list], dict]  # learner_forward=separate: verl's forward, its metrics
    uids: list[str]  # the batch's prompts
    n: int  # trajectories per prompt
    timeout_s: float  # thundersync.trajectory_timeout_s
    poll_s: float  # thundersync.poll_s
    coalesce: bool  # thundersync.coalesce
    fused_forward: bool  # thundersync.learner_forward == "fused"
    memory_budget_bytes: int | None = None  # thundersync.memory_budget_bytes: this rank's bucket bytes at once
    bucket_device: str = "auto"  # thundersync.bucket_device: where the learner's buckets live (core/bucket_memory.py)
    ref_log_probs: Callable[[list, list], dict] | None = None  # use_kl_loss: (keys, tags) -> {key: reference log-probs}
    deterministic: bool = False  # thundersync.deterministic: batch order, whole chunks (trajectory_source point 4)
    values: Callable[[list, list], dict] | None = None  # SAO: (keys, tags) -> {key: the critic's values}, on arrival
    lost_nodes: Callable[[], list] | None = None  # () -> the nodes that left since the run started (point 6)
    tail: TailRound | None = None  # thundersync.tail: the batch is the first P complete groups (tail_gate.py)
    call_efficiency: float = 0.0  # thundersync.call_efficiency: an idle learner's call waits to be this efficient (0: no)


@dataclass
class StepState:
    """Everything one streamed step has seen and measured."""

    t_start: float
    rows: dict = field(default_factory=dict)  # trajectory key -> row (stream_exec.fetch_rows)
    keys: list = field(default_factory=list)  # landed trajectories, in arrival order
    tags: list = field(default_factory=list)
    forward_metrics: dict = field(default_factory=dict)  # learner_forward=separate
    lp_gap: float = float("-inf")  # max |log p_rollout - log p_learner| measured by the backwards
    kl_sum: float = 0.0  # OPD: log pi - log p_teacher summed over scored tokens, from the backwards
    kl_tokens: float = 0.0
    rollout_makespan_s: float = 0.0
    listings: int = 0  # TransferQueue listings (controller RPCs on the host's cores) the driver made for the batch
    listing_s: float = 0.0  # wall seconds of those listings
    fetch_s: float = 0.0  # wall seconds of the TransferQueue reads of landed rows (``fetch_rows``)
    budget_waits: int = 0  # plans that held ready rows back because their buckets did not fit the budget
    planned_ahead: int = 0  # plans made while the learner still computed, timed to reach it as it goes idle
    minibatch_steps: int = 0  # optimizer steps taken before the batch's last (several mini-batches / epochs)
    peak_bucket_bytes: int = 0  # the largest bucket bytes a mini-batch step before the last reported
    tail_kept: dict = field(default_factory=dict)  # thundersync.tail: kept prompt uid -> its place in the batch
    tail_dropped: list = field(default_factory=list)  # ... launched prompts not in the batch (requeued by the trainer)
    sums: dict = field(default_factory=dict)  # other per-op counts summed over the step (SAO: masked / scored tokens)


class StreamedStep:
    """The streamed step of one batch (module docstring). ``algo``: ``GRPOArrivals`` / ``OPDArrivals``."""

    def __init__(self, ctx: StepContext, algo: Algorithm):
        self.ctx, self.algo = ctx, algo
        self.planner: Planner = algo.planner
        self.state = StepState(t_start=ctx.recorder.t_step_start)
        trajectories = TrajectorySource(ctx.tq.kv_list, ctx.uids, ctx.n, timeout_s=ctx.timeout_s)
        turns = algo.begin(ctx)
        gate = None
        if ctx.tail is not None:
            if turns is not None or ctx.deterministic:
                raise ValueError("thundersync.tail keeps whole GRPO groups in completion order: it streams neither "
                                 "OPD's turns nor thundersync.deterministic's batch order. Set thundersync.tail.eta=1 "
                                 "(off) for those.")
            gate = TailGate(ctx.uids, ctx.n, ctx.tail.p, ctx.tail.pinned, on_abort=self._abort)
        elif ctx.deterministic:
            if turns is not None:
                raise ValueError("thundersync.deterministic=true orders whole trajectories; OPD streams turns, which "
                                 "it cannot order. Set thundersync.deterministic=false for OPD.")
            gate = BatchOrderGate(ctx.uids, ctx.n, algo.planner.max_chunk_size, content=self._row_content)
        self.source = ArrivalSource(trajectories, turns, gate)
        self.pipe = ctx.make_pipeline(self._op_done)
        self._held = 0  # ready rows the last plan could not place
        self._pause, self._next_listing = ctx.poll_s, 0.0  # the TransferQueue listing schedule (``_wait``)
        # free-slot, just-in-time planning (``_next_ops``, ``_plan_at``): coalescing GRPO without the batch-order gate
        self._capped = ctx.coalesce and not ctx.deterministic and self.planner.fills_free_slots
        self._ahead = False  # the last ``_plan_now`` said yes only because the learner is about to go idle
        self._listed_for: float | None = None  # the plan moment the last just-in-time listing was made for
        # the rollout's log-probs ride with each row: verl's old-log-prob check, or rollout correction's IS weights
        self._rollout_lp = ctx.fused_forward or self.planner.verl_settings.get("rollout_is") is not None
        self._t_listing: float | None = None  # when the last listing began
        self._landed_tokens = 0  # prompt + response tokens of the rows landed so far (``_call_waits``)
        self._next_node_check = time.time() + NODE_WATCH_S  # point 6

    def run(self) -> tuple[dict, StepState]:
        """Stream the batch and step once; returns the learner's step metrics and the step's state."""
        ctx, planner = self.ctx, self.planner
        meta = {"loss_agg_mode": planner.loss_agg_mode, **planner.verl_settings}  # the learner re-checks
        if planner.independent_buckets:  # minibatch_plan point 7
            meta[INDEPENDENT_BUCKETS_KEY] = True
        if ctx.memory_budget_bytes is not None:  # the learner enforces it too: a bucket never exceeds it
            meta["memory_budget_bytes"] = int(ctx.memory_budget_bytes)
        meta["bucket_device"] = ctx.bucket_device
        self._meta = meta
        ctx.worker_group.stream_begin_batch(meta)
        try:
            while not self.source.done or planner.ready_count:
                self._admit(self._wait())
                if ctx.coalesce and not self._plan_now():
                    if self.source.done and self.pipe.in_flight:  # nothing left to poll for: wait for a free slot
                        self.pipe.collect(keep=self.pipe.in_flight - 1)
                    continue
                ops = self._next_ops()
                self.state.budget_waits += bool(self._held)
                self.state.planned_ahead += bool(self._ahead and ops)
                for op in ops:
                    self._submit(op)
                self._t_listing = None  # a plan without a listing of its own begins at its submit
                if not ops and self.source.done:
                    time.sleep(ctx.poll_s)  # rows held back by the memory budget: wait for the learner
            if isinstance(self.source.gate, TailGate):
                self.state.tail_kept = dict(self.source.gate.places)
                self.state.tail_dropped = list(self.source.gate.dropped)
            self.state.listings = self.source.trajectories.listings
            self.state.listing_s = self.source.trajectories.listing_s
            times = self.source.trajectories.arrival_time.values()
            self.state.rollout_makespan_s = max(times, default=self.state.t_start) - self.state.t_start
            if ctx.fused_forward and self.state.keys:  # bypass: verl's old_log_probs are the rollout's, for
                rollout_as_old_log_probs(ctx.tq, self.state.keys)  # verl's advantages; while the learner finishes
            self.pipe.drain()
            self.algo.check_complete(self.state)
            final = planner.finalize()
            t0 = time.time()
            out = ctx.worker_group.finalize_step(final.scale)
            ctx.recorder.learner_op("optimizer", t0, time.time())
        finally:
            self.algo.close()
            # The pipeline's callback and the gate's row reader are this step's bound methods: cycles that hold
            # every row of the batch (token lists, log-probs) until Python's rare full collection. Broken here,
            # the rows go with the step (a long run's driver grew ~160 KB a step without it; benchmarks/soak.py).
            self.pipe = self.source = None
        return out, self.state

    def metrics(self, out) -> dict:
        """verl's and ThunderSync's metrics of the finished step."""
        state = self.state
        metrics = dict(state.forward_metrics)
        if math.isfinite(state.lp_gap):
            metrics["training/rollout_logprob_diff_max"] = state.lp_gap
        metrics.update(self.ctx.recorder.finish_step(out, self.planner.memory()))
        first = first_rank(out)
        metrics["thundersync/peak_bucket_bytes"] = max(state.peak_bucket_bytes, first.get(
            "thundersync/peak_bucket_bytes", first.get("stream/peak_bytes", 0)))  # over every mini-batch of the batch
        metrics["thundersync/budget_waits"] = state.budget_waits
        metrics["thundersync/listings"] = state.listings
        metrics["thundersync/listing_s"] = state.listing_s  # the driver's polling, per step (multi-node costs)
        metrics["thundersync/fetch_s"] = state.fetch_s  # its TransferQueue reads of the landed rows
        metrics["thundersync/planned_ahead"] = state.planned_ahead
        metrics.update(self.algo.metrics(self.state, self.ctx))
        return metrics

    # ----- stages ---------------------------------------------------------------------------
    def _submit(self, op) -> None:
        """Queue ``op`` on the learner; a mini-batch's ``StepOp`` steps in order, then opens the next mini-batch."""
        if not isinstance(op, StepOp):
            self.pipe.submit(op, self.state.rows, tokens=self._op_tokens(op), t_plan=self._t_listing)
            return
        self.pipe.drain()  # every backward of this mini-batch is in the gradient
        t0 = time.time()
        step = self.ctx.worker_group.finalize_step(op.scale, op.lr_step)
        self.ctx.recorder.learner_op("optimizer", t0, time.time())
        self.state.minibatch_steps += 1
        first = first_rank(step)
        if hasattr(first, "get"):
            self.state.peak_bucket_bytes = max(self.state.peak_bucket_bytes, int(first.get("thundersync/peak_bucket_bytes", 0)))
        self.ctx.worker_group.stream_begin_batch(self._meta)  # tickets restart at 0: a new pipeline
        self.pipe = self.ctx.make_pipeline(self._op_done)

    def _plan_now(self) -> bool:
        """Plan while the learner is idle, for a full chunk (``eager_full_chunks``), at the end, or just in time for
        the learner to go on without a gap (``_plan_at``), only into a free pipeline slot; else rows wait to share.

        Rows the last plan held back (their buckets did not fit the memory budget) can only run once
        something new lands (a group closing frees its buckets), so they alone never trigger a plan.
        """
        ready, self._ahead = self.planner.ready_count, False
        if ready == 0 or (ready <= self._held and not self.source.done):
            return False
        if self.pipe.in_flight >= self.pipe.depth:  # the learner has its next call: keep polling meanwhile
            return False
        if self.pipe.in_flight == 0 and not self.source.done:
            return not self._call_waits(ready)
        if self.source.done or (ready >= self.planner.max_chunk_size and self.planner.eager_full_chunks):
            return True
        plan_at = self._plan_at()
        self._ahead = plan_at is not None and time.time() >= plan_at
        return self._ahead

    def _plan_at(self) -> float | None:
        """When to plan the next call so that it reaches the learner as the learner finishes the calls in flight
        (``core/call_cost.py``): the expected end of the queue minus the lead from a plan to the learner. None
        without an estimate yet, and outside the free-slot planning (``_next_ops``)."""
        if not self._capped:
            return None
        idle_at = getattr(self.pipe, "learner_idle_at", lambda: None)()
        cost = getattr(self.pipe, "cost", None)
        if idle_at is None or getattr(cost, "lead_s", None) is None:
            return None
        return idle_at - cost.margin_s

    def _call_waits(self, ready: int) -> bool:
        """An idle learner's call waits for rows still to land (point 4, ``call_cost.call_waits``): the free-slot
        planning of a whole GRPO batch only (OPD's rows are turns; the tail gate's aborted groups never land)."""
        cost, keys, src = getattr(self.pipe, "cost", None), self.state.keys, self.source.trajectories
        if self.ctx.call_efficiency <= 0.0 or not (self._capped and isinstance(self.planner, StreamPlanner)) \
                or self.ctx.tail is not None or cost is None or not keys:
            return False  # off (the default): no ranking here, the plan ranks once
        mean = self._landed_tokens / len(keys)  # a row's tokens, from those landed
        return call_waits(cost, chunk_tokens=self.planner.next_chunk_size() * mean, ready_tokens=ready * mean,
                          coming_tokens=(src.expected - len(src.seen)) * mean,
                          full_tokens=self.planner.max_chunk_size * mean, efficiency=self.ctx.call_efficiency)

    def _next_ops(self) -> list:
        """The planner's next ops. Coalescing, a GRPO plan fills the pipeline's free slots only (``next_ops``'s
        ``max_backwards``): the driver goes back to polling instead of blocking on a full pipeline, and the rows
        left over join later arrivals in larger chunks (fewer learner calls, each with its fixed cost). The
        deterministic gate fixes every chunk's rows itself, so it plans all it released at once, as before."""
        planner = self.planner
        if not self._capped:
            ops = planner.next_ops()
            self._held = planner.ready_count  # rows left: held back by the memory budget
            return ops
        # >= 1 free slot here (``_plan_now``). A fold takes a slot too, and folds are never held back: with more folds
        # than free slots, the driver waits for the head call before queueing the rest.
        free = self.pipe.depth - self.pipe.in_flight
        ops = planner.next_ops(max_backwards=max(0, free - planner.queued_folds))
        self._held = planner.held_count
        return ops

    def _wait(self) -> Arrivals:
        """Poll until something new lands, the batch is complete, or (coalescing) a chunk should go.

        A listing is an RPC to the TransferQueue controller, on the host that runs the agent loops and verifier.
        1. Each empty poll doubles the pause, ``poll_s`` up to ``max(poll_s, POLL_CAP_S)`` (a fixed 10 ms took a
           quarter of a core); only an arrival resets it, so a plan after a finished call adds no listing (with
           the deterministic gate every pass lists: a listing is when the gate hands on its next block).
        2. While the learner is busy until a known plan moment (``_plan_at``), only that moment's own listing is
           made: nothing planned earlier reaches the learner sooner, and it takes every row landed by then (the
           emulated device listed ~170 times for ~50 calls before, each landing restarting the short pause). It
           still wakes every ``POLL_CAP_S`` for a learner done early (waking on the call gained nothing in pairs).
        3. A listing returns the whole partition (about 30 ms at 16k trajectories, ``driver_throughput.py``): from
           ``LISTING_SHARE_MIN_BATCH`` trajectories the pause is at least the last listing's time over
           ``LISTING_SHARE`` once that exceeds ``POLL_CAP_S`` (16k: one listing every ~1.5 s). Smaller batches keep
           the plain schedule: on a loaded host their listing can take tens of ms, and 50x that would let the
           whole batch land unseen.
        """
        while True:
            self.pipe.collect()
            if self.ctx.coalesce and self._plan_now():
                return Arrivals()
            plan_at = self._plan_at() if self.pipe.in_flight else None
            now = time.time()
            # the moment to plan ahead came and a slot is free: one listing first, so the call takes all that landed
            just_in_time = (plan_at is not None and plan_at != self._listed_for and now >= plan_at
                            and self.pipe.in_flight < self.pipe.depth)
            # the learner is busy until a known plan moment: that moment's listing takes whatever lands before it
            held = plan_at is not None and now < plan_at
            if ((now >= self._next_listing and not held) or just_in_time or self.source.done
                    or isinstance(self.source.gate, BatchOrderGate)):
                if just_in_time:
                    self._listed_for = plan_at
                self._t_listing = time.time()  # a plan that follows begins here (the pipeline's lead)
                arrivals = self.source.poll(release=self.planner.ready_count <= self._held)  # the gate: a block at a time
                self._pause = self.ctx.poll_s if arrivals else min(2 * self._pause, max(self.ctx.poll_s, POLL_CAP_S))
                floor = self.source.trajectories.last_listing_s / LISTING_SHARE  # listings: a bounded share
                large = self.source.trajectories.expected >= LISTING_SHARE_MIN_BATCH
                self._next_listing = time.time() + (max(self._pause, floor) if large and floor > POLL_CAP_S
                                                    else self._pause)
                if arrivals or self.source.done:
                    return arrivals
                if time.time() - self.state.t_start > self.ctx.timeout_s:
                    raise self.source.never_arrived()
                self._watch_nodes()
            wake = min(plan_at, now + POLL_CAP_S) if held else self._next_listing  # a learner done early: seen
            if plan_at is not None and (plan_at != self._listed_for or self.planner.ready_count > self._held):
                wake = min(wake, max(plan_at, time.time() + self.ctx.poll_s))  # past it, the head call is late
            time.sleep(max(0.0, wake - time.time()))

    def _abort(self, uids: list[str]) -> None:
        """The tail gate's places are full: the free groups still running will not be kept (tail_gate.py point 3).
        Their prompts' failures and late trajectories are no longer this step's business."""
        self.source.trajectories.uids -= set(uids)
        if self.ctx.tail.on_abort is not None:
            self.ctx.tail.on_abort(list(uids))

    def _watch_nodes(self) -> None:
        """Point 6: after a fruitless listing, at most every ``NODE_WATCH_S``, ask whether a node has left."""
        if self.ctx.lost_nodes is None or time.time() < self._next_node_check:
            return
        lost = self.ctx.lost_nodes()
        self._next_node_check = time.time() + NODE_WATCH_S
        if lost:
            raise NodeLeft(lost)

    def _admit(self, arrivals: Arrivals) -> None:
        t_seen, state = time.time(), self.state
        for turn, tag in arrivals.turns:
            self.algo.admit_turn(turn, tag, state, t_seen)
        if not arrivals.trajectories:
            return
        keys = [k for k, _ in arrivals.trajectories]
        missing = [k for k in keys if k not in state.rows]  # the deterministic gate may have read some already
        self._fetch(missing)
        rows = {k: state.rows[k] for k in keys}
        gate = self.source.gate
        planned = {}
        for key, tag in arrivals.trajectories:
            planned[key] = key if gate is None else gate.alias[key]  # deterministic: ids by batch place, not random uids
            state.rows[planned[key]] = rows[key]
            self.ctx.recorder.trajectory(key, rows[key]["extra"], rows[key]["reward"], t_reward=t_seen)
            state.keys.append(key)
            state.tags.append(tag)
        tags = [t for _, t in arrivals.trajectories]
        tokens = sum(len(rows[k]["prompt"]) + len(rows[k]["response"]) for k in keys)
        self._landed_tokens += tokens
        # on arrival: fixed models score the rows (KL loss: the reference; SAO: the critic at the step-start weights)
        for name, score in (("ref_lp", self.ctx.ref_log_probs), ("values", self.ctx.values)):
            if score is not None:
                t0 = time.time()
                for key, value in score(keys, tags).items():
                    rows[key][name] = value
                self.ctx.recorder.learner_op("forward", t0, time.time(), tokens=tokens)
        self._old_log_probs(keys, tags, rows, tokens)
        for key, _ in arrivals.trajectories:  # the planner sees a row once everything it needs is on it
            self.algo.admit_trajectory(planned[key], rows[key], state, t_seen)
        self.algo.admitted()  # SAO: the critic's backwards of these rows

    def _old_log_probs(self, keys: list, tags: list, rows: dict, tokens: int) -> None:
        """verl's old log-probs of landed rows: the rollout's (fused: on the rows already, ``fetch_rows``; verl's
        field is written once per step, in ``run``), or verl's forward at θ_k (separate)."""
        if self.ctx.fused_forward:  # each backward's own forward at θ_k is verl's old-log-prob check
            return
        t0 = time.time()
        part = self.ctx.forward_at_theta_k(keys, tags)
        self.ctx.recorder.learner_op("forward", t0, time.time(), tokens=tokens)
        for name, value in part.items():
            if name.endswith("_max"):
                self.state.forward_metrics[name] = max(self.state.forward_metrics.get(name, float("-inf")), value)
            else:
                self.state.forward_metrics.setdefault(name, value)

    def _row_content(self, keys: list) -> dict[str, tuple]:
        """What the deterministic gate orders a group's members by: their tokens (read once, kept for ``_admit``)."""
        self._fetch(keys)
        return {k: (self.state.rows[k]["response"], self.state.rows[k]["prompt"]) for k in keys}

    def _fetch(self, keys: list) -> None:
        """Read landed rows from the TransferQueue into ``state.rows``, timed (``thundersync/fetch_s``)."""
        if not keys:
            return
        t0 = time.time()
        self.state.rows.update(fetch_rows(self.ctx.tq, keys, rollout_lp=self._rollout_lp))
        self.state.fetch_s += time.time() - t0

    def _op_tokens(self, op) -> int | None:
        """An op's prompt and response tokens (its cost for ``CallCost``; a fold has none): a GRPO op's fetched rows,
        an OPD op's own rows; None for others."""
        kind = op_kind(op)
        if kind.name == "fold" or kind.tokens is not None:
            return kind.tokens(op) if kind.tokens is not None else 0
        return items_tokens(self.state.rows, op.items) if kind.row_items else None

    def _op_done(self, op, stats: dict, t0: float, t1: float) -> None:
        state = self.state
        if "lp_gap" in stats:
            state.lp_gap = max(state.lp_gap, stats["lp_gap"])
        state.kl_sum += stats.get("kl_sum", 0.0)
        state.kl_tokens += stats.get("kl_tokens", 0.0)
        for key in ("sao_masked", "sao_scored"):
            if key in stats:
                state.sums[key] = state.sums.get(key, 0.0) + stats[key]
        kind, items, tokens = self.algo.describe_op(op, state, t0)
        self.ctx.recorder.learner_op(kind, t0, t1, items=items, tokens=tokens, forward_s=stats.get("forward_s"))


def items_tokens(rows: dict, items) -> int:
    """Prompt and response tokens of a GRPO op's ``(group, key)`` items."""
    return sum(len(rows[k]["prompt"]) + len(rows[k]["response"]) for _, k in items)


class GRPOArrivals(AlgorithmDefaults):
    """GRPO: a landed trajectory is one arrival of its group (``StreamPlanner.arrive``)."""

    def __init__(self, planner: StreamPlanner):
        self.planner = planner

    def begin(self, ctx: StepContext):
        if ctx.tail is not None:  # the batch's places (TailGate.alias)
            groups = [f"{i:08d}" for i in range(ctx.tail.p)]
        else:
            groups = [f"{i:08d}" for i in range(len(ctx.uids))] if ctx.deterministic else ctx.uids  # BatchOrderGate.alias
        self.planner.begin_batch({gid: ctx.n for gid in groups})
        return None  # no turn source

    def admit_turn(self, turn, tag, state: StepState, t_seen: float) -> None:
        raise TypeError("GRPO streams whole trajectories; a scored turn arrived")

    def admit_trajectory(self, key: str, row: dict, state: StepState, t_seen: float) -> None:
        self.planner.arrive(key.split("_")[0], key, row["reward"], row["num_tokens"])

    def describe_op(self, op, state: StepState, t0: float) -> tuple[str, tuple, int]:
        items = getattr(op, "items", ())
        return op_kind(op).name, items, items_tokens(state.rows, items)

    def metrics(self, state: StepState, ctx: StepContext) -> dict:
        """Several mini-batches (``MiniBatchPlanner``): optimizer steps and each step's policy lag."""
        return self.planner.metrics()
