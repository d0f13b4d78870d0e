"""The agent loop's side of per-turn OPD (``algos/opd/turn_teacher.py``), without Ray: the ``hf_cpu`` teacher's prompt
log-probs equal an HF forward; a turn is scored on its prefix and retried; a teacher that keeps failing publishes a
failure record and raises; turns that finish while their trajectory's call is in flight share the next call; a
cancelled turn is not published.

GPUs needed: 0 (CPU only). Tiny random Qwen2 models built in the test.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

def _tiny_model(seed: int, layers: int = 2, vocab: int = 64):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def test_hf_cpu_teacher_prompt_logprobs_match_an_hf_forward():
    from thundersync_verl.backends.cpu.rollout import prompt_logprob_fields
    from thundersync_harness.teacher import HFTeacherScorer

    model, ids = _tiny_model(1), [5, 9, 17, 3, 40, 22, 8]
    reply = prompt_logprob_fields(model, ids, 0)
    assert len(reply["prompt_logprobs"]) == len(reply["prompt_ids"]) == len(ids)
    assert [r[0] for r in reply["prompt_ids"][:-1]] == ids[1:] and reply["prompt_logprobs"][-1] == [0.0]
    expected = HFTeacherScorer(model).score(ids, (1, len(ids)))  # [len - 1], token p given tokens < p
    got = torch.tensor([r[0] for r in reply["prompt_logprobs"][:-1]])
    assert torch.allclose(got, expected, atol=1e-6)
    top = prompt_logprob_fields(model, ids, 3)
    assert all(len(r) == 3 and r[0] >= r[1] >= r[2] for r in top["prompt_logprobs"][:-1])


class _FakeTeacher:
    """verl's teacher client surface: ``generate`` returning extra_fields['prompt_logprobs']."""

    def __init__(self, model, fail_first: int = 0, hang: bool = False):
        self.model, self.fail_first, self.hang, self.calls = model, fail_first, hang, []

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        from types import SimpleNamespace

        from thundersync_verl.backends.cpu.rollout import prompt_logprob_fields

        self.calls.append((list(prompt_ids), dict(sampling_params)))
        if self.hang:
            await asyncio.sleep(60)
        if len(self.calls) <= self.fail_first:
            raise ConnectionError("teacher server restarting")
        return SimpleNamespace(extra_fields=prompt_logprob_fields(self.model, list(prompt_ids), sampling_params["prompt_logprobs"]))


def _publisher(client, **policy):
    from thundersync_verl.algos.opd.turn_teacher import AgentTurnTeacher
    from thundersync_verl.algos.opd.turn_teacher import TeacherRetryPolicy

    puts = []

    async def put(key, fields, tag):
        puts.append((key, fields, tag))

    async def no_sleep(_s):
        return None

    return AgentTurnTeacher(client, TeacherRetryPolicy(**policy), put=put, sleep=no_sleep), puts


def test_turn_is_scored_on_its_prefix_and_published_after_a_retry():
    from thundersync_harness.teacher import HFTeacherScorer

    model = _tiny_model(2)
    teacher, puts = _publisher(_FakeTeacher(model, fail_first=1), max_attempts=2)
    prompt, response = [4, 7, 11], [20, 21, 30, 31, 32, 40, 41]  # turn 1's action: response[5:]
    asyncio.run(teacher.score_and_publish("u_0_0", 1, prompt, response, 5))
    (key, fields, tag), = puts
    assert key == "u_0_0_t1" and tag["status"] == "success" and tag["attempts"] == 2
    assert tag["prompt_len"] == 3 and tag["action_start"] == 5 and fields["prefix_ids"].tolist() == prompt + response
    whole = HFTeacherScorer(model).score(prompt + response, (8, 10))  # the action's 2 tokens
    assert torch.allclose(fields["teacher_log_probs"], whole, atol=1e-6)
    assert teacher.client.calls[-1][1]["prompt_logprobs"] == 0 and teacher.client.calls[-1][1]["temperature"] == 1.0


class _GatedTeacher(_FakeTeacher):
    """Each call answers only once the test opens its gate (``gates[k]`` for the k-th call): no timing in the test."""

    def __init__(self, model, fail_first: int = 0):
        super().__init__(model, fail_first=fail_first)
        self.gates: list[asyncio.Event] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)


async def _until(condition) -> None:
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the teacher was never called as expected")


PROMPT3, RESPONSE9 = [4, 7, 11], [20, 21, 30, 31, 22, 23, 32, 24, 25]  # actions [0,2) [4,6) [7,9), observations between
TURNS3 = [(0, 2, 0), (1, 6, 4), (2, 9, 7)]  # (turn, end, action start)


async def _three_turns(teacher, client) -> list:
    """The agent loop's three turns of one trajectory: turn 0's call starts, then turns 1 and 2 finish while it is
    in flight (unanswered: its gate is closed)."""
    tasks = [asyncio.create_task(teacher.score_and_publish("u_0_0", 0, PROMPT3, RESPONSE9[:2], 0))]
    await _until(lambda: len(client.gates) == 1)
    return tasks + [asyncio.create_task(teacher.score_and_publish("u_0_0", j, PROMPT3, RESPONSE9[:end], start))
                    for j, end, start in TURNS3[1:]]


@pytest.mark.parametrize("fails", [False, True], ids=["scored", "teacher_down"])
def test_turns_that_finish_while_their_trajectorys_call_is_in_flight_share_the_next_call(fails):
    from thundersync_harness.teacher import HFTeacherScorer
    from thundersync_verl.algos.opd.turn_teacher import TeacherScoringError

    model = _tiny_model(4)
    client = _GatedTeacher(model, fail_first=99 if fails else 0)
    teacher, puts = _publisher(client, max_attempts=1)

    async def loop():
        tasks = await _three_turns(teacher, client)
        await asyncio.sleep(0)
        client.gates[0].set()
        await _until(lambda: len(client.gates) == 2)
        client.gates[1].set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(loop())
    assert [call[0] for call in client.calls] == [PROMPT3 + RESPONSE9[:2], PROMPT3 + RESPONSE9]  # 2 calls, 3 turns
    assert sorted(key for key, _, _ in puts) == ["u_0_0_t0", "u_0_0_t1", "u_0_0_t2"]
    assert not teacher._lanes  # nothing kept once every turn is answered
    if fails:  # every turn a failed call carried fails as itself: a record each, raised in each turn's task
        assert all(isinstance(r, TeacherScoringError) for r in results)
        assert all(tag["status"] == "failure" and fields is None for _, fields, tag in puts)
        return
    assert results == [None] * 3
    scorer = HFTeacherScorer(model)
    for key, fields, tag in puts:
        j = int(key[-1])
        _, end, start = TURNS3[j]
        assert fields["prefix_ids"].tolist() == PROMPT3 + RESPONSE9[:end] and tag["action_start"] == start
        assert tag["turns_per_call"] == (1 if j == 0 else 2)
        whole = scorer.score(PROMPT3 + RESPONSE9[:end], (len(PROMPT3) + start, len(PROMPT3) + end))  # its own prefix
        assert torch.allclose(fields["teacher_log_probs"], whole, atol=1e-6)


def test_a_cancelled_turn_is_not_published_and_the_turns_its_call_carried_are_scored_next():
    client = _GatedTeacher(_tiny_model(4))
    teacher, puts = _publisher(client, max_attempts=1)

    async def loop():
        tasks = await _three_turns(teacher, client)
        await asyncio.sleep(0)
        client.gates[0].set()
        await _until(lambda: len(client.gates) == 2)  # turn 1's task asked for turns 1 and 2 in one call
        tasks[1].cancel()  # and its agent loop gave up before the teacher answered
        await _until(lambda: len(client.gates) == 3)  # turn 2 goes back to waiting and is asked for alone
        client.gates[2].set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(loop())
    assert results[0] is None and isinstance(results[1], asyncio.CancelledError) and results[2] is None
    assert [key for key, _, _ in puts] == ["u_0_0_t0", "u_0_0_t2"]  # the cancelled turn is not published
    assert [call[0] for call in client.calls] == [PROMPT3 + RESPONSE9[:2], PROMPT3 + RESPONSE9]  # answered calls
    assert not teacher._lanes


def test_agent_loop_scores_turns_only_when_the_rollout_client_carries_one_teacher():
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from thundersync_verl.core import StreamingConfigError
    from thundersync_verl.algos.opd.turn_teacher import AgentTurnTeacher, attach_teacher_clients

    config = OmegaConf.create({"thundersync": {"opd": {"teacher_max_attempts": 2, "teacher_timeout_s": 5}}})
    assert AgentTurnTeacher.for_agent_loop(config, SimpleNamespace()) is None  # GRPO and verl's own modes
    teacher = AgentTurnTeacher.for_agent_loop(config, attach_teacher_clients(SimpleNamespace(), {"default": "client"}))
    assert teacher.client == "client" and teacher.policy.max_attempts == 2 and teacher.policy.timeout_s == 5.0
    with pytest.raises(StreamingConfigError, match="exactly one teacher"):
        AgentTurnTeacher.for_agent_loop(config, attach_teacher_clients(SimpleNamespace(), {"a": 1, "b": 2}))


@pytest.mark.parametrize("hang", [False, True])
def test_failing_teacher_publishes_a_failure_and_raises(hang):
    from thundersync_verl.algos.opd.turn_teacher import TURN_PARTITION
    from thundersync_verl.algos.opd.opd_trainer_step import TurnSource
    from thundersync_verl.algos.opd.turn_teacher import TeacherScoringError

    teacher, puts = _publisher(_FakeTeacher(_tiny_model(3), fail_first=99, hang=hang), max_attempts=3, timeout_s=0.05)
    with pytest.raises(TeacherScoringError, match="turn 0 of trajectory u_1_0 after 3 attempt"):
        asyncio.run(teacher.score_and_publish("u_1_0", 0, [1, 2], [3, 4], 0))
    assert len(teacher.client.calls) == 3
    (key, fields, tag), = puts
    assert key == "u_1_0_t0" and fields is None and tag["status"] == "failure"
    assert ("no reply within teacher_timeout_s=0.05" if hang else "ConnectionError") in tag["error"]
    listing = {"v_0_0_t0": {"traj": "v_0_0", "status": "failure"}, key: tag}
    source = TurnSource(lambda part: {TURN_PARTITION: listing}, None, {"u_1_0"})
    with pytest.raises(TeacherScoringError, match="optimizer step of this batch was NOT taken"):
        source.poll()
    assert "v_0_0_t0" in source.foreign  # another batch's (or validation's) turn is not this batch's failure


@pytest.mark.parametrize("with_rollout_lp", [True, False])
def test_turn_source_reads_a_batch_of_turns_from_jagged_fields(with_rollout_lp):
    # The TransferQueue hands per-token fields back as jagged nested tensors, split in one pass per field.
    from thundersync_verl.algos.opd.opd_trainer_step import TurnSource

    def jagged(rows, dtype):
        return torch.nested.nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)

    listing = {"u_0_0_t1": {"traj": "u_0_0", "turn": 1, "status": "success", "prompt_len": 2, "action_start": 3,
                            "rollout_lp": with_rollout_lp},
               "u_0_0_t0": {"traj": "u_0_0", "turn": 0, "status": "success", "prompt_len": 2, "action_start": 0,
                            "rollout_lp": True},
               "u_0_0_t2": None}  # listed before its tag is written: read at a later poll
    asked = []

    def batch_get(keys, partition_id, select_fields):
        asked.append((keys, select_fields))
        prefixes = {"u_0_0_t1": [4, 7, 20, 21, 9, 22], "u_0_0_t0": [4, 7, 20, 21]}
        teacher = {"u_0_0_t1": [-0.5, -0.25], "u_0_0_t0": [-1.0, -2.0]}
        out = {"prefix_ids": jagged([prefixes[k] for k in keys], torch.long),
               "teacher_log_probs": jagged([teacher[k] for k in keys], torch.float32)}
        if "rollout_log_probs" in select_fields:
            out["rollout_log_probs"] = jagged([[x - 0.5 for x in teacher[k]] for k in keys], torch.float32)
        return out

    source = TurnSource(lambda part: {part: listing}, batch_get, {"u_0_0"})
    turns = {turn.turn: turn for turn, _ in source.poll()}
    (keys, fields), = asked
    assert keys == ["u_0_0_t1", "u_0_0_t0"] and ("rollout_log_probs" in fields) == with_rollout_lp
    assert (turns[1].prompt, turns[1].response, turns[1].action_start) == ((4, 7), (20, 21, 9, 22), 3)
    assert turns[1].teacher_log_probs == (-0.5, -0.25) and turns[0].response == (20, 21)
    assert turns[1].rollout_log_probs == ((-1.0, -0.75) if with_rollout_lp else ())
    assert source.poll() == [] and len(asked) == 1  # nothing new: no read


def test_a_failed_agent_loop_drops_the_teacher_reply_it_kept():
    # The last scored turn's reply is kept for verl's whole-trajectory question, which a failed loop never asks.
    from thundersync_verl.config import EnvConfig
    from thundersync_verl.envs.abort import AbortCheck
    from thundersync_verl.envs.agent_loop import ThunderSyncToolAgentLoop

    model = _tiny_model(2)
    teacher, _ = _publisher(_FakeTeacher(model), max_attempts=1)
    asyncio.run(teacher.score_and_publish("u_0_0", 0, [4, 7], [20, 21], 0))  # turn 0 of trajectory uid u, sample 0
    assert list(teacher.replies) == ["u_0_0"]

    class _DeadServer:
        async def generate(self, **_):
            raise ConnectionError("rollout server gone")

    async def _tokens(_messages):
        return [4, 7]

    loop = object.__new__(ThunderSyncToolAgentLoop)  # verl's base needs a live worker; the run needs none of it
    loop.settings, loop.response_length = EnvConfig(), 16
    loop.latency = loop.settings.tool_latency
    loop.turn_teacher, loop.server_manager, loop.ct_build_initial_tokens = teacher, _DeadServer(), _tokens
    loop.abort = AbortCheck(enabled=False)  # no tail batching
    with pytest.raises(ConnectionError):
        asyncio.run(loop.run({}, raw_prompt=[], uid="u", session_id=0))
    assert teacher.replies == {}
