"""Synthesised recordings: a scripted agent of a published shape, served back by rollout ``replay`` (CPU, no GPU)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from thundersync_verl.backends.replay.server import ReplayServer
from thundersync_verl.backends.replay.synthesize import SHAPES
from thundersync_verl.envs import protocol

QUESTIONS = ["3+4*5", "12*3-5"]
N = 4


def _config(**replay):
    return SimpleNamespace(dtype="float32", max_model_len=2048, prompt_length=48, response_length=1400,
                           engine_kwargs={"replay": replay})


def _prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>system\n{protocol.SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
                            f"Compute `{question}`.<|im_end|>\n<|im_start|>assistant\n")


async def _agent(server, tokenizer, prompt: list[int], budget: int = 1400) -> list[dict]:
    """The agent loop's token assembly: answer -> tool output appended -> next turn, until a final answer."""
    response, turns = [], []
    while True:
        out = await server.generate(prompt + response, {"temperature": 1.0, "max_tokens": budget - len(response)},
                                    request_id="r")
        turns.append({"ids": out.token_ids, "lps": out.log_probs, "context": len(prompt) + len(response)})
        response += out.token_ids
        call = protocol.parse_tool_call(tokenizer.decode(out.token_ids, skip_special_tokens=False))
        if call is None:
            return turns
        assert isinstance(call, protocol.ToolCall)
        value = str(eval(call.code.split("#")[0][len("print("):-1], {"__builtins__": {}}))  # what the sandbox prints
        response += tokenizer.encode(f"\n<|im_start|>tool\n{protocol.tool_response_text(value)}<|im_end|>\n"
                                     "<|im_start|>assistant\n", add_special_tokens=False)


async def _batch(server, tokenizer) -> list[list[dict]]:
    return await asyncio.gather(*[_agent(server, tokenizer, _prompt(tokenizer, q)) for q in QUESTIONS for _ in range(N)])


@pytest.fixture(scope="module")
def synthesised(tiny_random_lm, tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("synth") / "paper.jsonl"
    server = ReplayServer(_config(path=str(path), synthesize="paper"), SimpleNamespace(local_path=str(tiny_random_lm)))
    tokenizer = AutoTokenizer.from_pretrained(tiny_random_lm)
    return SimpleNamespace(path=path, tokenizer=tokenizer, trajectories=asyncio.run(_batch(server, tokenizer)),
                           model_path=tiny_random_lm)


def test_trajectories_have_the_shape_turns_tools_and_a_final_answer(synthesised):
    shape, tok = SHAPES["paper"], synthesised.tokenizer
    turns = [len(t) for t in synthesised.trajectories]
    assert all(shape.min_turns <= n <= shape.max_turns for n in turns) and len(set(turns)) > 1
    truth = {"3+4*5": "23", "12*3-5": "31"}
    correct = []
    for q, traj in zip([q for q in QUESTIONS for _ in range(N)], synthesised.trajectories):
        *calls, last = traj
        for turn in calls:  # padded to the drawn token count (at least the bare call)
            assert len(turn["ids"]) >= 20 and turn["ids"][-1] == tok.eos_token_id
        answer = protocol.parse_answer(tok.decode(last["ids"], skip_special_tokens=True))
        assert answer in (truth[q], str(int(truth[q]) + 1))
        correct.append(answer == truth[q])
    assert set(correct) == {True, False}  # GRPO groups get different rewards


def test_log_probs_are_the_policy_models_and_every_call_is_recorded_with_a_service_time(synthesised):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(synthesised.model_path, dtype="float32").eval()
    records = [json.loads(x) for x in synthesised.path.read_text().splitlines()][1:]
    assert len(records) == sum(len(t) for t in synthesised.trajectories)
    rec = records[-1]
    ids = torch.tensor([rec["prompt_ids"] + rec["response_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(rec["prompt_ids"]) - 1 : -1]
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(rec["response_ids"])[:, None])[:, 0]
    assert rec["log_probs"] == pytest.approx(want.tolist(), abs=1e-5)
    shape = SHAPES["paper"]
    for r in records:
        assert r["end_s"] - r["start_s"] >= shape.decode_s_per_token * len(r["response_ids"]) - 1e-9


def test_replaying_the_synthesised_file_gives_the_same_trajectories(synthesised):
    server = ReplayServer(_config(path=str(synthesised.path), time_scale=0))
    again = asyncio.run(_batch(server, synthesised.tokenizer))
    key = lambda trajs: sorted(tuple(tuple(t["ids"]) for t in traj) for traj in trajs)  # noqa: E731
    assert key(again) == key(synthesised.trajectories)


def test_synthesis_refuses_an_existing_file_and_an_unknown_shape(synthesised, tmp_path):
    with pytest.raises(ValueError, match="new path"):
        ReplayServer(_config(path=str(synthesised.path), synthesize="paper"), SimpleNamespace(local_path="x"))
    with pytest.raises(ValueError, match="known"):
        ReplayServer(_config(path=str(tmp_path / "n.jsonl"), synthesize="nope"),
                     SimpleNamespace(local_path=str(synthesised.model_path)))
