"""The SWE agent loop end to end on one synthetic instance, inside verl's agent-loop API.

The loop is built as verl's AgentLoopWorker builds it (the composed ``cpu_synthetic`` recipe, the
project's tokenizer); the rollout server is a scripted policy replaying fixed assistant turns (the
model is not what is tested). Checked: the gold fix made through the tools scores 1 and a reply
without a tool call scores 0; observations are masked out (response_mask 0, log-prob 0) and every
generation sees exactly the sequence so far; a workspace that cannot start gives reward 0 with its
reason; OPD per-turn teacher scoring publishes one scored turn per action at the tool-call boundaries.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import pytest

from thundersync_verl import verl_adapter as va
from thundersync_verl.algos.opd.turn_teacher import TURN_COUNT_KEY
from thundersync_verl.data.swe_smith import convert
from thundersync_verl.envs.swe import swe_protocol as protocol
from thundersync_verl.envs.swe.swe_agent_loop import SWEAgentLoop
from thundersync_verl.verl_adapter.patches import TEACHER_REUSED_KEY

RECIPES = Path(__file__).resolve().parents[3] / "recipes" / "swe_smith"
LOGPROB = -0.5
ABORT_SEEN_S = 60.0  # a bound only: the abort reaches the loop's watch within one long-poll round trip


class ScriptedPolicy:
    """A rollout server that answers each generate call with the next scripted assistant turn."""

    def __init__(self, tokenizer, replies: list[str], teacher=None):
        self.tokenizer, self.replies, self.prompts, self.outputs = tokenizer, list(replies), [], []
        if teacher is not None:
            self.opd_teacher_clients = {"teacher": teacher}

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        self.prompts.append(list(prompt_ids))
        return self._reply(sampling_params)

    def _reply(self, sampling_params):
        ids = self.tokenizer.encode(self.replies.pop(0) + "<|im_end|>", add_special_tokens=False)[: sampling_params["max_tokens"]]
        self.outputs.append(ids)
        return va.token_output_cls()(token_ids=ids, log_probs=[LOGPROB] * len(ids), stop_reason="completed",
                                     extra_fields={"min_global_steps": 3, "max_global_steps": 3})


class ConstantTeacher:
    """A teacher client that scores every prefix token -0.25 (the shape of verl's prompt_logprobs reply)."""

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        rows = [[-0.25]] * len(prompt_ids)
        return va.token_output_cls()(token_ids=[0], extra_fields={"prompt_logprobs": rows, "prompt_ids": [[t] for t in prompt_ids]})


@pytest.fixture(scope="module")
def tokenizer(tiny_random_lm):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_random_lm)


def _config(synthetic_set, tmp_path, *overrides: str):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    train = synthetic_set["out"] / "train.parquet"
    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        cfg = compose(config_name="cpu_synthetic", overrides=[
            f"data.train_files={train}", f"data.val_files={train}", "actor_rollout_ref.model.path=z", "mode=thundersync",
            f"swe.trace_path={tmp_path / 'trace.jsonl'}", "data.max_response_length=1024", "swe.max_context=null",
            *overrides])  # the test tokenizer spends ~1 token a character: room for four turns
    OmegaConf.resolve(cfg)
    return cfg


async def _run_loop(cfg, policy, tokenizer, row: dict, put=None):
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    loop = SWEAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=policy, tokenizer=tokenizer, processor=None,
                        dataset_cls=RLHFDataset, data_config=DictConfigWrap(cfg.data))
    if put is not None:
        loop.turn_teacher.put = put
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    return await loop.run(sampling, raw_prompt=row["prompt"], extra_info=row["extra_info"], uid="u1", session_id=0,
                          index=0, agent_name=protocol.AGENT_NAME)


def _gold_turns(synthetic_set) -> list[str]:
    inst = synthetic_set["instances"][0]
    bug = synthetic_set["bugs"][inst.instance_id]
    return [protocol.tool_call_text("view_file", path="textkit/core.py", end=4),
            protocol.tool_call_text("edit_file", path="textkit/core.py", old_str=bug.new, new_str=bug.old),
            protocol.tool_call_text("bash", command="python -m pytest -q -p no:cacheprovider tests | tail -1"),
            protocol.tool_call_text("submit")]


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of the response mask."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def test_gold_fix_through_the_tools_scores_one_with_observations_masked(synthetic_set, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the loop's workspace folders land here
    cfg = _config(synthetic_set, tmp_path)
    row = convert([synthetic_set["rows"][0]])[0]
    policy = ScriptedPolicy(tokenizer, _gold_turns(synthetic_set))
    out = asyncio.run(_run_loop(cfg, policy, tokenizer, row))

    assert out.reward_score == 1.0
    info = out.extra_fields["reward_extra_info"]
    assert info["f2p_passed"] == info["f2p_total"] == 1 and info["submitted"] is True and info["turns"] == 4
    assert info["test_s"] > 0 and info["reason"].startswith("resolved")
    runs = _spans(out.response_mask)
    assert [v for v, _, _ in runs] == [1, 0, 1, 0, 1, 0, 1]  # 4 actions, 3 observations, ends on submit
    for k, (value, start, end) in enumerate(runs):
        assert out.response_ids[start:end] == (policy.outputs[k // 2] if value else out.response_ids[start:end])
        assert set(out.response_logprobs[start:end]) == {LOGPROB if value else 0.0}
        if value:  # generation k saw the prompt and everything before its action
            assert policy.prompts[k // 2] == out.prompt_ids + out.response_ids[:start]
    observations = [tokenizer.decode(out.response_ids[s:e]) for v, s, e in runs if v == 0]
    assert all(o.startswith("\n<|im_start|>tool\n<tool_response>") for o in observations)
    assert '"_".join(words)' in observations[0] and "edited textkit/core.py" in observations[1] and "6 passed" in observations[2]
    trace = json.loads((tmp_path / "trace.jsonl").read_text().splitlines()[-1])
    assert trace["instance_id"] == synthetic_set["instances"][0].instance_id and trace["score"] == 1.0
    assert trace["sandbox"] == "local" and trace["sandbox_start_s"] > 0 and len(trace["turns"]) == 4
    assert out.extra_fields["min_global_steps"] == 3 and out.num_turns == 9
    assert not list(tmp_path.glob("tsv-swe-*"))  # the workspace was removed


def test_a_reply_without_a_tool_call_ends_the_loop_and_scores_zero(synthetic_set, tokenizer, tmp_path):
    cfg = _config(synthetic_set, tmp_path)
    row = convert([synthetic_set["rows"][1]])[0]
    out = asyncio.run(_run_loop(cfg, ScriptedPolicy(tokenizer, ["I think it is fine."]), tokenizer, row))
    assert out.reward_score == 0.0 and set(out.response_mask) == {1}
    info = out.extra_fields["reward_extra_info"]
    assert info["reason"].startswith("unresolved: FAIL_TO_PASS 0/1") and info["submitted"] is False and info["turns"] == 1


def test_a_workspace_that_cannot_start_scores_zero_without_losing_the_row(synthetic_set, tokenizer, tmp_path):
    cfg = _config(synthetic_set, tmp_path, f"swe.repos_dir={tmp_path / 'empty'}")
    row = convert([synthetic_set["rows"][0]])[0]
    policy = ScriptedPolicy(tokenizer, [protocol.tool_call_text("bash", command="ls"), protocol.tool_call_text("submit")])
    out = asyncio.run(_run_loop(cfg, policy, tokenizer, row))
    assert out.reward_score == 0.0
    assert out.extra_fields["reward_extra_info"]["reason"].startswith("workspace failed to start: WorkspaceError: no repository")
    assert "the workspace is unavailable" in tokenizer.decode(out.response_ids)


def test_max_turns_and_context_bound_the_trajectory(synthetic_set, tokenizer, tmp_path):
    cfg = _config(synthetic_set, tmp_path, "swe.max_turns=2")
    row = convert([synthetic_set["rows"][0]])[0]
    ls = protocol.tool_call_text("bash", command="ls")
    policy = ScriptedPolicy(tokenizer, [ls] * 5)
    out = asyncio.run(_run_loop(cfg, policy, tokenizer, row))
    assert out.extra_fields["reward_extra_info"]["turns"] == 2 and [v for v, _, _ in _spans(out.response_mask)] == [1, 0, 1]
    room = len(out.prompt_ids) + len(policy.outputs[0]) + 5  # one action fits, its observation does not
    out = asyncio.run(_run_loop(_config(synthetic_set, tmp_path, f"swe.max_context={room}"),
                                ScriptedPolicy(tokenizer, [ls] * 5), tokenizer, row))
    assert out.extra_fields["reward_extra_info"]["turns"] == 1 and set(out.response_mask) == {1}
    assert len(out.prompt_ids) + len(out.response_ids) <= room


def test_opd_scores_each_turn_at_its_tool_call_boundary(synthetic_set, tokenizer, tmp_path):
    cfg = _config(synthetic_set, tmp_path)
    row = convert([synthetic_set["rows"][0]])[0]
    published = []

    async def put(key, fields, tag):
        published.append((key, fields, tag))

    policy = ScriptedPolicy(tokenizer, _gold_turns(synthetic_set), teacher=ConstantTeacher())
    out = asyncio.run(_run_loop(cfg, policy, tokenizer, row, put=put))
    starts = [s for v, s, _ in _spans(out.response_mask) if v == 1]
    assert out.reward_score == 1.0 and out.extra_fields[TURN_COUNT_KEY] == 4 == len(published)
    by_turn = sorted(published, key=lambda p: p[2]["turn"])
    assert [p[0] for p in by_turn] == [f"u1_0_0_t{j}" for j in range(4)]
    assert [p[2]["action_start"] for p in by_turn] == starts
    for (_, fields, tag), start, action in zip(by_turn, starts, policy.outputs):
        assert tag["status"] == "success" and tag["prompt_len"] == len(out.prompt_ids)
        assert fields["prefix_ids"].tolist() == out.prompt_ids + out.response_ids[: start + len(action)]
        assert fields["teacher_log_probs"].tolist() == [-0.25] * len(action)
    assert out.extra_fields[TEACHER_REUSED_KEY] is True  # ended on an action: the last turn's reply is the whole one


class AbortingPolicy(ScriptedPolicy):
    """The trainer aborts the group while its first turn is generated (tail batching's places filled meanwhile).

    The call stays on the server until the abort reaches the agent loop's process (``abort_signal``, a server's
    view of the registry), as a long generation would: answering as soon as the registry took the abort would race
    the loop's watch against the loop's next call (seen in CI both ways: the call cut before it was recorded, and a
    second call made before the watch had heard)."""

    def __init__(self, tokenizer, replies, registry):
        super().__init__(tokenizer, replies)
        self.registry = registry

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from thundersync_verl.envs.abort import abort_signal

        self.prompts.append(list(prompt_ids))
        async with abort_signal("u1") as stop:
            await self.registry.add.remote(["u1"])
            await asyncio.wait_for(stop, ABORT_SEEN_S)  # the loop cancels this call once its watch has the abort
        return self._reply(sampling_params)


def test_an_aborted_group_makes_no_next_generate_call_and_verl_logs_no_error_for_it(synthetic_set, tokenizer, tmp_path,
                                                                                    monkeypatch, caplog):
    import logging

    from thundersync_harness.engine_setup import ray_session
    from thundersync_verl.envs.abort import GroupAborted, start_registry

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = _config(synthetic_set, tmp_path, "thundersync.tail.eta=1.5")
    row = convert([synthetic_set["rows"][0]])[0]
    with ray_session() as ray_tmp:
        import ray

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=ray_tmp)
        policy = AbortingPolicy(tokenizer, _gold_turns(synthetic_set), start_registry())
        with pytest.raises(GroupAborted, match="prompt u1: aborted by thundersync.tail"):
            asyncio.run(_run_loop(cfg, policy, tokenizer, row))
    assert len(policy.prompts) == 1  # the first turn's call was already on the server; a tool call, if one started, was cut
    assert not (tmp_path / "trace.jsonl").exists()  # no trajectory finished
    session_log = logging.getLogger(va.agent_loop_session_loggers()[0])
    caplog.clear()
    with caplog.at_level(logging.ERROR):  # verl's worker reports each failed session; an aborted one is dropped
        try:
            raise GroupAborted("prompt u1: aborted")
        except GroupAborted as exc:
            session_log.error("Error in _run_prompt for uid=u1", exc_info=(type(exc), exc, exc.__traceback__))
        session_log.error("Error in _run_prompt for uid=u2")  # any other record passes
    assert [r.getMessage() for r in caplog.records if r.name == session_log.name] == ["Error in _run_prompt for uid=u2"]
