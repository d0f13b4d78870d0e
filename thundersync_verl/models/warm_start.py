"""Supervised warm start of a tiny model on task transcripts (plain torch, CPU, seeded).

Why:
1. A randomly initialised model never emits a well-formed tool call, so RL from scratch would
   see zero reward. A short supervised phase teaches the format; RL then has something to improve.
2. Two phases. Copying digits (expression -> code, tool output -> answer) needs an
   induction-style attention circuit, which forms only once copy examples dominate the data.
   Phase 1 (``tool_only_steps``) trains on correct tool-using transcripts only; phase 2 trains
   on the variant's mix (for the student, 50% transcripts that skip the tool and guess), which
   sets how often the model calls the tool without unlearning how to copy.
3. Loss is taken on assistant tokens only (including the closing ``<|im_end|>``), exactly the
   tokens the policy generates in the agent loop, and is divided by a FIXED token count per
   phase, not by the batch's own count: batches are grouped by length, and a per-batch mean
   would over-weight the decisions of short (guessing) transcripts and bias the tool-use rate.
4. Determinism: data come from named random streams, batches from a seeded order, weights
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


def encode_corpus(tokenizer, spec: TinyModelSpec, seed: int, *, phase: int) -> list[tuple[list[int], list[int]]]:
    """Phase 1 (tool-only) or phase 2 (the variant's mix) transcripts as (ids, assistant-mask) pairs."""
    if phase == 1:
        n, tool_fraction = min(spec.n_transcripts, spec.tool_only_steps * spec.batch_size), 1.0
    else:
        n, tool_fraction = spec.n_transcripts, spec.tool_fraction
    stream = f"warmstart-{spec.name}-phase{phase}"
    conversations = protocol.transcripts(n, seed, tool_fraction=tool_fraction, retry_prob=spec.retry_prob, stream=stream)
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


def _phases(tokenizer, spec: TinyModelSpec, seed: int):
    """Yield (step, batch samples, loss normaliser) over both phases."""
    step = 0
    for phase, n_steps in ((1, spec.tool_only_steps), (2, spec.train_steps - spec.tool_only_steps)):
        if n_steps <= 0:
            continue
        corpus = encode_corpus(tokenizer, spec, seed, phase=phase)
        lengths = [len(ids) for ids, _ in corpus]
        tokens_per_batch = spec.batch_size * sum(sum(mask) for _, mask in corpus) / len(corpus)
        for index in _batches(lengths, spec.batch_size, n_steps, seed + 1000 * phase):
            yield step, [corpus[i] for i in index], tokens_per_batch
            step += 1


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

    if not 0 <= spec.tool_only_steps <= spec.train_steps:
        raise ValueError(
            f"tool_only_steps={spec.tool_only_steps} must lie in [0, train_steps={spec.train_steps}]: "
            "it is the length of the first (tool-only) phase of the warm start"
        )
    decay = [p for _, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.learning_rate,
        betas=(0.9, 0.95),
    )
    model.train()
    started, first_loss, running = time.perf_counter(), float("nan"), float("nan")
    log_every = max(1, spec.train_steps // 5)
    for step, samples, tokens_per_batch in _phases(tokenizer, spec, seed):
        for group in optimizer.param_groups:
            group["lr"] = spec.learning_rate * _lr_factor(step, spec)
        input_ids, attention, labels = _collate(samples, tokenizer.pad_token_id)
        logits = model(input_ids=input_ids, attention_mask=attention).logits  # [B, T, V]
        loss_sum = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),  # [B*(T-1), V]
            labels[:, 1:].reshape(-1),  # [B*(T-1)]
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        loss = loss_sum / tokens_per_batch  # fixed normaliser: every token weighs the same
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
