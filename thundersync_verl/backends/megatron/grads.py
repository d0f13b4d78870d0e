"""Megatron-Core's gradient buffers and gradient finalisation, as the streaming learner uses them.

Why:
1. Megatron's DDP wrapper accumulates every backward into one flat fp32 grad buffer per model
   chunk (``param.main_grad`` are views into it): P / (TP x PP) values on each rank. Copying,
   zeroing and adding to those flat tensors is exact and cheap, so a bucket is a copy of them.
2. With the distributed optimizer, ``finalize_model_grads`` reduce-scatters each DDP bucket over
   data-parallel ranks: rank r keeps region r, ``(1/dp) * sum_q buffer_q[r]``. A streamed bucket
   only ever reaches the step through that reduction, so it is reduce-scattered when it is
   filled (``reduce_scatter_shards``: one collective per bucket backward) and kept as region r
   only: P / (TP x PP x DP) values. Folding it into region r of this rank's own buffer before the
   ONE finalize gives ``(1/dp) * (sum_q direct_q[r] + c * sum_q bucket_q[r])``: exactly the
   bucket's trajectories counted with coefficient c, as if they had been backpropagated directly.
3. verl registers ``finalize_model_grads`` as the model config's ``finalize_model_grads_func``,
   so every ``forward_backward_batch`` call reduces (and, with the distributed optimizer,
   reduce-scatters in place), TP-all-reduces sequence-parallel norms and all-reduces tied
   embeddings. Repeated per streamed call that is wrong (measured: 0.52 relative error with the
   distributed optimizer, 3.35 with PP2 tied embeddings). ``no_finalize`` switches it off for a
   streamed call; ``finalize`` runs it once, at the barrier.
4. With bf16/fp16 parameters the model holds 16-bit copies and Megatron's mixed-precision optimizer
   steps fp32 main parameters (``param.main_param``), so the update is the change of the main
   parameters; the 16-bit copies round it to the parameter's ulp, which is near the size of one
   step's change. ``master_parameters`` reads the main parameters where the optimizer keeps whole
   ones, the parameters themselves in fp32 training.
"""

from __future__ import annotations

import contextlib

import torch

from thundersync_verl.backends.megatron import cpu_device


def ddp_config(chunks):
    return chunks[0].ddp_config


def model_configs(chunks) -> list:
    """The distinct transformer configs of the model chunks (verl sets its hooks on these)."""
    from megatron.core.utils import get_model_config

    configs = {}
    for chunk in chunks:
        config = get_model_config(chunk)
        configs[id(config)] = config
    return list(configs.values())


def _buffers(chunk) -> list:
    return list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", []))


def _bucket_groups(chunk) -> list:
    return list(chunk.bucket_groups) + list(getattr(chunk, "expert_parallel_bucket_groups", []))


def grad_buffers(chunks) -> list[torch.Tensor]:
    """The flat grad buffers of every chunk: this rank's whole accumulated gradient."""
    return [buffer.grad_data for chunk in chunks for buffer in _buffers(chunk)]


def _shards(chunks):
    """(bucket grad_data, group, size, rank) for every DDP bucket, in a fixed order."""
    for chunk in chunks:
        for group in _bucket_groups(chunk):
            for bucket in group.buckets:
                yield (bucket.grad_data, group.intra_distributed_optimizer_instance_group,
                       group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank)


def own_regions(chunks) -> list[torch.Tensor]:
    """Views of the region of every DDP bucket this rank keeps after the reduce-scatter."""
    out = []
    for data, _group, size, rank in _shards(chunks):
        n = data.numel() // size
        out.append(data.view(-1)[rank * n:(rank + 1) * n])
    return out


def reduce_scatter_shards(chunks) -> list[torch.Tensor]:
    """``sum_q buffer_q[r]`` for every DDP bucket (new tensors; a collective over data-parallel ranks)."""
    cpu_device.ensure_active_if_cpu()
    out = []
    for data, group, size, _rank in _shards(chunks):
        shard = torch.empty(data.numel() // size, dtype=data.dtype, device=data.device)
        torch.distributed.reduce_scatter_tensor(shard, data.view(-1), op=torch.distributed.ReduceOp.SUM, group=group)
        out.append(shard)
    return out


@contextlib.contextmanager
def no_finalize(chunks):
    """Within: Megatron's schedules run without ``finalize_model_grads`` (restored on exit)."""
    configs = model_configs(chunks)
    saved = [c.finalize_model_grads_func for c in configs]
    for c in configs:
        c.finalize_model_grads_func = None
    try:
        yield
    finally:
        for c, fn in zip(configs, saved):
            c.finalize_model_grads_func = fn


def finalize(chunks) -> None:
    """The model's finalize function over all chunks, once, as the schedule calls it at its end.

    That is the function verl registered (``finalize_model_grads``), or Megatron's own if none is set. No token
    count is passed: in Megatron's per-token-loss regime that finalize divides by nothing (the learner applies
    the stream's own scale, ``learner/engines/megatron.py`` point 6).
    """
    from megatron.core.distributed import finalize_model_grads

    cpu_device.ensure_active_if_cpu()
    fn = model_configs(chunks)[0].finalize_model_grads_func or finalize_model_grads
    fn(list(chunks), None)


def local_parameters(chunks) -> list[torch.Tensor]:
    return [p for chunk in chunks for p in chunk.parameters()]


def master_parameters(chunks) -> list[torch.Tensor]:
    """``local_parameters`` with each 16-bit parameter replaced by its fp32 main parameter (point 4)."""
    from thundersync_verl.core.errors import StreamingConfigError, fail

    out = []
    for p in local_parameters(chunks):
        main = getattr(p, "main_param", None)
        sharded = getattr(p, "main_param_sharded", False) or (main is not None and main.numel() != p.numel())
        if main is None and not sharded:
            out.append(p)
        elif sharded:
            fail("the fp32 main parameters of a 16-bit model are read whole, one per parameter",
                 "with the distributed optimizer each rank keeps a shard of every main parameter, and the 16-bit "
                 "parameters round one step's change to their ulp",
                 "compare updates with the distributed optimizer in fp32 (megatron.dtype=float32 on the CPU), or "
                 "without it", cls=StreamingConfigError)
        else:
            out.append(main)
    return out
