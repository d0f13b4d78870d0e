"""One forward for many requests whose KV caches have different lengths.

Why:
1. On a CPU a tiny model's forward costs about the same for 1 row as for 32 (framework
   overhead dominates), so decoding one sequence per forward makes rollout compute-bound
   and hides exactly the tool latency that streaming training overlaps with.
2. Each request keeps its own per-layer K/V tensors ([1, H_kv, L_i, D]). A step stacks
   them left-padded to the longest, masks the padding (attention_mask 0), gives each row
   its true position, runs the model once, and cuts each row's cache back to its true
   length. Masked keys get exactly zero attention weight, so a row's logits equal its
   unbatched logits up to floating-point summation order (tests check 1e-5).
3. Prefill batches prompts the same way (left padding, positions from the mask). Only the
   last position's logits are returned: that is all sampling needs. A padded batch pays for the
   longest prompt in every row, so prompts of very different lengths (a multi-turn run's turns:
   the task prompt alone beside three turns of history) go in separate forwards of similar lengths
   (``length_groups``): on the tiny student, prompts of 60 / 200 / 400 / 700 tokens took 0.040 CPU-s
   as one padded batch and 0.017 one by one, while equal lengths batch better (4 x 300: 0.012
   against 0.015; 8 x 100: 0.007 against 0.013).
4. Scoring (every position's logits, ``all_logits``) is the exception: a long sequence's forward is compute, not
   overhead, and a left-padded batch pays for its padding and takes the attention's masked path. The tiny
   teacher (4 layers, hidden 192) scored prefixes of 300 / 700 / 1200 / 1800 tokens in 0.78 CPU-s as one padded
   batch and in 0.21 s one by one; four of 1000 tokens cost the same either way (0.19 s). So each sequence is
   scored alone, unpadded, as a serving engine's varlen batch would (vLLM pads nothing).
"""

from __future__ import annotations

from typing import Sequence

import torch

# One request's cache: per layer (keys, values), each [1, H_kv, L, D].
KV = list[tuple[torch.Tensor, torch.Tensor]]


def _cache_from(layers: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers.cache_utils import DynamicCache

    return DynamicCache(ddp_cache_data=layers)


def _layers_of(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(k, v) for k, v in cache]  # legacy tuple caches


def _split(cache, lengths: Sequence[int]) -> list[KV]:
    """Row i of a left-padded batch cache, trimmed to its last ``lengths[i]`` positions."""
    layers = _layers_of(cache)
    return [[(k[i : i + 1, :, k.shape[2] - n :], v[i : i + 1, :, v.shape[2] - n :]) for k, v in layers]
            for i, n in enumerate(lengths)]


def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int):
    """``input_ids``, ``attention_mask``, ``position_ids`` ([B, W] each) of left-padded prompts."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, W]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, W]
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


PAD_SHARE = 0.25  # no row of a prefill forward is padded by more than this share of its width (point 3)


def length_groups(lengths: Sequence[int], pad_share: float | None = PAD_SHARE) -> list[list[int]]:
    """Indices of ``lengths`` in groups to prefill together, longest first: a prompt joins the group of the next
    longer ones while its padding to their width is at most ``pad_share`` of it (point 3); ``None``: everything
    in one group, in the given order."""
    if pad_share is None or len(lengths) <= 1:
        return [list(range(len(lengths)))]
    if not 0.0 <= pad_share < 1.0:
        raise ValueError(f"pad_share must be in [0, 1) or None, got {pad_share!r}")
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        if groups and lengths[groups[-1][0]] - lengths[i] <= pad_share * lengths[groups[-1][0]]:
            groups[-1].append(i)  # the group's first is its longest: its width
        else:
            groups.append([i])
    return groups


@torch.no_grad()
def prefill(model, prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, list[KV]]:
    """Run ``prompts`` (no cache) as one left-padded batch: ([B, V] last logits, per-row caches)."""
    ids, mask, positions = _left_padded(prompts, pad_id)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    return out.logits[:, -1].float(), _split(out.past_key_values, [len(p) for p in prompts])


@torch.no_grad()
def all_logits(model, prompt: Sequence[int]) -> torch.Tensor:
    """Every position's logits of ``prompt`` ([L, V]), from its own unpadded forward (point 4)."""
    return model(input_ids=torch.tensor([list(prompt)], dtype=torch.long), use_cache=False).logits[0].float()


@torch.no_grad()
def decode(model, tokens: Sequence[int], caches: Sequence[KV]) -> tuple[torch.Tensor, list[KV]]:
    """One new token per row on top of its cache: ([B, V] logits, per-row caches grown by one)."""
    lengths = [cache[0][0].shape[2] for cache in caches]
    width = max(lengths)
    batch = len(caches)
    layers = []
    for layer in range(len(caches[0])):
        k0, v0 = caches[0][layer]
        keys = k0.new_zeros((batch, k0.shape[1], width, k0.shape[3]))  # [B, H_kv, W, D]
        values = v0.new_zeros((batch, v0.shape[1], width, v0.shape[3]))
        for i, cache in enumerate(caches):
            k, v = cache[layer]
            keys[i, :, width - lengths[i] :] = k[0]
            values[i, :, width - lengths[i] :] = v[0]
        layers.append((keys, values))
    mask = torch.zeros((batch, width + 1), dtype=torch.long)  # [B, W + 1]
    for i, n in enumerate(lengths):
        mask[i, width - n :] = 1
    ids = torch.tensor(tokens, dtype=torch.long)[:, None]  # [B, 1]
    positions = torch.tensor(lengths, dtype=torch.long)[:, None]  # [B, 1]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=_cache_from(layers),
                use_cache=True)
    return out.logits[:, -1].float(), _split(out.past_key_values, [n + 1 for n in lengths])
