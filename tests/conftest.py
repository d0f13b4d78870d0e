"""Shared fixtures. Every test here runs on a CPU (files are named *_on_cpu.py); none needs a GPU.

``thundersync_verl`` and the shared harness ``thundersync_harness`` (tests/harness/) are imported
from the editable install (``make install``), not through path edits.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VERL_PLATFORM", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_random_lm(tmp_path_factory):
    """A random 2-layer Qwen2 with the project's tokenizer, saved in HF format (seconds to build)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from thundersync_verl.envs import protocol
    from thundersync_verl.models.tokenizer import render_chat, train_tokenizer

    corpus = [render_chat(t) for t in protocol.transcripts(300, 0, tool_fraction=0.5)]
    tokenizer = train_tokenizer(corpus, vocab_size=400)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny_random_lm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
