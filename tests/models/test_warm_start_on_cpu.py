"""Warm-start data order and phases: deterministic, length-grouped, tool-only first. CPU only."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from thundersync_verl.models import factory
from thundersync_verl.models.variants import get_spec
from thundersync_verl.models.warm_start import _batches, _lr_factor, _phases, warm_start


def test_batches_cover_every_sample_once_per_epoch_and_group_lengths():
    lengths = [random.Random(i).randint(10, 200) for i in range(512)]
    batches = list(_batches(lengths, batch_size=16, n_steps=32, seed=0))  # exactly one epoch
    seen = sorted(i for batch in batches for i in batch)
    assert seen == list(range(512))
    spreads = [max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches]
    assert sum(spreads) / len(spreads) < 0.25 * (max(lengths) - min(lengths))  # grouped, little padding
    assert batches == list(_batches(lengths, batch_size=16, n_steps=32, seed=0))
    assert batches != list(_batches(lengths, batch_size=16, n_steps=32, seed=1))


def test_phase_one_is_tool_only_and_phase_two_is_the_mix():
    spec = dataclasses.replace(get_spec("student"), train_steps=40, tool_only_steps=15, n_transcripts=400, batch_size=16)
    tokenizer = factory.build_tokenizer(spec.scaled(n_transcripts=200), 0)
    tool_id = tokenizer.convert_tokens_to_ids("<tool_response>")
    phase1, phase2, norms = [], [], set()
    for step, samples, tokens_per_batch in _phases(tokenizer, spec, seed=0):
        uses_tool = [tool_id in ids for ids, _ in samples]
        (phase1 if step < 15 else phase2).extend(uses_tool)
        norms.add((step < 15, round(tokens_per_batch, 6)))
    assert len(phase1) == 15 * 16 and all(phase1)
    assert len(phase2) == 25 * 16 and 0.35 < sum(phase2) / len(phase2) < 0.65
    assert len(norms) == 2  # one fixed normaliser per phase, whatever the batch holds


def test_learning_rate_warms_up_then_decays_to_a_floor():
    spec = get_spec("student")
    factors = [_lr_factor(s, spec) for s in range(spec.train_steps)]
    assert factors[0] < factors[spec.warmup_steps - 1] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1, abs=1e-3) and min(factors[spec.warmup_steps :]) >= 0.1


@pytest.mark.slow  # trains a model for 25 steps
def test_a_short_warm_start_lowers_the_loss():
    from transformers import Qwen2ForCausalLM

    spec = get_spec("student").scaled(train_steps=25, n_transcripts=200)
    tokenizer = factory.build_tokenizer(spec, 0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(factory._model_config(spec, tokenizer))
    stats = warm_start(model, tokenizer, spec, seed=0)
    assert stats["steps"] == 25 and stats["final_loss"] < 0.7 * stats["first_loss"]
    with pytest.raises(ValueError, match="tool_only_steps"):
        warm_start(model, tokenizer, dataclasses.replace(spec, tool_only_steps=99), seed=0)
