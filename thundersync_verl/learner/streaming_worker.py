"""The streaming learner: verl's Tinker-style actor worker plus the streaming methods.

Why:
1. ThunderSync runs a trajectory's backward as soon as its inputs are fixed and takes ONE
   optimizer step per batch. verl 0.9.1 already splits training into ``forward_backward`` (grads
   accumulate with ``zero_grad_on_exit=False``) and ``optimizer_step``; this worker adds only
   what streaming needs on top of that seam:
       stream_begin_batch(meta)   clear buffers, validate the config, record loss_agg_mode
       stream_backward(chunk)     backward of one chunk into .grad ("direct") or a bucket
       stream_token_backward(c)   the same for a per-token chunk (OPD turns, stream_loss.py)
       stream_fold({key: coef})   .grad += coef * bucket[key] when a group closes; free buckets
       finalize_step(scale)       the barrier: normalise, clip, optimizer step, LR step, zero
   plus ``stream_memory`` (bucket accounting), ``gather_flat_params`` and ``reset_actor`` (for
   equivalence checks). These calls block until done: verl's worker is an asyncio actor, and Ray
   starts a task once its arguments are fetched, so calls sent back to back may start out of order.
   ``stream_backward_queued`` / ``stream_token_backward_queued`` / ``stream_fold_queued`` return
   at once and carry a ticket (0, 1, 2... per batch): each runs after the previous ticket's call
   finished, so the driver keeps the next chunk queued while one computes (``OpPipeline``).
2. The chunk's loss is ours (``stream_loss.py``), installed through the worker's loss-function
   seam for the duration of the call, so verl's own ``update_actor`` keeps its ppo loss.
3. Where the gradient lives and how a step is finalised is the engine's business: a
   ``StreamLearner`` (``learner/engines/``) chosen by verl's engine key (``fsdp``/``fsdp2``:
   ``p.grad`` shards; ``megatron``: the DDP grad buffer, finalised once at the barrier). A bucket
   backward runs inside ``learner.isolated()``: the direct gradient is set aside, the chunk's
   gradient is added to the bucket, and the direct gradient is put back.
   With a KL loss or an entropy bonus (verl's ``use_kl_loss`` / ``entropy_coeff``, read from this
   worker's actor config) a bucket chunk runs twice: its policy part into the bucket, its KL/entropy
   part straight into ``.grad``, so the fold's A(r) multiplies the policy part only
   (``stream_loss.py`` point 6); with several mini-batches per batch (batch meta
   ``independent_buckets``) that part goes into a companion bucket instead, folded with 1 or dropped
   with the group (``minibatch_plan.py`` point 7). A direct chunk carries every term in one backward.
4. Every method is collective-safe at any data-parallel size: checks that could differ between
   ranks (non-finite coefficients in a rank's rows) are agreed with one all-reduce first, and
   checks on replicated state (bucket keys, scale) fail identically everywhere, before any
   collective. Errors state the rule, why it exists and how to fix it.
5. Buckets are accounted by the core's ``BufferPool`` (bytes in use, peak, open buckets): the
   figures ``finalize_step`` and ``stream_memory`` report are measured, not estimated. Where they
   live (batch meta ``bucket_device``; host on accelerators by default) is ``core/bucket_memory.py``'s
   call, the one ``thundersync plan`` prices with; host buckets cross to the device in ``axpy_``.
6. A LoRA actor's weight push through a checkpoint engine (the standalone rollout of ThunderSync): verl 0.9.1
   sends the frozen base weights there and drops the adapter, so the rollout would never serve the trained one.
   To the CPU rollouts (``hf_cpu``, ``replay``) ``update_weights`` sends the adapter's tensors instead, as verl's
   naive sync does, and the server merges them into the base it loaded from the same checkpoint
   (``backends/lora_weights.py``); every other push is verl's (``launch_check`` refuses the LoRA pushes that
   would drop the adapter).
The driver side (``stream_exec.py``) executes the planner's ops against a worker group.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import torch

from thundersync_verl.run import faults
from thundersync_verl import verl_adapter as va
from thundersync_verl.core import BufferPool, GradLayout, StreamingInputError, StreamingStateError
from thundersync_verl.core.buffers import axpy_, copy_into_
from thundersync_verl.learner.forward_clock import ForwardClock
from thundersync_verl.learner.engines import StreamLearner, make_learner
from thundersync_verl.core.errors import rule_message
from thundersync_verl.step.chunk_layout import exact_micro_batch_size, COEF_KEY, IndependentTerms, KL_SUM_METRIC, KL_TOKENS_METRIC, LP_DIFF_METRIC, REF_LP_KEY, SEQ_KEY, on_arrival, TEACHER_KEY, TOKEN_COEF_KEY
from thundersync_verl.learner.stream_loss import NO_IS, RolloutIS, make_stream_loss, make_token_stream_loss, set_chunk_part
from thundersync_verl.learner.minibatch_loss import ppo_chunk_loss
from thundersync_verl.algos.sao.sao_streaming import MASKED_METRIC, SCORED_METRIC
from thundersync_verl.algos.sao.sao_loss import is_sao_chunk, sao_token_loss
from thundersync_verl.learner.stream_checks import check_chunk, check_folds, check_scale, check_token_chunk
from thundersync_verl.step.stream_plan import INDEPENDENT_BUCKETS_KEY, independent_key
from thundersync_verl.learner.engine_rules import actor_config_settings
from thundersync_verl.backends.lora_weights import CPU_ROLLOUTS

DIRECT = "direct"
QUEUE_WAIT_S = 600.0  # a queued call waits at most this long for its predecessor
_Base = va.tinker_actor_worker_base()
register, Dispatch, ACTOR_MESH = va.worker_register_api()


class _BatchState:
    """Per-batch streaming state of one rank: bucket buffers and counters."""

    def __init__(self, layout: GradLayout, loss_agg_mode: str, meta: dict, terms: IndependentTerms | None = None,
                 rollout_is: RolloutIS = NO_IS):
        self.pool = BufferPool.for_learner(layout, bucket_device=meta.get(BUCKET_DEVICE_KEY, "auto"), budget_bytes=meta.get(BUDGET_KEY))
        self.buckets: dict[str, list[torch.Tensor]] = {}
        self.loss_agg_mode = loss_agg_mode
        self.terms = terms or IndependentTerms()
        self.rollout_is = rollout_is
        self.loss_fn = make_stream_loss(loss_agg_mode, self.terms, rollout_is)
        self.meta = dict(meta)
        self.independent_buckets = bool(meta.get(INDEPENDENT_BUCKETS_KEY, False))  # minibatch_plan point 7
        self.failed: str | None = None
        self.chunks = self.rows = self.folds = 0


class StreamingActorWorker(_Base):
    """``TinkerActorRolloutRefWorker`` with the streaming methods of the module docstring."""

    def __init__(self, config, role: str, **kwargs):
        super().__init__(config, role, **kwargs)
        self._ts: _BatchState | None = None
        self._ts_peak_bytes = 0
        self._ts_lock = threading.Lock()
        self._ts_turn: asyncio.Condition | None = None  # created on the actor's event loop
        self._ts_next = 0  # the ticket of the queued call that may run next
        self._ts_learner: StreamLearner | None = None
        self._ts_clock = ForwardClock()  # each streamed call's forwards (forward_s on the learner records)

    @contextlib.contextmanager
    def _exclusive(self, call: str):
        """One streaming call at a time: a call that slipped past another (an asyncio actor starts
        tasks as their arguments arrive) must not interleave backward, fold and step."""
        if not self._ts_lock.acquire(blocking=False):
            raise StreamingStateError(
                rule_message(
                    f"{call} called while another streaming call is still running on this worker",
                    "backward, fold and step of one batch must run in the order the planner emitted them",
                    "wait for each call's result, or send queued calls in order (stream_exec.OpPipeline does)",
                )
            )
        try:
            yield
        finally:
            self._ts_lock.release()

    async def _await_turn(self, seq, call: str) -> None:
        """Queued calls run in ticket order. They are coroutines: the actor runs every call on one
        event loop, and a queued call that arrived before its predecessor (Ray starts a task once its
        arguments are fetched, so a small fold can overtake a large chunk) must wait without blocking it."""
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise StreamingInputError(rule_message(
                f"a queued {call} needs a ticket: an int >= 0 (got {seq!r})",
                "queued calls return at once, so only the ticket says in which order they run",
                "send queued calls through stream_exec.OpPipeline, which numbers them per batch"))
        if self._ts_turn is None:
            self._ts_turn = asyncio.Condition()
        async with self._ts_turn:
            try:
                await asyncio.wait_for(self._ts_turn.wait_for(lambda: self._ts_next >= seq), QUEUE_WAIT_S)
            except asyncio.TimeoutError:
                raise StreamingStateError(rule_message(
                    f"queued {call} #{seq} waited {QUEUE_WAIT_S:.0f}s for call #{self._ts_next}",
                    "queued calls run in ticket order, so a fold never overtakes the backward that fills its bucket",
                    "number queued calls 0, 1, 2... after each stream_begin_batch, without gaps")) from None
            if self._ts_next != seq:
                raise StreamingStateError(rule_message(
                    f"queued {call} #{seq}: ticket already used (next is #{self._ts_next})",
                    "each ticket runs exactly once", "restart numbering at 0 only after stream_begin_batch"))

    async def _queued(self, seq, call: str, run):
        """``run()`` in its turn, alone; the result carries the worker's start and end times."""
        await self._await_turn(seq, call)
        try:
            with self._exclusive(call):
                t0 = time.time()
                return _timed(run(), t0)
        finally:
            async with self._ts_turn:
                self._ts_next = seq + 1
                self._ts_turn.notify_all()

    # ----- helpers ------------------------------------------------------------------------
    def _engine(self):
        return va.actor_engine(self)

    def _learner(self) -> StreamLearner:
        if self._ts_learner is None:
            self._ts_learner = make_learner(self)
        return self._ts_learner

    def _state(self, call: str) -> _BatchState:
        if self._ts is None:
            raise StreamingStateError(
                rule_message(
                    f"{call} called with no streaming batch open",
                    "streamed gradients belong to one batch sampled at one set of weights",
                    "call stream_begin_batch(meta) first (and again after every finalize_step)",
                )
            )
        if self._ts.failed is not None:
            raise StreamingStateError(
                rule_message(
                    f"{call} refused: an earlier call of this batch failed ({self._ts.failed})",
                    "a failed backward leaves .grad zeroed by the engine, so the batch gradient is incomplete",
                    "drop this batch: call stream_begin_batch(meta) and stream it again",
                )
            )
        return self._ts

    def _agree(self, ok: bool) -> bool:
        """True on every rank iff ``ok`` holds on every data-parallel rank (one all-reduce)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        group = va.dp_group_of(self._engine())
        if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        return bool(flag.item())

    # ----- registered methods -------------------------------------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stream_begin_batch(self, meta: dict) -> None:
        """Start a batch: validate the actor config for streaming, clear buckets and grads.

        ``meta``: ``loss_agg_mode`` (default: the actor's), optional ``train_batch_size``,
        ``adv_estimator``, ``norm_adv_by_std_in_grpo``, ``batch_id`` and ``memory_budget_bytes``
        (``thundersync.memory_budget_bytes``: the bytes this rank's buckets may hold at once; a chunk
        that would open one more bucket than fits is refused before it runs) and ``bucket_device``
        (``thundersync.bucket_device``: host / device / auto, placed by ``core/bucket_memory.py``). An open batch is dropped.
        """
        meta = dict(meta or {})
        # loss, estimator, SAO and KL / entropy rules (the function ``thundersync recipes check`` calls too)
        settings, terms = actor_config_settings(self.config, meta)
        with self._exclusive("stream_begin_batch"):
            learner = self._learner()
            layout = learner.bucket_layout()
            state = _BatchState(layout, settings.loss_agg_mode, meta, terms,  # checks the budget before anything changes
                                RolloutIS.from_settings(settings))
            learner.begin_batch()
            self._ts = state
            self._ts_next = 0  # every call runs on the actor's one event loop thread

    @register(dispatch_mode=ACTOR_MESH)
    def stream_backward(self, chunk):
        """Backward of one chunk into ``.grad`` (``ts_dest == "direct"``) or a bucket.

        Returns a one-row TensorDict per data-parallel rank: ``ts_loss``, ``ts_rows``.
        """
        with self._exclusive("stream_backward"):
            return self._row_chunk_backward(chunk)

    @register(dispatch_mode=ACTOR_MESH)
    def stream_token_backward(self, chunk):
        """Backward of one PER-TOKEN chunk (``chunk_layout.build_token_chunk``), e.g. OPD turns.

        Same destinations, checks and result as ``stream_backward``; the loss weights each
        response token by ``ts_token_coef`` (times the OPD advantage when the chunk carries
        teacher log-probs) instead of a per-row coefficient and loss_agg_mode weight.
        """
        with self._exclusive("stream_token_backward"):
            return self._stream_token_backward(chunk)

    @register(dispatch_mode=ACTOR_MESH, blocking=False)
    async def stream_backward_queued(self, chunk):
        """``stream_backward`` the caller does not wait for; runs after ticket ``chunk["ts_seq"] - 1``."""
        return await self._queued(va.non_tensor(chunk, SEQ_KEY), "stream_backward",
                                  lambda: self._row_chunk_backward(chunk))

    def _row_chunk_backward(self, chunk):
        """A row chunk's backward, in verl's no-padding layout (a chunk sent padded is converted here:
        ``chunk_layout`` point 5)."""
        chunk = on_arrival(chunk)
        return self._stream_backward(chunk, loss_fn=ppo_chunk_loss(self.config.actor, chunk))

    @register(dispatch_mode=ACTOR_MESH, blocking=False)
    async def stream_token_backward_queued(self, chunk):
        """``stream_token_backward`` the caller does not wait for (ticket as above)."""
        return await self._queued(va.non_tensor(chunk, SEQ_KEY), "stream_token_backward",
                                  lambda: self._stream_token_backward(chunk))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def stream_fold_queued(self, folds: dict, seq: int):
        """``stream_fold`` the caller does not wait for (ticket ``seq``)."""
        return await self._queued(seq, "stream_fold", lambda: self._stream_fold(folds))

    def _stream_token_backward(self, chunk):
        chunk = on_arrival(chunk)  # a chunk sent padded (chunk_layout point 5)
        check_token_chunk(chunk)
        keys = [k for k in (TOKEN_COEF_KEY, TEACHER_KEY) if k in chunk.keys()]
        finite = all(bool(torch.isfinite(chunk[k]).all()) for k in keys)
        if not self._agree(finite):
            raise StreamingInputError(
                rule_message(
                    f"every {TOKEN_COEF_KEY} and {TEACHER_KEY} value of a chunk must be finite",
                    "one NaN or inf coefficient poisons the whole batch gradient",
                    "check the teacher's scores before planning the turn",
                )
            )
        if self._state("stream_token_backward").terms.active:
            raise StreamingInputError(rule_message(
                "per-token (OPD turn) chunks carry no KL or entropy term",
                "their loss is the distillation policy gradient; a KL/entropy term configured on the actor would be "
                "silently dropped",
                "set actor_rollout_ref.actor.use_kl_loss=false and entropy_coeff=0 for OPD turn streaming"))
        return self._stream_backward(chunk, loss_fn=sao_token_loss if is_sao_chunk(chunk) else make_token_stream_loss())

    def _stream_backward(self, chunk, loss_fn=None):
        state = self._state("stream_backward")
        dest = check_chunk(chunk)
        coefs = chunk[COEF_KEY]
        if not self._agree(bool(torch.isfinite(coefs).all())):
            raise StreamingInputError(
                rule_message(
                    "every ts_coef of a chunk must be finite",
                    "one NaN or inf coefficient poisons the whole batch gradient",
                    "check the rewards and the estimator before planning the chunk",
                )
            )
        if loss_fn is None and state.terms.use_kl_loss and REF_LP_KEY not in chunk.keys():
            raise StreamingInputError(rule_message(
                f"actor_rollout_ref.actor.use_kl_loss is on but the chunk has no {REF_LP_KEY}",
                "the KL term compares every scored token's log-prob with the reference model's",
                "compute them per arrival (chunk_layout.attach_ref_log_probs) before sending the chunk"))
        split = loss_fn is None and state.terms.active and dest != DIRECT  # policy -> bucket, KL/entropy -> .grad
        companion = split and state.independent_buckets  # ... or into its companion bucket (mini-batches)
        if dest != DIRECT and dest not in state.buckets:
            state.pool.check_fits(dest, 2 if companion else 1)  # refused before the backward: the batch stays usable
        self._fit_micro_batches(chunk)
        learner = self._learner()
        previous = va.actor_loss_fn(self)
        self._ts_clock.attach(learner.timed_module())
        self._ts_clock.begin()
        va.set_actor_loss_fn(self, self._ts_clock.wrap(loss_fn or state.loss_fn))
        try:
            if loss_fn is None:
                set_chunk_part(chunk, "policy" if split else "all", state.terms)
            if dest == DIRECT:
                output = learner.forward_backward(lambda: self.actor.forward_backward(data=chunk))
            else:
                with learner.isolated():
                    output = learner.forward_backward(lambda: self.actor.forward_backward(data=chunk))
                    self._harvest(state, dest, learner.bucket_gradient())
            if split:
                set_chunk_part(chunk, "independent", state.terms)
                if companion:
                    with learner.isolated():
                        learner.forward_backward(lambda: self.actor.forward_backward(data=chunk))
                        self._harvest(state, independent_key(dest), learner.bucket_gradient())
                else:
                    learner.forward_backward(lambda: self.actor.forward_backward(data=chunk))
        except Exception as exc:
            state.failed = f"stream_backward: {type(exc).__name__}: {exc}"
            raise
        finally:
            va.set_actor_loss_fn(self, previous)
        if faults.ACTIVE:  # $THUNDERSYNC_FAULTS: nan_grad / learner_kill after this backward
            faults.after_backward(state, va.actor_parameters(self._engine()))
        state.chunks += 1
        state.rows += int(coefs.shape[0])
        return _chunk_result(output, int(coefs.shape[0]), self._ts_clock.seconds())

    def _fit_micro_batches(self, chunk) -> None:
        """Micro-batches of at most the configured size that divide this rank's rows exactly.

        verl's fixed-size micro-batching needs the local rows to be a multiple of the micro-batch
        size; a streamed chunk has any size, so the largest divisor not above it is used (every
        rank holds the same number of rows, so every rank runs the same number of micro-batches).
        """
        dynamic, configured = va.actor_micro_batch_size(self)
        if dynamic or "micro_batch_size_per_gpu" in chunk.keys():
            return
        va.assign_non_tensor(chunk, micro_batch_size_per_gpu=exact_micro_batch_size(chunk.batch_size[0], configured))

    def _harvest(self, state: _BatchState, key: str, grads) -> None:
        """bucket[key] += the chunk's gradient (``learner.bucket_gradient()``, inside ``learner.isolated()``)."""
        if key in state.buckets:
            axpy_(state.buckets[key], grads, 1.0)
        else:
            state.pool.reserve(key, 1, is_group=True)
            state.buckets[key] = state.pool.allocate(key)
            copy_into_(state.buckets[key], grads)
        self._ts_peak_bytes = max(self._ts_peak_bytes, state.pool.peak_bytes)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stream_fold(self, folds: dict) -> None:
        """``.grad += coef * bucket[key]`` for every ``{key: coef}``; the buckets are freed."""
        with self._exclusive("stream_fold"):
            self._stream_fold(folds)

    def _stream_fold(self, folds: dict) -> None:
        state = self._state("stream_fold")
        folds = check_folds(folds, state.buckets)
        learner = self._learner()
        for key in sorted(folds):  # a fixed order: the update does not depend on dict order
            learner.fold(state.buckets.pop(key), folds[key])
            state.pool.release(key)
            state.folds += 1

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def finalize_step(self, scale: float, lr_step: bool = True) -> dict:
        """The barrier: grad *= scale, clip as verl's engine does, optimizer step, LR step, zero.

        ``lr_step=False``: a mini-batch step before the batch's last (verl steps the LR scheduler once per batch).
        """
        with self._exclusive("finalize_step"):
            return self._finalize_step(scale, lr_step)

    def _finalize_step(self, scale: float, lr_step: bool = True) -> dict:
        state = self._state("finalize_step")
        if state.buckets:
            raise StreamingStateError(
                rule_message(
                    f"finalize_step refused: buckets {sorted(state.buckets)} are not folded",
                    "an open group's trajectories are missing from the batch gradient until its "
                    "bucket is folded with the group's advantage",
                    "send stream_fold({key: coefficient}) for every bucket (the planner emits a "
                    "FoldOp when each group closes), then call finalize_step again",
                )
            )
        scale = check_scale(scale)
        try:
            step = self._learner().finalize(scale, lr_step=bool(lr_step))  # scale, reduce once, clip, step, LR step, zero
        except Exception as exc:
            state.failed = f"finalize_step: {type(exc).__name__}: {exc}"
            raise
        metrics = {**step, **self._memory(state), "thundersync/peak_bucket_bytes": state.pool.peak_bytes}
        metrics.update({"stream/chunks": state.chunks, "stream/rows": state.rows, "stream/folds": state.folds})
        self._ts = None
        return metrics

    def _memory(self, state: _BatchState | None) -> dict:
        pool = state.pool if state is not None else None
        return {
            "stream/buffer_bytes": pool.buffer_bytes if pool else 0,
            "stream/bytes_in_use": pool.bytes_in_use if pool else 0,
            "stream/peak_bytes": pool.peak_bytes if pool else 0,
            "stream/peak_buckets": pool.peak_open_groups if pool else 0,
            "stream/peak_bytes_lifetime": self._ts_peak_bytes,
            "stream/peak_host_bytes": pool.host_peak_bytes if pool else 0,
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stream_memory(self) -> dict:
        """This rank's bucket accounting (one full local gradient shard = ``buffer_bytes``)."""
        state = self._ts
        out = self._memory(state)
        if state is None:
            out["stream/buffer_bytes"] = self._learner().bucket_layout().buffer_bytes
        out["stream/open_buckets"] = sorted(state.buckets) if state is not None else []
        out["stream/batch_open"] = state is not None  # a checkpoint is taken only between batches
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        """verl's weight push; a LoRA actor's through a checkpoint engine to a CPU rollout sends its adapter (point 6)."""
        backend = self.config.rollout.checkpoint_engine.backend if mode == "auto" else mode
        adapter = None
        if backend != "naive" and self.config.rollout.name in CPU_ROLLOUTS:
            adapter = va.lora_adapter_push(self)
        if adapter is None:
            return await super().update_weights(global_steps=global_steps, mode=mode)
        return await self.checkpoint_engine.send_weights(adapter[0], global_steps=global_steps) or {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def gather_flat_params(self) -> torch.Tensor:
        """All parameters, all-gathered and flattened to one float64 CPU vector (a collective)."""
        return self._learner().flat_params()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def gather_applied_gradient(self) -> torch.Tensor | None:
        """The last optimizer step's clipped gradient, laid out as ``gather_flat_params`` (the learner's
        ``applied_gradient``: the first call arms it and returns None)."""
        return self._learner().applied_gradient()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reset_actor(self) -> None:
        """Reload the actor from its model path with a fresh optimizer and LR scheduler."""
        va.reset_actor(self)
        self._ts = None


BUDGET_KEY = "memory_budget_bytes"  # batch meta: thundersync.memory_budget_bytes (None: unbudgeted)
BUCKET_DEVICE_KEY = "bucket_device"  # batch meta: thundersync.bucket_device (core/bucket_memory.py; default auto)


def _flat(values) -> list[float]:
    if isinstance(values, (list, tuple)):
        return [x for v in values for x in _flat(v)]
    return [float(values)]


def _timed(result, t0: float):
    """A queued call's result row with the worker's start and end time (the driver's timeline)."""
    from tensordict import TensorDict

    times = {"ts_t_start": torch.tensor([t0], dtype=torch.float64), "ts_t_end": torch.tensor([time.time()], dtype=torch.float64)}
    if result is None:
        return TensorDict(times, batch_size=[1])
    result.update(times)
    return result


def _chunk_result(output, rows: int, forward_s: float = float("nan")):
    """One row per rank: the chunk's loss, the checks its forward measured at θ_k and its forwards' seconds
    (``forward_clock.py``; NaN: not measured)."""
    from tensordict import TensorDict

    metrics = (va.non_tensor(output, "metrics", {}) or {}) if output is not None else {}
    loss = float(metrics.get("loss", float("nan")))
    gap = max(_flat(metrics[LP_DIFF_METRIC])) if LP_DIFF_METRIC in metrics else float("nan")
    kl_sum = sum(_flat(metrics[KL_SUM_METRIC])) if KL_SUM_METRIC in metrics else float("nan")
    kl_tokens = sum(_flat(metrics[KL_TOKENS_METRIC])) if KL_TOKENS_METRIC in metrics else float("nan")
    masked = sum(_flat(metrics[MASKED_METRIC])) if MASKED_METRIC in metrics else float("nan")  # SAO's band mask
    scored = sum(_flat(metrics[SCORED_METRIC])) if MASKED_METRIC in metrics else float("nan")
    values = {"ts_loss": loss, "ts_lp_diff_max": gap, "ts_kl_sum": kl_sum, "ts_kl_tokens": kl_tokens,
              "ts_sao_masked": masked, "ts_sao_scored": scored, "ts_forward_s": forward_s}
    out = {k: torch.tensor([v], dtype=torch.float64) for k, v in values.items()}
    return TensorDict({**out, "ts_rows": torch.tensor([rows])}, batch_size=[1])
