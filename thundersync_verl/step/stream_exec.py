"""Driver side of a streamed step: trajectory rows from the TransferQueue, ops to the learner.

1. Each trajectory is fetched from verl's TransferQueue once, when it lands (prompt, response,
   response mask with tool-observation tokens masked out, reward; the rollout's log-probs with the fused
   forward), and cached until its backward. The TransferQueue's controller and storage serve the agent
   loops too, so the driver's round trips are host work taken from the rollout side: one read per arrival,
   and verl's ``old_log_probs`` (bypass: the rollout's) written back once per step
   (``rollout_as_old_log_probs``), not once per arrival.
2. A ``BackwardOp`` becomes one chunk in verl's no-padding layout (``build_stream_chunk``), padded to the
   data-parallel size with zero-coefficient, zero-mask rows; a ``FoldOp`` is one ``stream_fold``. The size is
   the parts verl's actor-mesh dispatch cuts a batch into (``verl_adapter.actor_dp_size``), not the worker
   count: Megatron's tensor/pipeline/context-parallel peers of one data-parallel rank receive the same rows.
   With several data-parallel ranks it is built as one part per rank (``build_stream_parts``: the rows verl's split
   would give each) and dispatched as built (``va.DataParallelParts``); one rank gets the chunk itself, unsplit.
3. An OPD ``TurnBackwardOp`` carries its own rows (each turn's prefix and teacher log-probs): it becomes one
   per-token chunk (``OPDStreamClient.chunk``) for ``stream_token_backward``; so does a SAO
   ``SAOBackwardOp`` (``sao_stream.sao_chunk``: per-token GAE or whitening-bucket coefficients, the band).
4. ``OpPipeline`` keeps the next op queued on the learner while one computes (the worker's ``*_queued``
   calls, numbered per batch): with one blocking call at a time the learner sat idle while the driver
   admitted arrivals, built the next chunk and verl dispatched it. Results come back in order; the first
   failure is raised after the calls already sent have finished, so nothing of the batch is left running.
5. The pipeline times every call it hands back into a ``CallCost`` (``core/call_cost.py``, shared by a run's
   steps), so ``learner_idle_at`` can say when the learner will have finished what is queued: the driver
   plans the next call just before then (``streamed_step``), not after.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import Callable

import ray
import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.core.call_cost import CallCost, queue_end
from thundersync_verl.learner.minibatch_loss import build_ppo_chunk
from thundersync_verl.step.minibatch_plan import PPOBackwardOp
from thundersync_verl.algos.opd.opd_stream import OPDStreamClient, TurnBackwardOp
from thundersync_verl.algos.sao.sao_streaming import SAOBackwardOp, sao_chunk
from thundersync_verl.step.chunk_layout import SEQ_KEY, build_stream_chunk, build_stream_parts
from thundersync_verl.step.stream_plan import BackwardOp, FoldOp

ROW_FIELDS = ["prompts", "responses", "response_mask", "rm_scores", "extra_fields"]


def fetch_rows(tq, keys: list[str], partition_id: str = "train", *, rollout_lp: bool = False) -> dict[str, dict]:
    """``{key: {prompt, response, mask, reward, scores, num_tokens, extra}}`` for finished trajectories, in ONE
    TransferQueue read; with ``rollout_lp`` each row also carries the rollout's log-probs (``rollout_lp``)."""
    fields = ROW_FIELDS + (["rollout_log_probs"] if rollout_lp else [])
    data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=fields)
    extras = data["extra_fields"]
    extras = extras.tolist() if hasattr(extras, "tolist") else list(extras)
    prompts, responses, masks, scores = (row_lists(data[f]) for f in ("prompts", "responses", "response_mask", "rm_scores"))
    lps = row_lists(data["rollout_log_probs"]) if rollout_lp else None
    rows = {}
    for i, key in enumerate(keys):
        rows[key] = {
            "prompt": prompts[i],
            "response": responses[i],
            "mask": masks[i],
            "reward": float(torch.tensor(scores[i], dtype=torch.float32).sum()),  # as verl sums the row
            "scores": scores[i],  # per response token (SAO's GAE reads them)
            "num_tokens": int(sum(masks[i])),
            "extra": getattr(extras[i], "data", extras[i]) or {},
        }
        if rollout_lp:
            rows[key]["rollout_lp"] = lps[i]
    return rows


def row_lists(values) -> list[list]:
    """Each row of a TransferQueue field as a Python list. verl stores per-token fields as jagged nested tensors;
    one is split here by its offsets in one pass: indexing it row by row dispatches torch's nested-tensor ops per
    row and field, which was the driver's largest cost per arrival."""
    if isinstance(values, torch.Tensor):
        if not values.is_nested:
            return values.tolist()
        if values.layout == torch.jagged and getattr(values, "_lengths", None) is None:
            flat, offsets = values.values().tolist(), values.offsets().tolist()
            return [flat[a:b] for a, b in zip(offsets, offsets[1:])]
        return [row.tolist() for row in values.unbind(0)]
    return [torch.as_tensor(row).tolist() for row in values]


def rollout_as_old_log_probs(tq, keys: list[str], partition_id: str = "train") -> None:
    """verl's ``old_log_probs`` field := the rollout's (verl's bypass mode) for ``keys``: one read, one write."""
    data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["rollout_log_probs"])
    data["old_log_probs"] = data.pop("rollout_log_probs")
    tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=data)


def execute_op(worker_group, op, rows: dict[str, dict], *, pad_token_id: int, temperature: float) -> dict:
    """Run one planner op on the learner and wait for it (errors surface here, before any step).

    Returns what the backward's own forward (at θ_k) measured: ``lp_gap`` (max |log p_rollout -
    log p_learner| over scored tokens) when the rows carry ``rollout_lp``; ``kl_sum`` and
    ``kl_tokens`` (log pi - log p_teacher summed over scored tokens) for an OPD turn chunk.
    """
    method, args = _request(worker_group, op, rows, pad_token_id=pad_token_id, temperature=temperature, queued=False)
    return _stats(op, _parts(_wait(getattr(worker_group, method)(*args))))


def _opd_chunk(op, rows, **layout):  # OPD: the op holds its rows; ``rows`` is not needed
    return OPDStreamClient(None, **layout).chunk(op)  # the chunk alone: no learner call


def _sao_chunk(op, rows, **layout):  # SAO: the op holds its rows, per-token coefficients and band
    return sao_chunk(op, **layout)


def _ppo_chunk(op, rows, **layout):  # a later mini-batch: verl's PPO loss against the rollout's log-probs
    chunk_rows = [rows[traj_id] for _, traj_id in op.items]
    return build_ppo_chunk([r["prompt"] for r in chunk_rows], [r["response"] for r in chunk_rows], op.coefs,
                           [r["rollout_lp"] for r in chunk_rows], response_masks=[r["mask"] for r in chunk_rows],
                           ref_log_probs=_row_field(chunk_rows, "ref_lp"), **layout)


def _grpo_chunk(op, rows, *, parts: bool = False, **layout):
    """The op's chunk, sent padded (``chunk_layout`` point 5); ``parts``: one chunk per data-parallel rank
    (``build_stream_parts``)."""
    chunk_rows = [rows[traj_id] for _, traj_id in op.items]
    return (build_stream_parts if parts else build_stream_chunk)([r["prompt"] for r in chunk_rows], [r["response"] for r in chunk_rows], op.coefs,
                              op.dest, response_masks=[r["mask"] for r in chunk_rows],
                              rollout_log_probs=_row_field(chunk_rows, "rollout_lp"),
                              ref_log_probs=_row_field(chunk_rows, "ref_lp"), padded=True, **layout)


def _opd_tokens(op) -> int:  # OPD: each row is a turn's prefix (or merged turns' latest prefix), held by the op
    return sum(len(row.prompt) + len(row.response) for row in op.turns)


def _opd_stats(op, parts: list) -> dict:
    return {"kl_sum": _stat(parts, "ts_kl_sum", sum), "kl_tokens": _stat(parts, "ts_kl_tokens", sum)}


def _sao_stats(op, parts: list) -> dict:
    if op.dest != "direct":  # its bucket row has the same tokens as its direct row: counted once
        return {}
    return {"sao_masked": _stat(parts, "ts_sao_masked", sum), "sao_scored": _stat(parts, "ts_sao_scored", sum)}


@dataclass(frozen=True)
class OpKind:
    """How one type of planner op reaches the learner: the worker method, the chunk it sends, its own figures."""

    name: str  # "fold" or "backward" (the step record's lane)
    method: str  # the streaming worker's method
    chunk: Callable | None  # (op, rows, dp_size=, pad_token_id=, temperature=) -> chunk; None: the op is its payload
    stats: Callable = lambda op, parts: {}  # (op, the worker's metric parts) -> this op type's own figures
    row_items: bool = False  # the op's items name the step's fetched rows, (group, key): their tokens are its cost
    tokens: Callable | None = None  # (op) -> its rows' prompt and response tokens, for an op that holds its rows
    parts: bool = False  # ``chunk`` can build one part per data-parallel rank (``parts=True``): no split on dispatch


OP_KINDS: dict[type, OpKind] = {  # every op type a planner emits, in one table (looked up along the op's MRO)
    FoldOp: OpKind("fold", "stream_fold", None),
    TurnBackwardOp: OpKind("backward", "stream_token_backward", _opd_chunk, _opd_stats, tokens=_opd_tokens),
    SAOBackwardOp: OpKind("backward", "stream_token_backward", _sao_chunk, _sao_stats),
    PPOBackwardOp: OpKind("backward", "stream_backward", _ppo_chunk, row_items=True),
    BackwardOp: OpKind("backward", "stream_backward", _grpo_chunk, row_items=True, parts=True),
}


def op_kind(op) -> OpKind:
    """The table entry of ``op``'s type (or of the nearest base type listed)."""
    for cls in type(op).__mro__:
        if cls in OP_KINDS:
            return OP_KINDS[cls]
    raise TypeError(f"unknown stream op {op!r}: list its type in stream_exec.OP_KINDS")


def _request(worker_group, op, rows, *, pad_token_id: int, temperature: float, queued: bool, seq: int = 0):
    """``(worker method, args)`` for one op; a queued call carries its ticket ``seq``."""
    kind, suffix = op_kind(op), "_queued" if queued else ""
    if kind.chunk is None:
        return kind.method + suffix, ((op.folds, seq) if queued else (op.folds,))
    dp_size = va.actor_dp_size(worker_group)  # verl's split: TP/PP/CP peers share one part, so no padding for them
    layout = {"dp_size": dp_size, "pad_token_id": pad_token_id, "temperature": temperature}
    if kind.parts and dp_size > 1:  # one part per data-parallel rank, sent as built (point 2)
        chunk = va.DataParallelParts(kind.chunk(op, rows, parts=True, **layout))
    else:
        chunk = kind.chunk(op, rows, **layout)
    for part in (chunk if isinstance(chunk, va.DataParallelParts) else [chunk]):
        if queued:
            va.assign_non_tensor(part, **{SEQ_KEY: int(seq)})
    return kind.method + suffix, (chunk,)


def _row_field(chunk_rows: list, key: str) -> list | None:
    """Every row's ``key`` (``rollout_lp``; ``ref_lp`` with use_kl_loss, taken on arrival), or None if a row lacks it."""
    return [r[key] for r in chunk_rows] if all(key in r for r in chunk_rows) else None


def _stats(op, parts: list) -> dict:
    kind = op_kind(op)
    if kind.chunk is None:
        return {}
    stats = {"lp_gap": _stat(parts, "ts_lp_diff_max", max), "forward_s": _stat(parts, "ts_forward_s", max),
             **kind.stats(op, parts)}
    return {k: v for k, v in stats.items() if not math.isnan(v)}


class OpPipeline:
    """Planner ops queued on the learner, at most ``depth`` in flight, finished in order; one per batch
    (tickets start at 0, as the worker's do after ``stream_begin_batch``).

    ``on_done(op, stats, t_start, t_end)`` is called for each finished op, in submission order, with
    ``execute_op``'s stats and the worker's own start/end times of the call. ``depth=1`` sends each op
    as one blocking call (``execute_op``) and times it on the driver.
    """

    def __init__(self, worker_group, *, pad_token_id: int, temperature: float,
                 on_done: Callable[[object, dict, float, float], None], depth: int = 2, cost: CallCost | None = None):
        if depth < 1:
            raise ValueError(f"OpPipeline depth must be >= 1 (ops in flight), got {depth}")
        self.wg, self.pad_token_id, self.temperature = worker_group, pad_token_id, temperature
        self.on_done, self.depth = on_done, depth
        self.cost = cost if cost is not None else CallCost()
        self._inflight: collections.deque = collections.deque()
        self._seq = 0
        self._free_at = 0.0  # the worker's end time of the last call handed back

    def submit(self, op, rows: dict, tokens: int | None = None, t_plan: float | None = None) -> None:
        """Queue ``op``; returns once at most ``depth`` ops are in flight. ``tokens``: the op's prompt and response
        tokens (its cost); None leaves the op out of the duration model, and ``learner_idle_at`` unknown while
        it is queued. ``t_plan``: when the plan that made it began (its listing), for the lead; default now."""
        t_begin = time.time() if t_plan is None else min(t_plan, time.time())
        if self.depth == 1:
            stats = execute_op(self.wg, op, rows, pad_token_id=self.pad_token_id, temperature=self.temperature)
            self.on_done(op, stats, t_begin, time.time())
            return
        method, args = _request(self.wg, op, rows, pad_token_id=self.pad_token_id, temperature=self.temperature,
                                queued=True, seq=self._seq)
        refs = va.worker_result_refs(getattr(self.wg, method)(*args))
        self._seq += 1
        idle = not self._inflight  # the learner may be idle: this call's start measures the lead
        self._inflight.append((op, refs, time.time(), t_begin, tokens, idle))
        self.collect(keep=self.depth)

    def learner_idle_at(self) -> float | None:
        """When the learner is expected to have finished every call in flight (now, with none); None while a
        queued call's duration cannot be predicted yet."""
        if not self._inflight:
            return time.time()
        queued = []
        for op, _, _, t_begin, tokens, _ in self._inflight:
            if tokens is None:
                return None
            queued.append((_kind(op), tokens, t_begin))
        return queue_end(self.cost, self._free_at, queued)

    @property
    def in_flight(self) -> int:
        """Ops sent and not yet handed back."""
        return len(self._inflight)

    def collect(self, keep: int | None = None) -> None:
        """Hand back every finished op at the head; with ``keep``, wait until at most ``keep`` are in flight."""
        while self._inflight:
            op, refs, t_sent, t_begin, tokens, idle = self._inflight[0]
            must_wait = keep is not None and len(self._inflight) > keep
            if not must_wait and len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
                return
            try:
                parts = _parts(ray.get(refs))
            except BaseException:
                self._abandon()
                raise
            self._inflight.popleft()
            t_start = _stat(parts, "ts_t_start", min)
            t_end = _stat(parts, "ts_t_end", max)
            t_start = t_sent if math.isnan(t_start) else t_start
            t_end = time.time() if math.isnan(t_end) else t_end
            if tokens is not None:
                self.cost.observe(_kind(op), tokens, t_end - t_start)
                if idle and t_start >= self._free_at:
                    self.cost.observe_lead(t_start - t_begin)
            self._free_at = max(self._free_at, t_end)
            self.on_done(op, _stats(op, parts), t_start, t_end)

    def drain(self) -> None:
        """Wait for every op in flight (before the optimizer step)."""
        self.collect(keep=0)

    def _abandon(self) -> None:
        """After a failure: let the calls already sent finish (each refuses: the batch failed), drop them."""
        refs = [r for _, op_refs, *_ in self._inflight for r in op_refs]
        self._inflight.clear()
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=60)


def _kind(op) -> str:
    return op_kind(op).name


def _wait(result):
    """Block on a worker-group call's result (a list of object refs or a future); return its value."""
    if isinstance(result, list) and result and isinstance(result[0], ray.ObjectRef):
        return ray.get(result)
    if type(result).__name__ == "DataProtoFuture":
        return result.get()
    return result


def _parts(results) -> list:
    """The per-rank chunk results (one TensorDict row each)."""
    return [p for p in (results if isinstance(results, list) else [results]) if p is not None and hasattr(p, "keys")]


def _stat(parts: list, key: str, reduce) -> float:
    """``reduce`` (sum or max) of one measurement over ranks; NaN when no rank measured it."""
    values = [float(v) for p in parts if key in p.keys() for v in p[key].reshape(-1).tolist()]
    values = [v for v in values if not math.isnan(v)]
    return float(reduce(values)) if values else float("nan")

