"""The launch check of the learner's bucket memory: refused on the driver, before Ray starts.

Why:
1. A budget that cannot hold one open group, or host buckets that do not fit the node's host memory,
   used to fail on the learner at the first batch (or worse: the kernel's OOM killer, mid-step). The
   bucket size is known before anything starts: the model's parameter count (its Hugging Face config,
   instantiated on the meta device: no weights read) over the ranks that shard the gradient.
2. Placement and bytes come from ``core/bucket_memory.bucket_memory``, the function the learner's
   ``BufferPool`` and ``thundersync plan`` use: the three agree by construction.
3. The planned peak is the buckets the run can hold at once: the whole batch's worst case (every
   member of every group in its own reward bucket, ``train_batch_size x rollout.n``) capped by
   ``thundersync.memory_budget_bytes``, and never below one group's worst case (``rollout.n`` buckets),
   which the stream needs to make progress. It is refused when it exceeds the budget, or, with host
   buckets, when the node's learner ranks together exceed the host memory available now.
4. A model whose config cannot be read here (recipe checks without ``MODEL_PATH``) is not sized: the
   learner still enforces the budget bucket by bucket.
5. With LoRA (``model.lora_rank > 0``, verl's FSDP engine) only the adapter carries a gradient, so a bucket holds
   the adapter's parameters: peft's adapter built on the meta-device model with verl's settings (rank, target and
   excluded modules), counted as the learner counts them (``learner/engines/fsdp.py`` point 4).
"""

from __future__ import annotations

import os
from typing import Any

from thundersync_verl.config import ThunderSyncConfig
from thundersync_verl.core.bucket_memory import BucketMemory, bucket_memory
from thundersync_verl.core.config_validation import config_value as _get
from thundersync_verl.core.errors import StreamingConfigError, rule_message


def available_host_bytes() -> int:
    """Host memory available now (psutil, else ``os.sysconf``)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def model_numel(model_path: str) -> int | None:
    """Parameters of the Hugging Face model at ``model_path`` (meta device: no weights read); None if unreadable."""
    if not model_path or not os.path.isfile(os.path.join(str(model_path), "config.json")):
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return sum(p.numel() for p in model.parameters())


def adapter_numel(model_path: str, lora: dict) -> int | None:
    """Parameters of the peft adapter ``lora`` (``LoraConfig`` keywords) on the model at ``model_path`` (point 5)."""
    if not model_path or not os.path.isfile(os.path.join(str(model_path), "config.json")):
        return None
    import torch
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        model = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, bias="none", **lora))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def lora_settings(config: Any) -> dict | None:
    """The adapter verl's FSDP engine builds (``model.lora_rank > 0``), as peft ``LoraConfig`` keywords; else None."""
    model = "actor_rollout_ref.model"
    rank = int(_get(config, f"{model}.lora_rank", 0) or 0)
    if rank <= 0 or _get(config, "actor_rollout_ref.actor.strategy", "fsdp") == "megatron":
        return None
    plain = {k: _get(config, f"{model}.{k}") for k in ("target_modules", "exclude_modules")}
    plain = {k: (list(v) if v is not None and not isinstance(v, str) else v) for k, v in plain.items()}
    return {"r": rank, "lora_alpha": float(_get(config, f"{model}.lora_alpha", 16)), **plain}


def grad_shards(config: Any) -> int:
    """Ranks that split one bucket: FSDP and Megatron's distributed optimizer shard over every learner rank,
    plain Megatron DDP over tensor x pipeline parallel only."""
    world = int(_get(config, "trainer.n_gpus_per_node", 1)) * int(_get(config, "trainer.nnodes", 1))
    actor = "actor_rollout_ref.actor"
    if _get(config, f"{actor}.strategy", "fsdp") == "megatron":
        if _get(config, f"{actor}.megatron.use_distributed_optimizer", True):
            return world
        return int(_get(config, f"{actor}.megatron.tensor_model_parallel_size", 1)) * int(
            _get(config, f"{actor}.megatron.pipeline_model_parallel_size", 1))
    return world


def planned_buckets(config: Any, numel: int | None = None) -> BucketMemory | None:
    """The planned bucket peak of one learner rank (point 3); None when the model cannot be sized."""
    if numel is None:
        try:
            path, lora = _get(config, "actor_rollout_ref.model.path", ""), lora_settings(config)
            numel = adapter_numel(path, lora) if lora else model_numel(path)
        except Exception:  # an unset ${oc.env:MODEL_PATH}, a config transformers cannot read: not sized (point 4)
            numel = None
    if numel is None:
        return None
    ts = ThunderSyncConfig.from_verl(config)
    n, groups = int(_get(config, "actor_rollout_ref.rollout.n", 1)), int(_get(config, "data.train_batch_size", 1))
    place = {"bucket_device": ts.bucket_device, "accelerator": str(_get(config, "trainer.device", "cuda")) != "cpu"}
    per_rank = -(-int(numel) // grad_shards(config))
    cap = groups * n if ts.memory_budget_bytes is None else ts.memory_budget_bytes // max(
        bucket_memory(per_rank, **place).bucket_bytes, 1)
    return bucket_memory(per_rank, **place, buckets=max(n, min(groups * n, cap)))


def check_bucket_memory(config: Any, numel: int | None = None, host_bytes: int | None = None) -> BucketMemory | None:
    """Refuse (naming the key) a planned bucket peak above the budget or above the host memory (point 3)."""
    mem = planned_buckets(config, numel)
    if mem is None:
        return None
    budget = ThunderSyncConfig.from_verl(config).memory_budget_bytes
    n = int(_get(config, "actor_rollout_ref.rollout.n", 1))
    if budget is not None and mem.peak_bytes > budget:
        raise StreamingConfigError(rule_message(
            f"thundersync.memory_budget_bytes={budget} is below the planned bucket peak of {mem.peak_bytes} bytes "
            f"({mem.buckets} buckets of {mem.bucket_bytes} bytes, {mem.storage} memory)",
            "a group keeps up to rollout.n reward buckets until its last reward lands; a budget that cannot hold "
            "one group stalls the stream",
            f"raise thundersync.memory_budget_bytes to at least {n * mem.bucket_bytes} (`thundersync plan` prices "
            "the budget for a shape and layout), or shard the gradient over more ranks"))
    ranks = int(_get(config, "trainer.n_gpus_per_node", 1))
    available = available_host_bytes() if host_bytes is None else int(host_bytes)
    if mem.storage == "host" and ranks * mem.host_bytes > available:
        raise StreamingConfigError(rule_message(
            f"thundersync.memory_budget_bytes / thundersync.bucket_device=host: {ranks} learner ranks x "
            f"{mem.host_bytes} bytes of host buckets exceed the {available} bytes of host memory available",
            "host buckets are pinned memory of this node: past it the kernel kills the learner mid-step",
            "lower thundersync.memory_budget_bytes (new groups then wait for memory; the update is the same), "
            "or set thundersync.bucket_device=device where the accelerator has room"))
    return mem
