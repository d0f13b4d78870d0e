"""LoRA weights on the CPU rollouts: what verl pushes for a LoRA actor, merged into the served model
(``backends/lora_weights.py``, the ``hf_cpu`` and ``replay`` servers' ``update_weights``).

The pushes are built as verl 0.9.1 builds them from a peft model (``get_peft_model_state_dict``: the adapter under
``base_model.model.<module>.lora_A.weight``; the base under ``<module>.base_layer.weight``), and the served model
must compute what the peft model computes: its logits equal the adapted model's within fp32 rounding.
"""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import pytest
import torch

from thundersync_verl.backends.lora_weights import LoraMerger, LoraSpec, split_name
from thundersync_verl.core import StreamingConfigError, StreamingInputError

RANK, ALPHA = 8, 16


def _rollout_config(**engine_kwargs):
    return SimpleNamespace(dtype="float32", max_model_len=256, prompt_length=48, response_length=64,
                           engine_kwargs=engine_kwargs)


def _peft_model(path, seed: int):
    """The tiny model with verl's FSDP adapter (all-linear, rank 8, alpha 16), lora_B set away from its zero init."""
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(base, LoraConfig(task_type=TaskType.CAUSAL_LM, r=RANK, lora_alpha=ALPHA,
                                            target_modules="all-linear", bias="none"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def _adapter_push(model) -> list:
    """verl's adapter push (``get_per_tensor_param(base_sync_done=True)``): peft's state dict, full CPU tensors."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    return [(k, v.detach().clone()) for k, v in get_peft_model_state_dict(model).items()]


def _base_push(model) -> list:
    """verl's base push (``base_sync_done=False``): the base weights, adapted modules under ``base_layer`` names."""
    return [(k.replace("base_model.model.", "", 1), v.detach().clone()) for k, v in model.state_dict().items()
            if "lora_" not in k]


def _server(path, **model_fields):
    from thundersync_verl.backends.cpu.rollout import HFCpuServer

    return HFCpuServer(_rollout_config(), SimpleNamespace(local_path=str(path), **model_fields), None, 0)


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


IDS = [5, 17, 42, 99, 7, 63, 120, 11]


def test_push_names_are_told_apart():
    assert split_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight") == (
        "adapter", "model.layers.0.self_attn.q_proj", "A")
    assert split_name("model.layers.1.mlp.up_proj.lora_B.default.weight") == ("adapter", "model.layers.1.mlp.up_proj", "B")
    assert split_name("model.layers.0.self_attn.q_proj.base_layer.bias") == (
        "base", "model.layers.0.self_attn.q_proj.bias", "bias")
    assert split_name("model.norm.weight") == ("plain", "model.norm.weight", "")
    with pytest.raises(StreamingInputError, match="fix:"):
        split_name("base_model.model.model.embed_tokens.lora_embedding_A")


def test_the_scale_comes_from_the_peft_config_and_what_a_merge_cannot_express_is_refused():
    assert LoraSpec.from_peft_config({"r": 8, "lora_alpha": 16}).scaling == 2.0
    assert LoraSpec.from_peft_config({"r": 16, "lora_alpha": 8, "use_rslora": True}).scaling == 2.0
    for bad in ({"use_dora": True}, {"rank_pattern": {"q_proj": 4}}, {"fan_in_fan_out": True}):
        with pytest.raises(StreamingConfigError, match="fix:") as info:
            LoraSpec.from_peft_config({"r": 8, "lora_alpha": 16, **bad})
        assert next(iter(bad)) in str(info.value)


def test_the_scale_comes_from_verls_model_config_or_the_adapter_file(tmp_path):
    from omegaconf import OmegaConf

    assert LoraSpec.from_model_config(SimpleNamespace(local_path="x")) is None
    assert LoraSpec.from_model_config(OmegaConf.create({"path": "x", "lora_rank": 0})) is None
    assert LoraSpec.from_model_config(OmegaConf.create({"lora_rank": 8, "lora_alpha": 32})).scaling == 4.0
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 2}))
    spec = LoraSpec.from_model_config({"lora_rank": 8, "lora_adapter_path": str(tmp_path)})
    assert (spec.rank, spec.scaling) == (4, 0.5)


@pytest.mark.parametrize("path_of_push", ["checkpoint_engine", "naive_sync"])
def test_hf_cpu_serves_the_adapted_model_after_each_push(tiny_random_lm, path_of_push):
    """Checkpoint engine (ThunderSync's learner push): adapter tensors, the scale from the server's model config.
    Naive sync (verl's Sync): the same tensors with verl's peft config. Two pushes: the second re-merges from the
    base, so the served model is the second adapter's, not the sum of both."""
    naive = path_of_push == "naive_sync"
    server = _server(tiny_random_lm, **({} if naive else {"lora_rank": RANK, "lora_alpha": ALPHA}))
    for version, seed in ((1, 0), (2, 1)):
        model = _peft_model(tiny_random_lm, seed)
        peft_config = model.peft_config["default"].to_dict() if naive else None
        loaded = asyncio.run(server.update_weights(_adapter_push(model), version, peft_config=peft_config))
        assert loaded == 14 and server.engine.version == version  # 2 layers x 7 linear modules, merged
        served, adapted = _logits(server.engine.model, IDS), _logits(model, IDS)
        assert float((served - adapted).abs().max()) < 1e-4
    assert float((served - _logits(_peft_model(tiny_random_lm, 0), IDS)).abs().max()) > 1e-3  # version 1 is gone


def test_a_base_push_then_adapter_pushes_as_verl_sends_them_after_dummy_weights(tiny_random_lm):
    server = _server(tiny_random_lm, lora_rank=RANK, lora_alpha=ALPHA)
    model = _peft_model(tiny_random_lm, 3)
    with torch.no_grad():
        server.engine.model.model.layers[0].self_attn.q_proj.weight.zero_()  # "dummy" weights the base push overwrites
        server.engine.model.model.layers[0].self_attn.q_proj.bias.zero_()
    asyncio.run(server.update_weights(_base_push(model), 0, peft_config=model.peft_config["default"].to_dict()))
    asyncio.run(server.update_weights(_adapter_push(model), 1))
    assert float((_logits(server.engine.model, IDS) - _logits(model, IDS)).abs().max()) < 1e-4


def test_a_push_that_cannot_be_merged_is_refused_naming_the_fix(tiny_random_lm):
    model = _peft_model(tiny_random_lm, 0)
    push = _adapter_push(model)
    with pytest.raises(StreamingConfigError, match="lora_rank"):  # an adapter, and no rank / alpha anywhere
        asyncio.run(_server(tiny_random_lm).update_weights(push, 1))
    only_a = [(k, v) for k, v in push if "lora_A" in k]
    with pytest.raises(StreamingInputError, match="only lora_A"):
        asyncio.run(_server(tiny_random_lm, lora_rank=RANK).update_weights(only_a, 1))
    merger = LoraMerger(LoraSpec(RANK, ALPHA), lambda name: None)
    with pytest.raises(StreamingInputError, match="lacks"):
        merger.translate(push[:2])


def test_replay_keeps_the_served_model_of_a_lora_push(tiny_random_lm, tmp_path, monkeypatch):
    """``$THUNDERSYNC_REPLAY_WEIGHTS_DIR``: a LoRA push is kept as the model the rollout would serve (the checkpoint
    with the adapter merged), so two runs' pushes compare as weights."""
    from safetensors.torch import load_file

    from thundersync_verl.backends.replay.server import WEIGHTS_DIR_ENV, ReplayServer

    monkeypatch.setenv(WEIGHTS_DIR_ENV, str(tmp_path / "weights"))
    (tmp_path / "rec.jsonl").write_text("")
    monkeypatch.setattr("thundersync_verl.backends.replay.server.Recording", lambda *a, **k: SimpleNamespace())
    server = ReplayServer(_rollout_config(replay={"path": str(tmp_path / "rec.jsonl")}),
                          SimpleNamespace(local_path=str(tiny_random_lm), lora_rank=RANK, lora_alpha=ALPHA))
    model = _peft_model(tiny_random_lm, 0)
    asyncio.run(server.update_weights(_adapter_push(model), 1))
    kept = torch.load(os.path.join(tmp_path / "weights", "weights_v1.pt"))
    start = {k: v for f in sorted(tiny_random_lm.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert kept.keys() == start.keys()
    q = "model.layers.0.self_attn.q_proj.weight"
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    expected = start[q] + ALPHA / RANK * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    assert torch.allclose(kept[q], expected, atol=1e-6) and torch.equal(kept["model.norm.weight"], start["model.norm.weight"])
