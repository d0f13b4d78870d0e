"""The tiny tokenizer: deterministic, chat template as documented, verl-compatible. CPU only."""

from __future__ import annotations

import random

import pytest

from thundersync_verl.envs import protocol
from thundersync_verl.models.factory import build_tokenizer
from thundersync_verl.models.tokenizer import chat_ids, encode_transcript, render_chat, train_tokenizer
from thundersync_verl.models.variants import get_spec

SPEC = get_spec("student").scaled(n_transcripts=600)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(SPEC, seed=0)


def test_training_is_deterministic(tmp_path):
    a, b = build_tokenizer(SPEC, seed=0), build_tokenizer(SPEC, seed=0)
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    other_corpus = [render_chat(m) for m in protocol.transcripts(600, 0, tool_fraction=0.0)]  # no tool turns
    train_tokenizer(other_corpus).save_pretrained(tmp_path / "c")
    assert (tmp_path / "c" / "tokenizer.json").read_bytes() != (tmp_path / "a" / "tokenizer.json").read_bytes()


def test_vocab_and_special_tokens(tokenizer):
    assert 300 <= len(tokenizer) <= SPEC.vocab_size  # digits are split, so the corpus saturates below 512
    assert [tokenizer.convert_ids_to_tokens(i) for i in range(4)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    assert all(len(tokenizer.encode(d, add_special_tokens=False)) == 1 for d in "0123456789")
    assert len(tokenizer.encode("12345", add_special_tokens=False)) == 5
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|pad|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1, token


def test_markup_survives_skip_special_tokens_decode(tokenizer):
    messages = next(protocol.transcripts(1, 0, retry_prob=0.0))
    ids, _ = encode_transcript(tokenizer, messages)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>" not in text and "<|im_end|>" not in text
    assert "<tool_call>" in text and "<tool_response>" in text and "<answer>" in text
    assert protocol.parse_answer(text) == messages[-1]["content"][len("<answer>") : -len("</answer>")]


def test_apply_chat_template_returns_ids_and_appends_generation_prompt(tokenizer):
    messages = protocol.prompt_messages(protocol.Problem("37+45*2", 127))
    raw = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = chat_ids(tokenizer, messages, add_generation_prompt=True)
    assert ids == list(raw["input_ids"] if hasattr(raw, "keys") else raw)
    assert all(isinstance(i, int) for i in ids)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == render_chat(messages, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(ids) == text


def test_tool_role_and_openai_tool_calls_render(tokenizer):
    tool_turn = [{"role": "tool", "content": "<tool_response>127</tool_response>"}]
    assert tokenizer.apply_chat_template(tool_turn, tokenize=False) == "<|im_start|>tool\n<tool_response>127</tool_response><|im_end|>\n"
    call = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(1+1)"}}}
    openai_style = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    rendered = tokenizer.apply_chat_template(openai_style, tokenize=False)
    assert rendered == "<|im_start|>assistant\n" + protocol.tool_call_text("print(1+1)") + "<|im_end|>\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_turn_by_turn_ids_equal_whole_conversation_ids(tokenizer):
    """The agent loop builds sequences turn by turn; the warm start must have seen the same ids."""
    for messages in protocol.transcripts(50, 3, tool_fraction=0.5, retry_prob=0.5):
        ids, mask = encode_transcript(tokenizer, messages)
        assert ids == tokenizer.encode(render_chat(messages), add_special_tokens=False)
        assert ids == chat_ids(tokenizer, messages, add_generation_prompt=False)
        generated = tokenizer.decode([i for i, m in zip(ids, mask) if m])
        assert generated == "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")


def test_encoding_is_deterministic(tokenizer):
    texts = [render_chat(m) for m in protocol.transcripts(20, 9)]
    first = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    random.Random(0).shuffle(texts)
    again = {t: tokenizer.encode(t, add_special_tokens=False) for t in texts}
    assert [again[render_chat(m)] for m in protocol.transcripts(20, 9)] == first


def test_verl_chat_helpers_find_no_system_prompt_and_a_newline_separator(tokenizer):
    from verl.utils.tokenizer.chat_template import initialize_system_prompt, initialize_turn_separator

    assert initialize_system_prompt(tokenizer) == []  # no default system prompt is injected
    assert tokenizer.decode(initialize_turn_separator(tokenizer)) == "\n"
