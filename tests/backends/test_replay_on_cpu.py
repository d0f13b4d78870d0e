"""Rollout ``replay``: record with the real hf_cpu server, serve it back identically, in order or permuted, on time."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from thundersync_verl.backends.replay import replay_reward
from thundersync_verl.backends.replay.record import FORMAT, record_compute_score_async
from thundersync_verl.backends.replay.recording import Recording, ReplayMissError
from thundersync_verl.backends.replay.server import ReplayServer
from thundersync_verl.envs import protocol

QUESTIONS = ["3+4", "12*3-5"]
N = 3  # samples per prompt, like rollout.n
MAX_TOKENS = [6, 24, 12]  # per sample: different lengths give different service times


def _rollout_config(**engine_kwargs):
    return SimpleNamespace(dtype="float32", max_model_len=256, prompt_length=48, response_length=64,
                           engine_kwargs=engine_kwargs)


def _prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\nCompute `{question}`.<|im_end|>\n<|im_start|>assistant\n")


async def _batch(server, prompts, tag: str):
    """Every prompt x N samples concurrently (first turns), then one second turn per prompt."""
    calls = [(p, {"max_tokens": MAX_TOKENS[i], "temperature": 1.0, "ignore_eos": True, "seed": 7 * j + i})
             for j, p in enumerate(prompts) for i in range(N)]
    outs = await asyncio.gather(*[server.generate(p, s, request_id=f"{tag}{k}") for k, (p, s) in enumerate(calls)])
    second = [p + o.token_ids + [5, 6, 7] for p, o in zip([c[0] for c in calls][::N], outs[::N])]
    outs2 = await asyncio.gather(*[server.generate(p, {"max_tokens": 5, "temperature": 1.0, "seed": 1}, request_id=f"{tag}t2")
                                   for p in second])
    return [(o.token_ids, o.log_probs, o.stop_reason) for o in outs + outs2]


@pytest.fixture(scope="module")
def recorded(tiny_random_lm, tmp_path_factory):
    """A recording made by the real HFCpuServer (generate hook) and the reward wrapper (real verifier)."""
    from thundersync_verl.backends.cpu.rollout import HFCpuServer

    path = tmp_path_factory.mktemp("replay") / "rec.jsonl"
    server = HFCpuServer(_rollout_config(hf_cpu={"record_path": str(path)}), SimpleNamespace(local_path=str(tiny_random_lm)),
                         None, 0)
    prompts = [_prompt(server.engine.tokenizer, q) for q in QUESTIONS]
    outputs = asyncio.run(_batch(server, prompts, "rec"))
    answers = [server.engine.tokenizer.decode(o[0], skip_special_tokens=True) for o in outputs[: len(QUESTIONS) * N]]
    answers[0] = protocol.answer_text(7)  # one correct answer: rewards are not all equal

    async def score_all():
        jobs = [record_compute_score_async("arith", a, "7", {"index": k // N}, record_path=str(path),
                                           verifier_latency={"kind": "constant", "median_s": 0.05 * (k % 2)})
                for k, a in enumerate(answers)]
        return await asyncio.gather(*jobs)

    scores = asyncio.run(score_all())
    return SimpleNamespace(path=path, prompts=prompts, outputs=outputs, answers=answers, scores=scores,
                           tokenizer=server.engine.tokenizer)


def _replay_server(path, **settings):
    return ReplayServer(_rollout_config(replay={"path": str(path), **settings}))


def test_recording_has_every_call_and_reward_with_times_relative_to_the_first_call(recorded):
    lines = [json.loads(line) for line in recorded.path.read_text().splitlines()]
    assert lines[0]["kind"] == "header" and lines[0]["format"] == FORMAT
    gens = [r for r in lines if r["kind"] == "generate"]
    rewards = [r for r in lines if r["kind"] == "reward"]
    assert len(gens) == len(QUESTIONS) * N + len(QUESTIONS) and len(rewards) == len(QUESTIONS) * N
    assert min(r["start_s"] for r in gens) == pytest.approx(0.0, abs=0.05)
    for r in gens:
        assert 0 <= r["start_s"] <= r["end_s"] and len(r["response_ids"]) == len(r["log_probs"]) > 0
        assert r["stop_reason"] in ("completed", "length") and r["temperature"] == 1.0
    assert all(r["landed_s"] >= r["start_s"] >= max(g["end_s"] for g in gens[: len(QUESTIONS) * N]) - 1e-6 for r in rewards)
    assert [r["result"] for r in rewards if r["index"] == 0 and r["solution_str"] == recorded.answers[0]] == [recorded.scores[0]]


def test_replay_serves_identical_tokens_logprobs_and_rewards_in_recorded_order(recorded):
    server = _replay_server(recorded.path, time_scale=0)
    assert asyncio.run(_batch(server, recorded.prompts, "rep")) == recorded.outputs  # bitwise, same order
    replay_reward.forget_recordings()

    async def score_all():
        return await asyncio.gather(*[replay_reward.compute_score_async("arith", a, "7", {"index": k // N},
                                                                        replay_path=str(recorded.path), time_scale=0)
                                      for k, a in enumerate(recorded.answers)])

    assert asyncio.run(score_all()) == recorded.scores
    out = asyncio.run(_replay_server(recorded.path, time_scale=0).generate(recorded.prompts[0], {}, request_id="x"))
    assert out.extra_fields["finish_reason"] == "length" and out.extra_fields["max_global_steps"] == 0


def test_replay_can_re_record_what_it_served(recorded, tmp_path):
    again = tmp_path / "again.jsonl"
    server = _replay_server(recorded.path, time_scale=0, record_path=str(again))
    asyncio.run(_batch(server, recorded.prompts, "rep"))
    key = lambda r: (r["prompt_ids"], r["response_ids"], r["log_probs"], r["stop_reason"])  # noqa: E731
    read = lambda p: sorted(key(r) for r in map(json.loads, p.read_text().splitlines()) if r["kind"] == "generate")  # noqa: E731
    assert read(again) == read(recorded.path)


def test_unrecorded_prompt_and_extra_occurrence_are_clear_errors(recorded):
    server = _replay_server(recorded.path, time_scale=0)
    with pytest.raises(ReplayMissError, match=rf"{recorded.path}.*record_path"):
        asyncio.run(server.generate([1, 2, 3], {}, request_id="x"))
    for _ in range(N):
        asyncio.run(server.generate(recorded.prompts[1], {"max_tokens": 64}, request_id="x"))
    with pytest.raises(ReplayMissError, match=f"recorded {N} time"):
        asyncio.run(server.generate(recorded.prompts[1], {}, request_id="x"))
    with pytest.raises(ValueError, match="temperature"):
        asyncio.run(server.generate(recorded.prompts[0], {"temperature": 0.5}, request_id="x"))
    with pytest.raises(ValueError, match="max_response_length"):
        asyncio.run(server.generate(recorded.prompts[0], {"max_tokens": 1}, request_id="x"))
    with pytest.raises(ReplayMissError, match="no reward is recorded"):
        asyncio.run(replay_reward.compute_score_async("arith", "never said", "7", {"index": 0}, replay_path=str(recorded.path)))
    with pytest.raises(FileNotFoundError, match="record_path"):
        _replay_server(recorded.path.with_name("missing.jsonl"))
    with pytest.raises(ValueError, match="engine_kwargs.replay.path"):
        ReplayServer(_rollout_config())
    with pytest.raises(ValueError, match="unknown keys"):
        _replay_server(recorded.path, timescale=1)


def test_repeat_serves_a_prompt_asked_for_again_its_recorded_answers_in_order(recorded):
    """Tail batching runs a deferred prompt again: ``repeat`` replays the first run's answers (recording.py point 5)."""
    server = _replay_server(recorded.path, time_scale=0, repeat=True)
    first = [asyncio.run(server.generate(recorded.prompts[1], {"max_tokens": 64}, request_id="x")) for _ in range(N)]
    again = [asyncio.run(server.generate(recorded.prompts[1], {"max_tokens": 64}, request_id="x")) for _ in range(N)]
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    with pytest.raises(ReplayMissError, match="record_path"):  # an unrecorded prompt stays an error
        asyncio.run(server.generate([1, 2, 3], {}, request_id="x"))
    with pytest.raises(ValueError, match="repeat must be true or false"):
        _replay_server(recorded.path, repeat="yes")


def test_blocking_reward_functions_record_and_replay(tmp_path):
    from thundersync_verl.backends.replay.record import record_compute_score

    path, latency = str(tmp_path / "rec.jsonl"), {"kind": "constant", "median_s": 0.0}
    got = [record_compute_score("arith", a, "7", {"index": 4}, record_path=path, verifier_latency=latency,
                                record_inner="thundersync_verl.envs.reward:compute_score")  # a blocking inner
           for a in (protocol.answer_text(7), "no answer")]
    assert [g["score"] for g in got] == [1.0, 0.0]
    replay_reward.forget_recordings()
    assert [replay_reward.compute_score("arith", a, "7", {"index": 4}, replay_path=path, time_scale=0)
            for a in (protocol.answer_text(7), "no answer")] == got
    with pytest.raises(ValueError, match="module:function"):
        record_compute_score("arith", "x", "7", {}, record_path=path, record_inner="no_colon")


def _synthetic(path, service_s: list[float], version: int = 3) -> list[list[int]]:
    """A recording in the documented format: one call per prompt, all starting at 0, given service times."""
    prompts = [[100 + i, 7, 7] for i in range(len(service_s))]
    lines = [{"kind": "header", "format": FORMAT, "t0_unix": 0.0}]
    for i, (p, s) in enumerate(zip(prompts, service_s)):
        lines.append({"kind": "generate", "request_id": str(i), "prompt_ids": p, "response_ids": [i], "log_probs": [-0.5],
                      "stop_reason": "completed", "start_s": 0.001 * i, "end_s": 0.001 * i + s, "version": version,
                      "temperature": 1.0, "max_tokens": 8, "pid": 1})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return prompts


def _completion_times(server, prompts) -> list[float]:
    async def run():
        t0 = time.perf_counter()
        done = {}

        async def one(i, p):
            await server.generate(p, {}, request_id=str(i))
            done[i] = time.perf_counter() - t0

        await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
        return [done[i] for i in range(len(prompts))]

    return asyncio.run(run())


SERVICE = [0.30, 0.06, 0.18, 0.42, 0.12, 0.24]


@pytest.mark.parametrize("time_scale", [1.0, 0.5])
def test_time_scale_reproduces_the_recorded_relative_timing(tmp_path, time_scale, latency_sleeps):
    prompts = _synthetic(tmp_path / "rec.jsonl", SERVICE)
    done = _completion_times(_replay_server(tmp_path / "rec.jsonl", time_scale=time_scale), prompts)
    assert sorted(latency_sleeps.asked) == pytest.approx(sorted(s * time_scale for s in SERVICE), rel=1e-9)
    for got, want in zip(done, SERVICE):
        assert got >= want * time_scale - 1e-3  # a call never returns before its scaled service time


def test_time_scale_zero_does_not_sleep(tmp_path):
    prompts = _synthetic(tmp_path / "rec.jsonl", [5.0, 5.0])
    assert max(_completion_times(_replay_server(tmp_path / "rec.jsonl", time_scale=0), prompts)) < 2.5


def test_permute_seed_gives_a_reproducible_permutation_of_the_completion_order(tmp_path, latency_sleeps):
    prompts = _synthetic(tmp_path / "rec.jsonl", SERVICE)
    recorded_order = sorted(range(len(SERVICE)), key=SERVICE.__getitem__)
    orders = []
    for seed in (11, 11, 12):
        server = _replay_server(tmp_path / "rec.jsonl", permute_seed=seed)
        plan = [server.recording.service_s[line] for line in range(2, 2 + len(SERVICE))]  # records start on line 2
        assert sorted(plan) == pytest.approx(sorted(SERVICE))  # the same latencies, reassigned
        latency_sleeps.asked.clear()
        _completion_times(server, prompts)
        assert latency_sleeps.asked == pytest.approx(plan)  # request i sleeps its permuted latency: done in that order
        orders.append(sorted(range(len(plan)), key=plan.__getitem__))
    assert orders[0] == orders[1] and orders[0] != recorded_order and orders[0] != orders[2]


def test_permutation_stays_within_one_weight_version(tmp_path):
    path = tmp_path / "rec.jsonl"
    _synthetic(path, SERVICE)
    lines = path.read_text().splitlines()
    moved = [json.loads(line) for line in lines[1:]]
    for r in moved[:3]:
        r["version"] = 1
    path.write_text(lines[0] + "\n" + "".join(json.dumps(r) + "\n" for r in moved))
    plan = Recording(str(path), permute_seed=5).service_s
    assert sorted(plan[line] for line in (2, 3, 4)) == pytest.approx(sorted(SERVICE[:3]))
    assert sorted(plan[line] for line in (5, 6, 7)) == pytest.approx(sorted(SERVICE[3:]))


def test_verl_resolves_rollout_replay_like_hf_cpu():
    import verl  # noqa: F401  (loads the plugin)
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    assert RolloutReplicaRegistry.get("replay").__name__ == "ReplayReplica"
    assert get_rollout_class("replay").__name__ == "ReplayServerAdapter"


# -- end to end: stock main_ppo records one step with hf_cpu, then replays it in ThunderSync mode -----------------
TOY_REWARD = """
import zlib
async def score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    # deterministic in the response, about half the trajectories score 1: GRPO advantages are not all zero
    return {"score": float(zlib.crc32(solution_str.encode()) % 2), "chars": float(len(solution_str))}
"""


@pytest.fixture(scope="module")
def tool_happy_student(tiny_random_lm, tmp_path_factory):
    """The random student biased to open tool calls and end turns (as in tests/e2e): multi-turn trajectories."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_random_lm)
    model = Qwen2ForCausalLM.from_pretrained(tiny_random_lm)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight  # [V, H]
        emb[:, 0] += 4.0
        emb[tokenizer.convert_tokens_to_ids("<tool_call>"), 0] += 1.0
        emb[tokenizer.eos_token_id, 0] += 0.8
    path = tmp_path_factory.mktemp("tool_happy_student")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _main_ppo(tmp_path, model_path, mode: str, rollout: list[str], reward: list[str], tag: str) -> list[dict]:
    import shutil
    import subprocess
    import sys
    import tempfile

    from thundersync_verl.demo import recipe_dir, run_env
    from thundersync_verl.envs.dataset import write_dataset

    train = write_dataset(tmp_path / "train.parquet", 32, seed=0, split="train")
    val = write_dataset(tmp_path / "val.parquet", 8, seed=0, split="test")
    metrics = tmp_path / f"{tag}_metrics.jsonl"
    cmd = [
        sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={recipe_dir()}", "--config-name=grpo",
        f"data.train_files={train}", f"data.val_files={val}", f"actor_rollout_ref.model.path={model_path}",
        "trainer.total_training_steps=1", f"mode={mode}", "data.max_response_length=64",
        "thundersync.env.retry_prob=0",  # the agent loop's transient tool failures are not seeded: the prompts of
        "thundersync.env.tool_latency.scale=0.2",  # later turns would differ between runs
        "reward.custom_reward_function.path=pkg://thundersync_verl.backends.replay.record",
        "reward.custom_reward_function.name=record_compute_score_async", *rollout, *reward,
    ]
    env = run_env(tmp_path, metrics)
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="tsrep_", dir="/tmp")  # Ray's socket paths must stay < 108 bytes
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert out.returncode == 0, f"{tag}: " + (out.stdout + out.stderr)[-4000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r.get("data", r) for r in rows if "timing_s/step" in r.get("data", r)]


def _trajectories(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    gens = sorted((tuple(r["prompt_ids"]), tuple(r["response_ids"]), tuple(r["log_probs"])) for r in rows if r["kind"] == "generate")
    rewards = sorted((r["index"], r["solution_str"], r["score"]) for r in rows if r["kind"] == "reward")
    return gens, rewards


@pytest.mark.slow  # launches verl's main_ppo twice
@pytest.mark.timeout(1800)
def test_main_ppo_replays_one_hf_cpu_recorded_step_in_thundersync_mode(tmp_path, tool_happy_student):
    """Recorded from the real ``hf_cpu`` rollout (multi-turn, a reward function of its own), replayed in ThunderSync:
    the same calls, tokens, log-probs, rewards and update. Replays in Sync run in every e2e test on the shared
    recording (``main_ppo_runs``: their Sync runs), so this one launches ThunderSync only."""
    rec = tmp_path / "recording.jsonl"
    toy = tmp_path / "toy_reward.py"
    toy.write_text(TOY_REWARD)
    recorded = _main_ppo(tmp_path, tool_happy_student, "sync", [f"+actor_rollout_ref.rollout.engine_kwargs.hf_cpu.record_path={rec}"],
                         [f"+reward.custom_reward_function.reward_kwargs.record_path={rec}",
                          f"+reward.custom_reward_function.reward_kwargs.record_inner={toy}:score"], "record")
    gens, rewards = _trajectories(rec)
    assert len(rewards) == 8 * 4 and len(gens) > len(rewards)  # one step: 8 prompts x rollout.n=4, multi-turn
    assert 0 < sum(r[2] for r in rewards) < len(rewards)
    assert len(recorded) == 1 and recorded[0]["actor/grad_norm"] > 0
    for mode in ("thundersync",):
        served = tmp_path / f"served_{mode}.jsonl"
        rows = _main_ppo(
            tmp_path, tool_happy_student, mode,
            ["actor_rollout_ref.rollout.name=replay", f"+actor_rollout_ref.rollout.engine_kwargs.replay.path={rec}",
             "+actor_rollout_ref.rollout.engine_kwargs.replay.time_scale=0.5",
             f"+actor_rollout_ref.rollout.engine_kwargs.replay.record_path={served}"],
            [f"+reward.custom_reward_function.reward_kwargs.record_path={served}",  # re-record what the learner got
             "+reward.custom_reward_function.reward_kwargs.record_inner=thundersync_verl.backends.replay.replay_reward:compute_score_async",
             f"+reward.custom_reward_function.reward_kwargs.replay_path={rec}",
             "+reward.custom_reward_function.reward_kwargs.time_scale=0.5"],
            f"replay_{mode}")
        assert _trajectories(served) == (gens, rewards), mode  # the same calls, tokens, log-probs and rewards
        assert len(rows) == 1
        for key in ("critic/score/mean", "response_length/mean", "critic/advantages/max", "critic/advantages/min"):
            assert rows[0][key] == pytest.approx(recorded[0][key], abs=1e-6), (mode, key)
        assert rows[0]["training/rollout_logprob_diff_max"] < 1e-5  # the learner scored exactly the recorded tokens
        assert rows[0]["actor/grad_norm"] == pytest.approx(recorded[0]["actor/grad_norm"], rel=1e-4), mode  # same update
