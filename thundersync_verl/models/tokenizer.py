"""A tiny byte-level BPE tokenizer with a Qwen-style chat template, trained offline.

Why:
1. Nothing can be downloaded, so the tokenizer is trained on text the project generates (the
   task transcripts) and saved in HF format; verl loads it like any checkpoint's tokenizer.
2. Byte-level BPE never meets an unknown character, so any model output decodes. Digits are
   split one per token: the task is copying numbers (expression -> code, tool output ->
   answer), and a tiny model learns to copy a run of ten digit tokens far faster than a mix of
   one-token and multi-token numbers (measured: no copying at all after 1,500 steps with BPE
   number merges). ``vocab_size`` is an upper bound: with digits split, the generated corpus
   has ~350 tokens with at least two occurrences, and the trainer stops there.
3. ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and ``<|pad|>`` are special tokens;
   the tool and answer markup (``<tool_call>``, ``<tool_response>``, ``<answer>`` and their
   closers) are added tokens that are NOT special, as in Qwen2.5: verl's reward manager decodes
   responses with ``skip_special_tokens=True`` and the markup must survive that decode.
4. ``eos_token`` is ``<|im_end|>``: generation stops at the end of each assistant turn, which
   is where a multi-turn agent loop takes over. The chat template renders
   ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; every boundary is a special token, so
   tokenizing a whole conversation equals concatenating its turns' tokens (the agent loop
   builds sequences turn by turn and must get the same ids as the warm start saw).
5. In transformers 5.x ``apply_chat_template(..., tokenize=True)`` returns a ``BatchEncoding``,
   not a list: :func:`chat_ids` normalises that for our callers.
"""

from __future__ import annotations

import json
import re
from typing import Iterable, Sequence

from thundersync_verl.envs import protocol

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
MARKUP_TOKENS = (
    protocol.TOOL_CALL_OPEN,
    protocol.TOOL_CALL_CLOSE,
    protocol.TOOL_RESPONSE_OPEN,
    protocol.TOOL_RESPONSE_CLOSE,
    protocol.ANSWER_OPEN,
    protocol.ANSWER_CLOSE,
)
EOS_TOKEN, PAD_TOKEN, DOC_END_TOKEN = "<|im_end|>", "<|pad|>", "<|endoftext|>"
TURN_SEPARATOR = "\n"
MODEL_MAX_LENGTH = 1024

# Roles system/user/assistant/tool. Content may be a string or a list of {"type": "text"}
# parts; OpenAI-style assistant ``tool_calls`` render as Hermes <tool_call> blocks.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson(separators=(',', ':'))) -%}"
    "{{- '<tool_call>{\"name\":' + (fn['name'] | tojson) + ',\"arguments\":' + args + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_SPLIT_ON_ADDED = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + MARKUP_TOKENS))


def render_chat(messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    """Python mirror of :data:`CHAT_TEMPLATE` for plain string contents (used for the corpus)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>{TURN_SEPARATOR}" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 512):
    """Train the BPE on ``corpus`` (rendered conversations) and wrap it for transformers.

    Added tokens are cut out of the corpus first so no merge is wasted on their pieces. The
    result is deterministic for a given corpus (the BPE trainer breaks ties by pair order).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    added = list(SPECIAL_TOKENS + MARKUP_TOKENS)
    if vocab_size < 256 + len(added) + 16:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: byte-level BPE needs 256 byte tokens plus "
            f"{len(added)} added tokens plus some merges; use at least {256 + len(added) + 16}"
        )
    pieces = (piece for text in corpus for piece in _SPLIT_ON_ADDED.split(text) if piece)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=added,  # ids 0..len(added)-1, never merged
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    backend.train_from_iterator(pieces, trainer)
    state = json.loads(backend.to_str())
    for token in state["added_tokens"]:
        token["special"] = token["content"] in SPECIAL_TOKENS  # markup must survive skip_special_tokens
    backend = Tokenizer.from_str(json.dumps(state))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def chat_ids(tokenizer, messages: Sequence[dict], add_generation_prompt: bool) -> list[int]:
    """``apply_chat_template`` token ids as a plain list, whatever transformers returns."""
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True)
    if hasattr(out, "keys"):  # BatchEncoding (transformers >= 5)
        out = out["input_ids"]
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(i) for i in out]


def encode_transcript(tokenizer, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and a mask that is 1 on assistant-generated tokens.

    Assistant content and its closing ``<|im_end|>`` are what the policy generates (and is
    trained on); headers, separators, prompts and tool turns are context (mask 0).
    """
    ids: list[int] = []
    mask: list[int] = []
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    sep = tokenizer.encode(TURN_SEPARATOR, add_special_tokens=False)
    for message in messages:
        header = tokenizer.encode(f"<|im_start|>{message['role']}\n", add_special_tokens=False)
        body = tokenizer.encode(message["content"], add_special_tokens=False) + [eos_id]
        generated = 1 if message["role"] == "assistant" else 0
        ids += header + body + sep
        mask += [0] * len(header) + [generated] * len(body) + [0] * len(sep)
    return ids, mask
