"""verl_adapter.patches.reward_in_agent_loop: verl's own reward worker class, run in the calling process.

The stand-in is what ``AgentLoopWorker._compute_score`` awaits in place of a ``RewardLoopWorker``
actor call; here it scores DataProtos built the way that method builds them, with the recipe's
reward function (the task's real verifier, in its sandbox). The full path (verl's agent-loop worker
under ``main_ppo``, the pid of each reward call) is ``tests/e2e/test_reward_in_agent_loop_main_ppo_on_cpu.py``.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch


def _recipe(model, *overrides):
    from hydra import compose, initialize_config_dir

    from thundersync_verl.demo import recipe_dir

    base = ["data.train_files=x", "data.val_files=y", f"actor_rollout_ref.model.path={model}", "mode=thundersync"]
    with initialize_config_dir(config_dir=str(recipe_dir()), version_base=None):
        return compose(config_name="grpo", overrides=base + list(overrides))


def _trajectory(tokenizer, text: str, ground_truth: str):
    """One finished trajectory as ``AgentLoopWorker._compute_score`` hands it to a reward worker."""
    from verl import DataProto

    prompt = torch.tensor(tokenizer.encode("<|im_start|>user\nwhat is 5+7?<|im_end|>\n", add_special_tokens=False))
    response = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
    input_ids = torch.cat([prompt, response])
    batch = {"prompts": prompt[None], "responses": response[None], "input_ids": input_ids[None],
             "attention_mask": torch.ones_like(input_ids)[None], "position_ids": torch.arange(len(input_ids))[None]}
    non_tensor = {"data_source": np.array(["thundersync_arith"]), "reward_model": np.array([{"ground_truth": ground_truth}]),
                  "extra_info": np.array([{"index": 0}]), "__num_turns__": np.array([3]),
                  "tool_extra_fields": np.array([{}], dtype=object)}
    return DataProto.from_dict(tensors=batch, non_tensors=non_tensor)


def test_the_in_process_worker_scores_with_the_recipes_verifier_and_is_built_once(tiny_random_lm):
    from transformers import AutoTokenizer

    from thundersync_verl.envs import protocol
    from thundersync_verl.verl_adapter.patches import InProcessRewardWorker, reward_in_agent_loop

    config = _recipe(tiny_random_lm, "thundersync.reward_in_agent_loop=true")
    assert reward_in_agent_loop(config)
    tokenizer = AutoTokenizer.from_pretrained(tiny_random_lm)
    local = InProcessRewardWorker(config)

    async def score_three():
        right = local.compute_score.remote(_trajectory(tokenizer, protocol.answer_text(12), "12"))
        wrong = local.compute_score.remote(_trajectory(tokenizer, protocol.answer_text(13), "12"))
        both = await asyncio.gather(right, wrong)
        worker = local.worker
        await local.compute_score.remote(_trajectory(tokenizer, protocol.answer_text(12), "12"))
        return both, worker is local.worker

    (right, wrong), same_worker = asyncio.run(score_three())
    assert right["reward_score"] == 1.0 and right["reward_extra_info"]["reason"] == "correct"
    assert wrong["reward_score"] == 0.0 and wrong["reward_extra_info"]["reason"] == "wrong answer"
    assert right["reward_extra_info"]["verifier_s"] > 0  # the sandboxed check program really ran
    assert same_worker and local.calls == 3  # one verl RewardLoopWorker per event loop
    first = local.worker
    again = asyncio.run(local.compute_score.remote(_trajectory(tokenizer, protocol.answer_text(12), "12")))
    assert again["reward_score"] == 1.0 and local.worker is not first  # a new loop: a worker bound to it


def test_the_key_is_off_by_default_and_refused_with_a_reward_model(tiny_random_lm):
    from thundersync_verl.core.errors import StreamingConfigError
    from thundersync_verl.verl_adapter.patches import reward_in_agent_loop

    assert not reward_in_agent_loop(_recipe(tiny_random_lm))
    with pytest.raises(StreamingConfigError, match="reward_in_agent_loop") as info:
        reward_in_agent_loop(_recipe(tiny_random_lm, "thundersync.reward_in_agent_loop=true",
                                     "reward.reward_model.enable=true"))
    assert "reward.reward_model.enable=true" in str(info.value) and "fix:" in str(info.value)
    with pytest.raises(StreamingConfigError, match="reward_in_agent_loop"):
        reward_in_agent_loop(_recipe(tiny_random_lm, "thundersync.reward_in_agent_loop=maybe"))


def test_the_patch_is_installed_on_verls_agent_loop_worker():
    from thundersync_verl.verl_adapter.patches import APPLIED, patch_reward_in_agent_loop

    patch_reward_in_agent_loop()
    from verl.experimental.agent_loop import agent_loop

    assert getattr(agent_loop.AgentLoopWorker.__init__, "_thundersync_patched", False)
    assert "reward_in_agent_loop" in APPLIED
