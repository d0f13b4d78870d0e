"""Supervised warm start of a tiny model on task transcripts (plain torch, CPU, seeded).

Why:
1. A randomly initialised model never emits a well-formed tool call, so RL from scratch would
   see zero reward. A short supervised phase teaches the format; RL then has something to improve.
2. Loss is taken on assistant tokens only (including the closing ``<|im_end|>``), exactly the
   tokens the policy generates in the agent loop; prompts and tool turns are context.
3. Determinism: data come from a named random stream, batches from a seeded order, weights
   from a seeded init, and the thread count is fixed, so two builds give bitwise-equal weights.
"""

from __future__ import annotations

import math
import random
import time
from typing import Callable

from thundersync_verl.envs import protocol
from thundersync_verl.models.tokenizer import encode_transcript
from thundersync_verl.models.variants import TinyModelSpec

IGNORE_INDEX = -100


def encode_corpus(tokenizer, spec: TinyModelSpec, seed: int) -> list[tuple[list[int], list[int]]]:
    """The warm-start transcripts of ``spec`` as (ids, assistant-mask) pairs."""
    stream = f"warmstart-{spec.name}"
    conversations = protocol.transcripts(
        spec.n_transcripts, seed, tool_fraction=spec.tool_fraction, retry_prob=spec.retry_prob, stream=stream
    )
    return [encode_transcript(tokenizer, messages) for messages in conversations]


def _collate(samples: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-pad a batch; labels are the ids where the mask is 1, else IGNORE_INDEX."""
    import torch

    width = max(len(ids) for ids, _ in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)  # [B, T]
    attention = torch.zeros((len(samples), width), dtype=torch.long)  # [B, T]
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)  # [B, T]
    for row, (ids, mask) in enumerate(samples):
        n = len(ids)
        input_ids[row, :n] = torch.tensor(ids)
        attention[row, :n] = 1
        labels[row, :n] = torch.where(torch.tensor(mask) == 1, torch.tensor(ids), IGNORE_INDEX)
    return input_ids, attention, labels


def _lr_factor(step: int, spec: TinyModelSpec) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.train_steps - spec.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _batches(lengths: list[int], batch_size: int, n_steps: int, seed: int, window: int = 16):
    """Index batches over reshuffled epochs, deterministic in ``seed``.

    Each window of ``window`` batches is sorted by length before it is cut into batches (and
    the batches are shuffled back), so a batch holds similar lengths and pads little: on a
    CPU, padding is pure waste.
    """
    rng = random.Random(f"order:{seed}")
    pending: list[list[int]] = []
    order: list[int] = []
    for _ in range(n_steps):
        if not pending:
            while len(order) < batch_size * window:
                epoch = list(range(len(lengths)))
                rng.shuffle(epoch)
                order += epoch
            chunk, order = order[: batch_size * window], order[batch_size * window :]
            chunk.sort(key=lambda i: lengths[i])
            pending = [chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size)]
            rng.shuffle(pending)
        yield pending.pop()


def warm_start(
    model,
    tokenizer,
    spec: TinyModelSpec,
    seed: int,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, float]:
    """Train ``model`` in place; returns {"first_loss", "final_loss", "seconds", "steps"}."""
    import torch
    import torch.nn.functional as F

    corpus = encode_corpus(tokenizer, spec, seed)
    pad_id = tokenizer.pad_token_id
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.learning_rate,
        betas=(0.9, 0.95),
    )
    model.train()
    started, first_loss, running = time.perf_counter(), float("nan"), float("nan")
    log_every = max(1, spec.train_steps // 5)
    lengths = [len(ids) for ids, _ in corpus]
    for step, index in enumerate(_batches(lengths, spec.batch_size, spec.train_steps, seed)):
        for group in optimizer.param_groups:
            group["lr"] = spec.learning_rate * _lr_factor(step, spec)
        input_ids, attention, labels = _collate([corpus[i] for i in index], pad_id)
        logits = model(input_ids=input_ids, attention_mask=attention).logits  # [B, T, V]
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),  # [B*(T-1), V]
            labels[:, 1:].reshape(-1),  # [B*(T-1)]
            ignore_index=IGNORE_INDEX,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())
        first_loss = value if step == 0 else first_loss
        running = value if step == 0 else 0.95 * running + 0.05 * value
        if (step + 1) % log_every == 0 or step + 1 == spec.train_steps:
            log(f"  {spec.name} step {step + 1}/{spec.train_steps} loss {running:.4f} ({time.perf_counter() - started:.0f} s)")
    model.eval()
    return {"first_loss": first_loss, "final_loss": running, "seconds": time.perf_counter() - started, "steps": spec.train_steps}
