"""The Megatron-Core layer spec verl's mbridge path builds on a CPU: local modules, not TransformerEngine.

Why:
1. mbridge 0.15 always asks for the TransformerEngine layer spec, and TransformerEngine has no CPU
   build. Megatron-Core's own local spec (torch linear layers, ``DotProductAttention``) computes
   the same function, so the bridge's provider is given that spec instead (``local_layer_spec``).
2. Sequence parallelism: Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel``. A norm
   over the hidden dimension is per token, so it is correct on a sequence shard as long as the
   weight gradients are summed over the tensor-parallel group: ``TorchNorm`` builds torch's
   RMSNorm / LayerNorm and marks the parameters ``sequence_parallel=True``, which is exactly what
   ``finalize_model_grads`` all-reduces.
3. Attention mask: verl's padded (BSHD) path hands the model a [b, s] mask with True on real
   tokens (what TransformerEngine's kernels take). The local ``DotProductAttention`` masks scores
   with a [b, 1, s, s] mask, True where attention is NOT allowed, and uses no causal mask when one
   is given. ``PaddedCausalAttention`` builds causal-plus-padding from the [b, s] mask.
4. Packed sequences (verl's ``use_remove_padding=True``, Megatron's THD format): the local
   ``DotProductAttention`` refuses ``packed_seq_params`` (TransformerEngine's varlen kernels take them).
   The same attention runs over the pack as ONE sequence of t tokens under a block-diagonal causal mask
   built from ``cu_seqlens`` (``packed_causal_mask``): each token attends to the earlier tokens of its own
   sequence only, which is what the varlen kernel computes. Megatron's rotary embedding already restarts
   positions per sequence in THD (pure torch). The squeeze of the dummy batch dimension the attention layer
   does for THD is undone around the call. Quadratic in the pack length: a CPU path for tests.
"""

from __future__ import annotations

import dataclasses

import torch


class TorchNorm:
    """A factory with ``WrappedTorchNorm``'s signature that also works under sequence parallelism."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"the CPU layer spec supports RMSNorm and LayerNorm, not {config.normalization!r}")
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def causal_padding_mask(valid: torch.Tensor) -> torch.Tensor:
    """[b, s] True on real tokens -> [b, 1, s, s] True where query i must not attend to key j."""
    s = valid.shape[-1]
    future = torch.ones(s, s, dtype=torch.bool, device=valid.device).triu(diagonal=1)  # [s, s]
    return future.view(1, 1, s, s) | ~valid.bool().view(-1, 1, 1, s)  # [b, 1, s, s]


def packed_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[n + 1] cumulative sequence lengths of a pack of ``total`` tokens -> [1, 1, t, t] True where query i must
    not attend to key j: j is later than i or in another sequence (tokens past ``cu_seqlens[-1]`` form one more)."""
    bounds = cu_seqlens.to(device="cpu", dtype=torch.long)
    lengths = bounds.diff()
    if int(bounds[-1]) < total:
        lengths = torch.cat([lengths, torch.tensor([total - int(bounds[-1])])])
    segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # [t]
    if segment.numel() != total:
        raise ValueError(f"packed sequence lengths cover {segment.numel()} tokens, the pack has {total}")
    position = torch.arange(total)
    allowed = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
    return (~allowed).view(1, 1, total, total)


def _attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PaddedCausalAttention(DotProductAttention):
        """``DotProductAttention`` that accepts verl's [b, s] padding mask (see the module docstring)."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None:  # point 4: THD, [t, heads, dim] with the batch dimension squeezed
                if packed_seq_params.qkv_format != "thd":
                    raise ValueError(f"the CPU attention packs THD sequences only, not {packed_seq_params.qkv_format!r}")
                cu = packed_seq_params.cu_seqlens_q_padded
                cu = packed_seq_params.cu_seqlens_q if cu is None else cu
                mask = packed_causal_mask(cu, query.shape[0]).to(query.device)
                out = super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask,
                                      attn_mask_type, attention_bias, None)  # [t, 1, heads x dim]
                return out.squeeze(1)
            if attention_mask is not None and attention_mask.dim() == 2:
                attention_mask = causal_padding_mask(attention_mask)
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)

    return PaddedCausalAttention


_ATTENTION = None


def padded_causal_attention():
    global _ATTENTION
    if _ATTENTION is None:
        _ATTENTION = _attention_class()
    return _ATTENTION


def _is_wrapped_torch_norm(module) -> bool:
    return getattr(module, "__name__", "") in ("WrappedTorchNorm", "FusedLayerNorm")


def _swap_layer(layer_spec):
    """One transformer layer's spec with the CPU norms and attention."""
    sub = layer_spec.submodules
    changes = {name: TorchNorm for name in ("input_layernorm", "pre_mlp_layernorm")
               if _is_wrapped_torch_norm(getattr(sub, name, None))}
    attention = getattr(sub, "self_attention", None)
    if attention is not None and hasattr(attention.submodules, "core_attention"):
        att_sub = attention.submodules
        att_changes = {"core_attention": padded_causal_attention()}
        att_changes.update({n: TorchNorm for n in ("q_layernorm", "k_layernorm")
                            if _is_wrapped_torch_norm(getattr(att_sub, n, None))})
        changes["self_attention"] = dataclasses.replace(attention, submodules=dataclasses.replace(att_sub, **att_changes))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(sub, **changes))


def local_layer_spec(config, vp_stage=None):
    """Megatron-Core's local GPT block spec for ``config`` with the CPU norms and attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    layer_norm = TorchNorm if _is_wrapped_torch_norm(block.layer_norm) else block.layer_norm
    return dataclasses.replace(block, layer_specs=[_swap_layer(s) for s in block.layer_specs], layer_norm=layer_norm)
