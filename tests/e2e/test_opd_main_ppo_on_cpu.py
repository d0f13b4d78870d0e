"""On-policy distillation (OPD) through stock ``python -m verl.trainer.main_ppo``: recipe, wiring, runs.

1. The ``opd`` recipe composes, in every mode, to the ``grpo`` recipe plus exactly the OPD keys
   (it cannot inherit grpo.yaml through hydra, so this test is what keeps the two in step).
2. The trainer side of OPD turns, without Ray: every turn backpropagated once, then one step; a dropped
   turn refuses the step (the agent loop's side: ``tests/algos/test_opd_turn_teacher_on_cpu.py``).
3. Two real steps, random tiny student and teacher (seconds to build): ``mode=thundersync`` streams
   agent turns scored at their boundaries (staleness 0, every turn backpropagated, the per-turn
   teacher scores equal verl's whole-trajectory ones); ``mode=sync`` is verl's own OPD.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from thundersync_verl import verl_adapter as va

from thundersync_verl.demo import recipe_dir, run_env, verl_command
from thundersync_verl.envs.dataset import write_dataset

MODES = ("sync", "async", "fully_async", "thundersync")
OPD_ONLY = ("distillation.", "thundersync.opd.", "ray_kwargs.ray_init.num_gpus")


# ----- 1. the recipe ------------------------------------------------------------------------------
def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def _compose(name: str, mode: str, *extra: str) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    overrides = ["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z", f"mode={mode}", *extra]
    if name == "opd":
        overrides.append("distillation.teacher_models.teacher_model.model_path=t")
    with initialize_config_dir(config_dir=str(recipe_dir()), version_base=None):
        cfg = compose(config_name=name, overrides=overrides)
    return _flat(OmegaConf.to_container(cfg, resolve=True))


@pytest.mark.slow  # composes both recipes with verl's config tree in every mode (about 8 s of CPU)
@pytest.mark.parametrize("mode", MODES)
def test_opd_recipe_is_grpo_plus_the_opd_keys(mode):
    same_name = "trainer.experiment_name=run"  # the run name (and the paths derived from it) differs by design
    grpo, opd = _compose("grpo", mode, same_name), _compose("opd", mode, same_name)
    changed = sorted(k for k in set(grpo) | set(opd) if grpo.get(k, "<absent>") != opd.get(k, "<absent>"))
    unexpected = [k for k in changed if not k.startswith(OPD_ONLY)]
    assert unexpected == [], f"opd.yaml drifted from grpo.yaml: {unexpected}"
    assert _compose("opd", mode)["trainer.experiment_name"] == f"opd_{mode}"  # the run is named after its mode
    assert opd["distillation.enabled"] is True and opd["distillation.distillation_loss.loss_mode"] == "k1"
    assert opd["distillation.distillation_loss.use_policy_gradient"] is True
    assert opd["distillation.distillation_loss.use_task_rewards"] is False
    assert opd["distillation.teacher_models.teacher_model.inference.name"] == "hf_cpu"
    slots = 1 + (mode != "sync") + 1  # learner (+ standalone rollout) + teacher
    assert opd["ray_kwargs.ray_init.num_gpus"] >= slots


@pytest.mark.parametrize("override, key", [
    ("distillation.distillation_loss.use_policy_gradient=false", "loss_mode=k1 with use_policy_gradient=false"),
    ("distillation.distillation_loss.loss_mode=forward_kl_topk", "loss_mode=forward_kl_topk"),
    ("+distillation.teacher_models.teacher_b.model_path=t2", "ONE teacher"),
])
def test_thundersync_opd_refuses_what_turns_cannot_stream(override, key):
    from hydra import compose, initialize_config_dir

    from thundersync_verl.core import StreamingConfigError
    from thundersync_verl.step.thundersync_trainer import validate_thundersync_config

    overrides = ["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z", "mode=thundersync",
                 "distillation.teacher_models.teacher_model.model_path=t"]
    with initialize_config_dir(config_dir=str(recipe_dir()), version_base=None):
        validate_thundersync_config(compose(config_name="opd", overrides=overrides))  # the recipe itself passes
        with pytest.raises(StreamingConfigError, match=key):
            validate_thundersync_config(compose(config_name="opd", overrides=overrides + [override]))


# ----- 2. the wiring, without Ray ------------------------------------------------------------------
class _FakeTQ:
    """The TransferQueue surface the OPD step uses; a record becomes visible at its ``poll`` number."""

    def __init__(self):
        self.records: dict[str, dict[str, tuple[int, dict, dict]]] = {"train": {}, "opd_turns": {}}
        self.polls, self.cleared = 0, []

    def add(self, partition: str, key: str, fields: dict, tag: dict, visible_at: int = 0):
        self.records[partition][key] = (visible_at, fields, tag)

    def kv_list(self, partition):
        if partition == "train":
            self.polls += 1
        return {partition: {k: t for k, (v, _, t) in self.records[partition].items() if v <= self.polls}}

    def kv_batch_get(self, keys, partition_id, select_fields):
        return {f: [self.records[partition_id][k][1][f] for k in keys] for f in select_fields}

    def kv_clear(self, keys, partition_id):
        self.cleared += list(keys)


class _FakeLearner:
    """The streaming worker group: records what each per-token chunk scores; one rank."""

    world_size = 1

    def __init__(self, tq: _FakeTQ):
        self.tq, self.chunks, self.steps, self.begun = tq, [], [], 0
        self.rows, self.folds = [], {}  # task-term rows (coefficient, destination), folds {bucket: coefficient}

    def stream_backward(self, chunk):
        self.rows += [(float(c), va.non_tensor(chunk, "ts_dest")) for c in chunk["ts_coef"]]

    def stream_fold(self, folds):
        self.folds.update(folds)

    def stream_begin_batch(self, meta):
        self.begun += 1

    def stream_token_backward(self, chunk):
        coef = chunk["ts_token_coef"].to_padded_tensor(0.0) if chunk["ts_token_coef"].is_nested else chunk["ts_token_coef"]
        teacher = chunk["ts_teacher_log_prob"]
        teacher = teacher.to_padded_tensor(0.0) if teacher.is_nested else teacher
        self.chunks.append({"polls": self.tq.polls, "tokens": int((coef != 0).sum()),
                            "teacher_sum": float((teacher * (coef != 0)).sum()), "coef": set(chunk["ts_coef"].tolist()),
                            "supervised": va.non_tensor(chunk, "ts_distill_supervised", False)})

    def finalize_step(self, scale):
        self.steps.append(scale)
        return [{"grad_norm": 1.0, "lr": 1e-3}]


def _opd_step(tq: _FakeTQ, uids: list[str], n: int, planner=None):
    from thundersync_verl.algos.opd.opd_stream import OPDTurnPlanner
    from thundersync_verl.algos.opd.opd_trainer_step import OPDArrivals
    from thundersync_verl.run.step_record import StepRecorder
    from thundersync_verl.step.stream_exec import OpPipeline
    from thundersync_verl.step.streamed_step import StepContext, StreamedStep

    learner = _FakeLearner(tq)
    ctx = StepContext(
        worker_group=learner, tq=tq, recorder=StepRecorder(None, mode="thundersync", algo="opd"),
        # the fake learner has only the blocking calls: one call per op (thundersync.pipeline_depth=1)
        make_pipeline=lambda on_done: OpPipeline(learner, pad_token_id=0, temperature=1.0, on_done=on_done, depth=1),
        forward_at_theta_k=lambda keys, tags: {}, uids=uids, n=n, timeout_s=30.0, poll_s=0.001, coalesce=True,
        fused_forward=False)  # the fake learner returns no per-chunk measurements: verl's forward path
    return StreamedStep(ctx, OPDArrivals(planner or OPDTurnPlanner(max_chunk_size=2))), learner


def _traj(tq: _FakeTQ, key: str, turns: list[tuple[list[int], list[int]]], *, publish: bool, visible_at: int,
          turns_visible_at: int = 0, drop_turn: int | None = None, reward: float = 0.0):
    """A trajectory of (action, observation) turns: its row, verl's whole-sequence teacher scores,
    old log-probs and, if ``publish``, its scored turns as the agent loop publishes them."""
    prompt, response, mask = [1, 2, 3], [], []
    teacher_whole = [-0.1 * (i + 1) for i in range(len(prompt) + sum(len(a) + len(o) for a, o in turns))]
    for j, (action, obs) in enumerate(turns):
        start = len(response)
        response += action
        mask += [1] * len(action)
        if publish and j != drop_turn:
            values = teacher_whole[len(prompt) + start - 1 : len(prompt) + len(response) - 1]
            tq.add("opd_turns", f"{key}_t{j}", {"prefix_ids": torch.tensor(prompt + response),
                                                 "teacher_log_probs": torch.tensor(values)},
                   {"status": "success", "traj": key, "turn": j, "prompt_len": 3, "action_start": start}, turns_visible_at)
        response += obs
        mask += [0] * len(obs)
    extra = {"opd_turns": len(turns)} if publish else {}
    tq.add("train", key, {"prompts": torch.tensor(prompt), "responses": torch.tensor(response),
                          "response_mask": torch.tensor(mask), "rm_scores": torch.tensor([reward]), "extra_fields": extra,
                          "teacher_logprobs": torch.tensor(teacher_whole).unsqueeze(-1),
                          "old_log_probs": torch.zeros(len(response))}, {"status": "success"}, visible_at)
    scored = [teacher_whole[len(prompt) + i - 1] for i, m in enumerate(mask) if m]  # log p(response token i)
    return len(scored), sum(scored)


TWO_TURNS = [([10, 11], [50, 51, 52]), ([12, 13, 14], [])]


@pytest.mark.parametrize("publish", [True, False], ids=["turns_from_agent_loop", "turns_split_at_trajectory_end"])
def test_opd_step_backpropagates_every_turn_once_then_steps(publish):
    tq = _FakeTQ()
    tq.add("opd_turns", "zz_0_0_t0", {}, {}, 0)  # listed before its tag is written: picked up later, not foreign
    tokens = teacher = 0.0
    for uid in ("a", "b"):
        for s in range(2):
            n_tok, t_sum = _traj(tq, f"{uid}_{s}_0", TWO_TURNS, publish=publish, visible_at=3 + s)
            tokens, teacher = tokens + n_tok, teacher + t_sum
    step, learner = _opd_step(tq, ["a", "b"], n=2)
    metrics = step.metrics(step.run()[0])
    chunks = learner.chunks
    assert sum(c["tokens"] for c in chunks) == tokens == 20  # every action token once, observations never
    assert sum(c["teacher_sum"] for c in chunks) == pytest.approx(teacher, abs=1e-5)  # the right teacher values
    assert learner.steps == [pytest.approx(1 / tokens)]  # one step, token-mean normaliser
    assert metrics["thundersync/opd/turns"] == 8 and metrics["thundersync/opd/teacher_prefix_gap_max"] < 1e-6
    assert metrics["thundersync/opd/turns_from_trajectory_end"] == (0 if publish else 8)
    assert publish or metrics["thundersync/opd/rows"] == 4  # a split trajectory's turns are ready at once: one row
    if publish:  # every turn was backpropagated before its trajectory landed (trajectories appear at poll 3)
        assert all(c["polls"] < 3 for c in chunks)
        assert metrics["thundersync/opd/turns_backpropagated_before_trajectory_end"] == 1.0
        assert sorted(tq.cleared) == sorted(k for k in tq.records["opd_turns"] if k != "zz_0_0_t0")  # the batch's turns


def test_opd_step_with_task_rewards_streams_the_grpo_term_beside_the_turns():
    """verl's shipped use_task_rewards=true (opd_trainer_step point 6): each landed trajectory's task row once, with
    its group's GRPO advantage (direct, or bucketed and folded); every turn with the distillation coefficient."""
    from thundersync_verl.algos.opd.opd_config import OPDLoss
    from thundersync_verl.algos.opd.opd_stream import OPDTurnPlanner
    from thundersync_verl.algos.opd.opd_task import OPDTaskPlanner
    from thundersync_verl.step.stream_plan import StreamPlanner

    tq = _FakeTQ()
    rewards = {"a_0_0": 1.0, "b_0_0": 1.0, "a_1_0": 0.0, "b_1_0": 1.0}  # land one per poll: a's group opens first
    tokens = sum(_traj(tq, key, TWO_TURNS, publish=True, visible_at=3 + i, reward=r)[0]
                 for i, (key, r) in enumerate(rewards.items()))
    loss = OPDLoss(estimator="k3", policy_gradient=False, use_task_rewards=True, coef=0.5)
    planner = OPDTaskPlanner(OPDTurnPlanner(max_chunk_size=2, loss=loss), StreamPlanner(max_chunk_size=2))
    step, learner = _opd_step(tq, ["a", "b"], n=2, planner=planner)
    step.run()
    effective = sorted(c if dest == "direct" else c * learner.folds[dest] for c, dest in learner.rows)
    adv = 0.5 / (2 ** -0.5 + 1e-6)  # GRPO: (r - mean) / (std + eps) in group a; group b's rewards tie: 0
    assert effective == pytest.approx([-adv, 0.0, 0.0, adv], rel=1e-6)
    assert any(dest != "direct" for _, dest in learner.rows)  # a trajectory of an open group went to a bucket
    assert sum(c["tokens"] for c in learner.chunks) == tokens == 20  # every action token once
    assert all(c["coef"] <= {0.5, 0.0} and c["supervised"] for c in learner.chunks)
    assert learner.steps == [pytest.approx(1 / tokens)]  # one barrier, the two terms' one normaliser


def test_opd_step_refuses_to_step_without_a_dropped_turn():
    from thundersync_verl.core import StreamingStateError

    tq = _FakeTQ()
    _traj(tq, "a_0_0", TWO_TURNS, publish=True, visible_at=1)
    _traj(tq, "a_1_0", TWO_TURNS, publish=True, visible_at=1, drop_turn=1)
    step, learner = _opd_step(tq, ["a"], n=2)
    with pytest.raises(StreamingStateError, match=r"a_1_0: 1/2 turns"):
        step.run()
    assert learner.steps == []  # no optimizer step


# ----- 3. two real steps ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tool_happy_student(tiny_random_lm, tmp_path_factory):
    """The random student, biased to open tool calls and end turns: multi-turn agent trajectories.

    A large constant in embedding dimension 0 dominates the final hidden state, so that dimension of
    each (tied) output row acts as a per-token bias: ``<tool_call>`` and ``<|im_end|>`` get ~35% and
    ~15% of the mass. A turn then opens a tool call and ends within a few tokens; the agent loop answers
    with a tool turn (an unclosed call is an error observation) and the student generates again.
    """
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_random_lm)
    model = Qwen2ForCausalLM.from_pretrained(tiny_random_lm)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight  # [V, H]
        emb[:, 0] += 4.0
        emb[tokenizer.convert_tokens_to_ids("<tool_call>"), 0] += 1.0  # ~35% of the mass
        emb[tokenizer.eos_token_id, 0] += 0.8  # ~15%: a turn opens a call before it ends ~70% of the time
    path = tmp_path_factory.mktemp("tool_happy_student")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_random_teacher(tiny_random_lm, tmp_path_factory):
    """A random 3-layer Qwen2 with the student's tokenizer: the teacher of the e2e runs."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    fields = {k: v for k, v in AutoConfig.from_pretrained(tiny_random_lm).to_dict().items() if k != "layer_types"}
    # 3 layers, and far from the near-uniform student: a clearly positive reverse KL
    config = Qwen2Config(**{**fields, "num_hidden_layers": 3, "initializer_range": 0.2})
    torch.manual_seed(7)
    path = tmp_path_factory.mktemp("tiny_random_teacher")
    Qwen2ForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_random_lm).save_pretrained(path)
    return path


SMALL = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",  # verl needs the 8 rows to split exactly
         "data.max_response_length=64", "thundersync.env.tool_latency.scale=0.2"]


def _run_opd(tmp_path: Path, student: Path, teacher: Path, mode: str, steps: int = 2, more: tuple = ()) -> list[dict]:
    inputs = {"train": write_dataset(tmp_path / "train.parquet", 32, seed=0, split="train"),
              "val": write_dataset(tmp_path / "val.parquet", 4, seed=0, split="test"),
              "student": student, "teacher": teacher}
    metrics = tmp_path / "metrics.jsonl"
    extra = SMALL + [f"thundersync.run_dir={tmp_path / 'run'}", *more]
    cmd = verl_command(inputs, algo="opd", mode=mode, steps=steps, extra=extra)
    env = run_env(tmp_path, metrics)
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="tsopd_", dir="/tmp")  # Ray's socket paths must stay < 108 bytes
    try:
        with open(tmp_path / "verl.log", "w") as log:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=300, cwd=tmp_path).returncode
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    if rc != 0:
        lines = (tmp_path / "verl.log").read_text().splitlines()
        errors = [x for x in lines if "Error" in x and "Warning" not in x][:8]
        pytest.fail(f"main_ppo exited with {rc}; log {tmp_path / 'verl.log'}; first errors:\n" + "\n".join(errors))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r.get("data", r) for r in rows if "timing_s/step" in r.get("data", r)]


VERL_SHIPPED = tuple(f"distillation.distillation_loss.{k}" for k in (  # verl's distillation.yaml defaults
    "loss_mode=k3", "use_policy_gradient=false", "use_task_rewards=true"))


WHOLE_TRAJECTORY = ("thundersync.opd.teacher_calls=trajectory", "thundersync.opd.granularity=trajectory")


@pytest.mark.slow  # launches verl's main_ppo
@pytest.mark.timeout(330)
@pytest.mark.parametrize("distill", [(), VERL_SHIPPED, WHOLE_TRAJECTORY],
                         ids=["recipe_k1_policy_gradient", "verl_shipped_k3_task_rewards", "whole_trajectory_rows"])
def test_thundersync_opd_streams_scored_turns_with_zero_staleness(tmp_path, tool_happy_student, tiny_random_teacher,
                                                                  distill):
    steps = _run_opd(tmp_path, tool_happy_student, tiny_random_teacher, "thundersync", more=distill)
    whole = distill is WHOLE_TRAJECTORY  # verl's teacher call per whole trajectory, one row each (opd_trainer_step 7)
    assert len(steps) == 2
    for r in steps:
        assert r["training/off_policy/trajectory_staleness/max"] == 0
        assert r["training/rollout_logprob_diff_max"] < 1e-5
        assert r["thundersync/opd/turns"] >= 4 * 2  # every trajectory has at least one turn, all backpropagated
        # per-turn calls: all scored by the agent loop, at the turn; whole-trajectory calls: split when it lands
        assert r["thundersync/opd/turns_from_trajectory_end"] == (r["thundersync/opd/turns"] if whole else 0)
        assert r["thundersync/opd/teacher_prefix_gap_max"] < 1e-4  # per-turn scores == verl's whole-trajectory ones
        assert 0 <= r["thundersync/opd/whole_teacher_call_reused"] <= (0 if whole else 1)
        assert math.isfinite(r["thundersync/opd/reverse_kl"]) and r["thundersync/opd/reverse_kl"] > 0
        assert r["thundersync/chunks"] >= 1 and r["actor/grad_norm"] > 0
    events = [json.loads(x) for x in (tmp_path / "run" / "opd_thundersync.jsonl").read_text().splitlines()]
    trajs = [e for e in events if e["kind"] == "trajectory"]
    # verl's whole-trajectory teacher call is replaced exactly when the last turn's prefix is the trajectory:
    # it ended on an action (no tool call after it), not on a tool observation
    assert all(e.get("teacher_reused", False) == (not whole and e["turns"][-1]["tool_s"] == 0.0) for e in trajs)
    turns_per_traj = [len(e["turns"]) for e in events if e["kind"] == "trajectory"]
    assert len(turns_per_traj) == 2 * 4 * 2 and any(n > 1 for n in turns_per_traj)  # multi-turn agent trajectories
    for s, r in enumerate(steps, start=1):  # each turn in one row (ready turns of a trajectory may share one);
        # with task rewards each trajectory's task row once
        rows = sum(e["rows"] for e in events if e["kind"] == "learner" and e.get("step") == s and e["op"] == "backward")
        assert rows == r["thundersync/opd/rows"] + (4 * 2 if distill is VERL_SHIPPED else 0)
        assert 4 * 2 <= r["thundersync/opd/rows"] <= r["thundersync/opd/turns"]
        assert r["thundersync/opd/rows"] == 4 * 2 or not whole  # one row per trajectory


@pytest.mark.slow  # launches verl's main_ppo
@pytest.mark.timeout(330)
def test_sync_opd_is_verls_own_distillation_with_the_hf_cpu_teacher(tmp_path, tool_happy_student, tiny_random_teacher):
    steps = _run_opd(tmp_path, tool_happy_student, tiny_random_teacher, "sync")
    assert len(steps) == 2
    for r in steps:
        assert r["training/off_policy/trajectory_staleness/max"] == 0
        assert r["training/rollout_logprob_diff_max"] < 1e-5
        assert math.isfinite(r["actor/distillation/loss"]) and r["actor/distillation/loss"] > 0  # reverse KL estimate
        assert r["actor/grad_norm"] > 0
