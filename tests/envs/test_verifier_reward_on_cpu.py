"""The verifier scores in a subprocess and turns every failure into score 0 with a reason;
the reward function returns what verl's reward managers expect. CPU only."""

from __future__ import annotations

import asyncio
import inspect
import logging

import pytest

from thundersync_verl.envs import reward
from thundersync_verl.envs.verifier import verify, verify_async

NO_LATENCY = {"kind": "constant", "median_s": 0.0}


@pytest.mark.parametrize(
    ("response", "score", "reason"),
    [
        ("<answer>127</answer>", 1.0, "correct"),
        ("tool\n127\nassistant\n<answer> 127.0 </answer>", 1.0, "correct"),
        ("<answer>5</answer> changed my mind <answer>127</answer>", 1.0, "correct"),
        ("<answer>126</answer>", 0.0, "wrong answer"),
        ("<answer>one hundred</answer>", 0.0, "answer is not an integer"),
        ("<answer>inf</answer>", 0.0, "answer is not an integer"),
        ("127", 0.0, "no answer tag"),
    ],
)
def test_verdicts(response, score, reason):
    result = verify(response, "127")
    assert (result.score, result.reason) == (score, reason)
    assert result.duration_s > 0


@pytest.mark.parametrize(
    ("program", "expected"),
    [
        ("import sys\nsys.exit(3)", "verifier nonzero_exit"),
        ("raise RuntimeError('checker bug')", "RuntimeError: checker bug"),
        ("print('not json')", "verifier output unreadable"),
        ("print('{\"score\": 7}')", "outside [0, 1]"),
        ("x = bytearray(1 << 30)", "verifier memory_limit"),
    ],
)
def test_crashing_verifier_scores_zero_with_reason(program, expected, caplog):
    with caplog.at_level(logging.WARNING):
        result = verify("<answer>127</answer>", "127", program=program)
    assert result.score == 0.0 and expected in result.reason
    assert any("scoring 0.0" in record.message for record in caplog.records)


def test_hanging_verifier_is_cut_at_the_timeout():
    result = verify("<answer>127</answer>", "127", program="while True:\n    pass", timeout_s=0.5)
    assert result.score == 0.0 and result.reason.startswith("verifier timeout")
    assert result.duration_s < 10.0


def test_async_verifier_matches_and_overlaps(latency_sleeps):
    async def many():
        jobs = [verify_async(f"<answer>{i}</answer>", "3", extra_latency_s=0.4) for i in range(6)]
        return await asyncio.gather(*jobs)

    latency_sleeps.delay = 0.4
    results = asyncio.run(many())
    assert [r.score for r in results] == [0, 0, 0, 1, 0, 0]
    assert latency_sleeps.count == 6 and latency_sleeps.most == 6  # the six latencies were awaited at once


def test_compute_score_returns_verl_reward_dict():
    out = reward.compute_score("thundersync_arith", "<answer>12</answer>", "12", {"index": 3, "verifier_latency": NO_LATENCY})
    assert set(out) == {"score", "acc", "reason", "pred", "verifier_s"}
    assert out["score"] == 1.0 and out["acc"] == 1.0 and out["pred"] == "12" and out["reason"] == "correct"
    wrong = reward.compute_score("thundersync_arith", "no tag at all", "12", {"verifier_latency": NO_LATENCY})
    assert set(wrong) == set(out)  # verl takes the key list from the first sample
    assert wrong["score"] == 0.0 and wrong["pred"] == "" and wrong["reason"] == "no answer tag"


def test_compute_score_async_is_a_coroutine_function_with_same_result():
    assert inspect.iscoroutinefunction(reward.compute_score_async)  # verl awaits it instead of using a thread
    assert not inspect.iscoroutinefunction(reward.compute_score)
    out = asyncio.run(reward.compute_score_async("d", "<answer>7</answer>", "7", None, verifier_latency=NO_LATENCY))
    assert out["score"] == 1.0


def test_verifier_latency_comes_from_extra_info_then_kwargs(latency_sleeps):
    slow = {"kind": "constant", "median_s": 0.4}
    latency_sleeps.delay = 0.4
    out = reward.compute_score("d", "<answer>7</answer>", "7", {"verifier_latency": slow}, verifier_latency=NO_LATENCY)
    assert out["verifier_s"] >= 0.4 and latency_sleeps.count == 1  # extra_info wins over reward_kwargs
    out = reward.compute_score("d", "<answer>7</answer>", "7", {}, verifier_latency=slow)
    assert out["verifier_s"] >= 0.4 and latency_sleeps.count == 2
    fast = reward.compute_score("d", "<answer>7</answer>", "7", {}, verifier_latency=NO_LATENCY)
    assert fast["score"] == 1.0 and latency_sleeps.count == 2  # no modelled latency slept


def test_default_latency_is_reproducible_per_sample():
    a = reward._latency_for("<answer>1</answer>", {"index": 5}, {})
    assert a == reward._latency_for("<answer>1</answer>", {"index": 5}, {})
    draws = {reward._latency_for("<answer>1</answer>", {"index": i}, {}) for i in range(20)}
    assert len(draws) == 20 and all(0 < d <= 4.0 for d in draws)


def test_bad_latency_config_is_a_loud_error():
    with pytest.raises(ValueError, match="unknown latency keys"):
        reward.compute_score("d", "<answer>7</answer>", "7", {"verifier_latency": {"medain_s": 1.0}})


def test_verl_reward_loader_accepts_our_functions():
    """verl's own loader wraps our function with the config's reward_kwargs."""
    from omegaconf import OmegaConf

    from verl.trainer.ppo.reward import get_custom_reward_fn

    config = OmegaConf.create(
        {
            "reward": {
                "custom_reward_function": {
                    "path": reward.__file__,
                    "name": "compute_score",
                    "reward_kwargs": {"verifier_latency": NO_LATENCY},
                }
            }
        }
    )
    fn = get_custom_reward_fn(config)
    out = fn(data_source="thundersync_arith", solution_str="<answer>4</answer>", ground_truth="4", extra_info={})
    assert out["score"] == 1.0 and out["verifier_s"] > 0
