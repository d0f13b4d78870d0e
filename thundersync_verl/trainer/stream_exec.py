"""Driver side of a streamed step: trajectory rows from the TransferQueue, ops to the learner.

1. Each trajectory is fetched from verl's TransferQueue once, when it lands (prompt, response,
   response mask with tool-observation tokens masked out, reward), and cached until its backward.
2. A ``BackwardOp`` becomes one chunk in verl's no-padding layout (``build_stream_chunk``), padded to the
   data-parallel size with zero-coefficient, zero-mask rows; a ``FoldOp`` is one ``stream_fold``.
3. An OPD ``TurnBackwardOp`` carries its own rows (each turn's prefix and teacher log-probs): it becomes one
   per-token chunk (``OPDStreamClient.chunk``) for ``stream_token_backward``.
"""

from __future__ import annotations

import math

import ray

from thundersync_verl.trainer.opd_stream import OPDStreamClient, TurnBackwardOp
from thundersync_verl.trainer.stream_loss import build_stream_chunk
from thundersync_verl.trainer.stream_plan import BackwardOp, FoldOp

ROW_FIELDS = ["prompts", "responses", "response_mask", "rm_scores", "extra_fields"]


def fetch_rows(tq, keys: list[str], partition_id: str = "train") -> dict[str, dict]:
    """``{key: {prompt, response, mask, reward, num_tokens, extra}}`` for finished trajectories."""
    data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=ROW_FIELDS)
    extras = data["extra_fields"]
    extras = extras.tolist() if hasattr(extras, "tolist") else list(extras)
    rows = {}
    for i, key in enumerate(keys):
        mask = data["response_mask"][i]
        rows[key] = {
            "prompt": data["prompts"][i].tolist(),
            "response": data["responses"][i].tolist(),
            "mask": mask.tolist(),
            "reward": float(data["rm_scores"][i].sum()),
            "num_tokens": int(mask.sum()),
            "extra": getattr(extras[i], "data", extras[i]) or {},
        }
    return rows


def execute_op(worker_group, op, rows: dict[str, dict], *, pad_token_id: int, temperature: float) -> dict:
    """Run one planner op on the learner and wait for it (errors surface here, before any step).

    Returns what the backward's own forward (at θ_k) measured: ``lp_gap`` (max |log p_rollout -
    log p_learner| over scored tokens) when the rows carry ``rollout_lp``; ``kl_sum`` and
    ``kl_tokens`` (log pi - log p_teacher summed over scored tokens) for an OPD turn chunk.
    """
    if isinstance(op, FoldOp):
        worker_group.stream_fold(op.folds)
        return {}
    if isinstance(op, TurnBackwardOp):  # OPD: the op holds its rows; ``rows`` is not needed
        client = OPDStreamClient(worker_group, pad_token_id=pad_token_id, temperature=temperature)
        parts = _parts(_wait(worker_group.stream_token_backward(client.chunk(op))))
        stats = {"kl_sum": _stat(parts, "ts_kl_sum", sum), "kl_tokens": _stat(parts, "ts_kl_tokens", sum),
                 "lp_gap": _stat(parts, "ts_lp_diff_max", max)}
        return {k: v for k, v in stats.items() if not math.isnan(v)}
    if not isinstance(op, BackwardOp):
        raise TypeError(f"unknown stream op {op!r}")
    chunk_rows = [rows[traj_id] for _, traj_id in op.items]
    with_lp = all("rollout_lp" in r for r in chunk_rows)
    chunk = build_stream_chunk([r["prompt"] for r in chunk_rows], [r["response"] for r in chunk_rows], op.coefs, op.dest,
                               dp_size=worker_group.world_size, pad_token_id=pad_token_id, temperature=temperature,
                               response_masks=[r["mask"] for r in chunk_rows],
                               rollout_log_probs=[r["rollout_lp"] for r in chunk_rows] if with_lp else None)
    gap = _stat(_parts(_wait(worker_group.stream_backward(chunk))), "ts_lp_diff_max", max)
    return {} if math.isnan(gap) else {"lp_gap": gap}


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
