"""verl_patches.reuse_turn_teacher_scores on verl's real AgentLoopWorker method."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def worker_cls():
    from thundersync_verl.verl_adapter.patches import patch_reuse_turn_teacher_scores

    patch_reuse_turn_teacher_scores()
    from verl.experimental.agent_loop import agent_loop

    assert getattr(agent_loop.AgentLoopWorker._compute_teacher_logprobs, "_thundersync_patched", False)
    return agent_loop.AgentLoopWorker


class _Teacher:
    def __init__(self):
        self.calls = 0

    async def compute_teacher_logprobs_single(self, sequence_ids, **kwargs):
        self.calls += 1
        return "ids-from-verl", "logprobs-from-verl"


def _call(worker_cls, fields: dict, validate: bool = False):
    teacher = _Teacher()
    me = SimpleNamespace(distillation_enabled=True, teacher_key="k", teacher_server_manager=teacher)
    output = SimpleNamespace(extra_fields=dict(fields), multi_modal_data=None, mm_processor_kwargs=None)
    asyncio.run(worker_cls._compute_teacher_logprobs(me, output, prompt_ids=[1, 2], response_ids=[3], validate=validate,
                                                     sample_kwargs={}))
    return teacher.calls, output.extra_fields


def test_a_flagged_reply_replaces_verls_call(worker_cls):
    from thundersync_verl.verl_adapter.patches import TEACHER_REUSED_KEY

    calls, fields = _call(worker_cls, {TEACHER_REUSED_KEY: True, "teacher_ids": "ours", "teacher_logprobs": "ours"})
    assert calls == 0 and fields == {"teacher_ids": "ours", "teacher_logprobs": "ours"}


def test_unflagged_incomplete_or_validation_outputs_go_through_verl(worker_cls):
    from thundersync_verl.verl_adapter.patches import TEACHER_REUSED_KEY

    calls, fields = _call(worker_cls, {})
    assert calls == 1 and fields["teacher_logprobs"] == "logprobs-from-verl"
    calls, fields = _call(worker_cls, {TEACHER_REUSED_KEY: True, "teacher_ids": "ours"})  # half a reply: verl's
    assert calls == 1 and fields["teacher_ids"] == "ids-from-verl" and TEACHER_REUSED_KEY not in fields
    calls, fields = _call(worker_cls, {TEACHER_REUSED_KEY: True, "teacher_ids": "ours", "teacher_logprobs": "ours"},
                          validate=True)
    assert calls == 0 and "teacher_ids" not in fields  # validation: verl scores nothing, ours is dropped


def test_replay_buffer_rows_follow_the_prompts_then_the_responses_whatever_their_arrival():
    # point 10 of verl_adapter.patches: two Sync runs on one recording get one batch order (the e2e reward test
    # checks the consequence: their updates are bitwise equal)
    from verl.trainer.ppo.v1 import replay_buffer

    from thundersync_verl.verl_adapter.patches import batch_key_order

    assert getattr(replay_buffer.ReplayBuffer._materialize_batch, "_thundersync_patched", False)
    prompts = {"p": 0, "q": 1}  # the order the trainer submitted them
    arrived = ["q_1_0", "p_1_0", "q_0_0", "p_0_0"]
    responses = {"q_1_0": (5,), "p_1_0": (2, 9), "q_0_0": (7,), "p_0_0": (3,)}  # which session got which answer
    order = batch_key_order(arrived, prompts, [responses[k] for k in arrived])
    assert [arrived[i] for i in order] == ["p_1_0", "p_0_0", "q_1_0", "q_0_0"]
    again = list(reversed(arrived))  # another arrival order, the same rows
    assert [again[i] for i in batch_key_order(again, prompts, [responses[k] for k in again])] == \
        [arrived[i] for i in order]
