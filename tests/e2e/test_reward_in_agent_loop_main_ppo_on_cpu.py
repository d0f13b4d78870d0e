"""``thundersync.reward_in_agent_loop=true`` under stock ``main_ppo``: where each reward runs, and what it changes.

Why:
1. The key moves the reward call from a ``RewardLoopWorker`` actor into verl's agent-loop worker
   (verl_adapter.patches, patch 8). The reward function here is the task's own verifier behind a thin wrapper
   that logs the title of the process it ran in (Ray names its workers ``ray::<Class>``), so the test
   sees where every trajectory was scored, not just that the run finished.
2. It must change nothing computed: on the same replayed trajectories, Sync with and without the key
   scores the same and pushes the same update, bit for bit (on the CPU platform verl's batch follows the
   prompts' order, not the order trajectories finished: ``verl_adapter.patches`` point 10, so two Sync runs on
   one recording sum in one order), and ThunderSync with the key streams at staleness 0 on the same scores.
Slow: three ``main_ppo`` launches and the shared recording (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import json
import textwrap

import pytest

from thundersync_harness import main_ppo_runs as runs

pytestmark = pytest.mark.slow

WRAPPER = textwrap.dedent('''
    import json, os
    from thundersync_verl.envs.reward import compute_score_async as task_score

    async def where_scored(data_source, solution_str, ground_truth, extra_info=None, log_path=None, **kwargs):
        result = await task_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
        with open("/proc/self/cmdline", "rb") as f:
            title = f.read().split(b"\\0")[0].decode(errors="replace")
        with open(log_path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "title": title, "score": result["score"]}) + "\\n")
        return result
''')


@pytest.fixture(scope="module")
def recording(tmp_path_factory, tiny_random_lm):
    work = tmp_path_factory.mktemp("reward_in_agent_loop")
    (work / "where_scored.py").write_text(WRAPPER)
    return work, runs.shared_recording(tmp_path_factory, tiny_random_lm)


def _run(work, model, rec, name: str, mode: str, in_loop: bool):
    log = work / f"scored_{name}.jsonl"
    fn = "reward.custom_reward_function"
    extra = [*runs.RESOLVING_SGD, f"{fn}.path={work / 'where_scored.py'}", f"{fn}.name=where_scored",
             f"+{fn}.reward_kwargs.log_path={log}", f"thundersync.reward_in_agent_loop={str(in_loop).lower()}"]
    rows, weights = runs.replayed(work, model, rec, name, mode, extra)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return rows[0], weights, calls


@pytest.mark.timeout(1500)
def test_rewards_are_scored_in_the_agent_loop_worker_and_the_update_is_unchanged(recording, tiny_random_lm):
    work, rec = recording
    row_a, w_a, calls_a = _run(work, tiny_random_lm, rec, "actor", "sync", in_loop=False)
    row_l, w_l, calls_l = _run(work, tiny_random_lm, rec, "in_loop", "sync", in_loop=True)
    row_t, _, calls_t = _run(work, tiny_random_lm, rec, "in_loop_ts", "thundersync", in_loop=True)
    titles = {name: {c["title"] for c in calls} for name, calls in (("actor", calls_a), ("in_loop", calls_l),
                                                                     ("in_loop_ts", calls_t))}
    print(titles)
    assert len(calls_a) == len(calls_l) == len(calls_t) >= 16  # every trajectory scored once, in either place
    assert all("RewardLoopWorker" in t for t in titles["actor"]), titles
    assert all("AgentLoopWorker" in t for t in titles["in_loop"] | titles["in_loop_ts"]), titles
    assert sorted(c["score"] for c in calls_l) == sorted(c["score"] for c in calls_a)
    assert row_l["critic/score/mean"] == row_a["critic/score/mean"] == row_t["critic/score/mean"]
    assert row_t["training/off_policy/trajectory_staleness/max"] == 0
    start = runs.start_weights(tiny_random_lm)
    actor, in_loop = runs.update(start, w_a), runs.update(start, w_l)
    gap = runs.distance(actor, in_loop) / runs.norm(actor)
    print(f"Sync update, reward in the agent loop vs in a reward actor: relative gap {gap:.3e}")
    assert runs.norm(actor) > 1.0 and gap == 0.0  # two Sync runs on one recording: one batch order, one update
