"""Driver side of a streamed step: trajectory rows from the TransferQueue, ops to the learner.

1. Each trajectory is fetched from verl's TransferQueue once, when it lands (prompt, response,
   response mask with tool-observation tokens masked out, reward), and cached until its backward.
2. A ``BackwardOp`` becomes one chunk in verl's no-padding layout (``stream_loss``), padded to the
   data-parallel size with zero-coefficient, zero-mask rows; a ``FoldOp`` is one ``stream_fold``.
"""

from __future__ import annotations

import ray
import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.trainer.stream_loss import COEF_KEY, DEST_KEY, pad_batch
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


def build_chunk(rows: list[dict], coefs, dest: str, *, dp_size: int, pad_token_id: int, temperature: float):
    """The TensorDict ``stream_backward`` takes: real response masks, padded to a multiple of ``dp_size``."""
    from tensordict import TensorDict

    n_pad = (-len(rows)) % int(dp_size)
    rows = list(rows) + [rows[-1]] * n_pad
    tensors = pad_batch([r["prompt"] for r in rows], [r["response"] for r in rows], pad_token_id)
    mask = torch.zeros_like(tensors["response_mask"])  # [B, R]
    for b, r in enumerate(rows[: len(rows) - n_pad]):
        mask[b, : len(r["mask"])] = torch.tensor(r["mask"], dtype=mask.dtype)  # tool observations stay 0
    tensors["response_mask"] = mask
    tensors[COEF_KEY] = torch.tensor([float(c) for c in coefs] + [0.0] * n_pad, dtype=torch.float64)  # [B]
    td = TensorDict(tensors, batch_size=[len(rows)])
    va.assign_non_tensor(td, temperature=float(temperature), **{DEST_KEY: dest})
    return va.to_no_padding(td)


def execute_op(worker_group, op, rows: dict[str, dict], *, pad_token_id: int, temperature: float) -> None:
    """Run one planner op on the learner and wait for it (errors surface here, before any step)."""
    if isinstance(op, FoldOp):
        worker_group.stream_fold(op.folds)
        return
    if not isinstance(op, BackwardOp):
        raise TypeError(f"unknown stream op {op!r}")
    chunk_rows = [rows[traj_id] for _, traj_id in op.items]
    chunk = build_chunk(chunk_rows, op.coefs, op.dest, dp_size=worker_group.world_size,
                        pad_token_id=pad_token_id, temperature=temperature)
    result = worker_group.stream_backward(chunk)
    if isinstance(result, list) and result and isinstance(result[0], ray.ObjectRef):
        ray.get(result)
    elif type(result).__name__ == "DataProtoFuture":
        result.get()
