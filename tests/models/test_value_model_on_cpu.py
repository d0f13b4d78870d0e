"""``write_value_model``: a policy checkpoint becomes a value model whose head is the same in every run.

verl's critic would otherwise draw the missing value head at random in each process, so two runs compared
on the same trajectories (Sync vs ThunderSync SAO) would start from different critics.
"""

from __future__ import annotations

import pytest
import torch

from thundersync_verl.models.value_model import main, write_value_model


def _policy(path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(1)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def _state(path):
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(path).state_dict()


def test_the_value_head_is_drawn_from_the_seed_and_the_body_is_the_policys(tmp_path):
    from safetensors.torch import load_file

    policy = _policy(tmp_path / "policy")
    a, b = _state(write_value_model(policy, tmp_path / "a")), _state(write_value_model(policy, tmp_path / "b"))
    other = _state(write_value_model(policy, tmp_path / "c", seed=1))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same seed: the same critic
    assert a["score.weight"].shape == (1, 32) and not torch.equal(a["score.weight"], other["score.weight"])
    body = load_file(policy / "model.safetensors")
    assert torch.equal(a["model.embed_tokens.weight"], body["model.embed_tokens.weight"])


def test_a_folder_without_a_model_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path), str(tmp_path / "out")])
    assert "no config.json" in capsys.readouterr().err
