"""The streamed step with verl's KL loss: reference log-probs taken on arrival ride in every chunk. No Ray.

The TransferQueue and the learner are small in-memory stand-ins (as in test_streamed_step_on_cpu.py);
what is under test is the real ``StreamedStep``: its arrival stage asks the trainer's reference
callable once per landed trajectory, and the real chunk building (``stream_exec``) puts each row's
reference log-probs into the chunk (``ts_ref_log_prob``) that carries the row, bucket or direct.
"""

from __future__ import annotations

import torch

from thundersync_verl.run.step_record import StepRecorder
from thundersync_verl.step.stream_exec import OpPipeline
from thundersync_verl.step.chunk_layout import COEF_KEY, DEST_KEY, REF_LP_KEY
from thundersync_verl.step.stream_plan import StreamPlanner
from thundersync_verl.step.streamed_step import GRPOArrivals, StepContext, StreamedStep

KEYS = [f"{uid}_{s}_0" for uid in ("a", "b") for s in range(3)]
REWARDS = {"a": [1.0, 0.0, 1.0], "b": [0.0, 0.0, 1.0]}


class _TQ:
    def __init__(self):
        self.records, self.polls = {}, 0

    def add(self, key, reward, visible_at):
        fields = {"prompts": torch.tensor([1, 2]), "responses": torch.tensor([3, 4, 5]),
                  "response_mask": torch.tensor([1, 1, 1]), "rm_scores": torch.tensor([0.0, 0.0, reward]),
                  "extra_fields": {}, "rollout_log_probs": torch.tensor([-0.5, -0.5, -0.5])}
        self.records[key] = (visible_at, fields, {"status": "success", "is_prompt": False})

    def kv_list(self, partition):
        self.polls += 1
        return {partition: {k: t for k, (v, _, t) in self.records.items() if v <= self.polls}}

    def kv_batch_get(self, keys, partition_id, select_fields):
        return {f: [self.records[k][1][f] for k in keys] for f in select_fields}

    def kv_batch_put(self, keys, partition_id, fields):
        for f, values in fields.items():
            for k, v in zip(keys, values):
                self.records[k][1][f] = v


class _Learner:
    world_size = 1

    def __init__(self):
        self.chunks = []

    def stream_begin_batch(self, meta):
        pass

    def stream_backward(self, chunk):
        self.chunks.append((chunk[DEST_KEY], chunk[COEF_KEY].tolist(), chunk[REF_LP_KEY].clone()))

    def stream_fold(self, folds):
        pass

    def finalize_step(self, scale):
        return [{"grad_norm": 1.0}]


def _ref_value(key: str) -> float:
    return -0.1 * (KEYS.index(key) + 1)  # one distinct reference log-prob per trajectory


def test_every_row_carries_its_reference_log_probs_taken_once_on_arrival():
    tq, learner, asked = _TQ(), _Learner(), []
    for uid, rewards in REWARDS.items():
        for s, r in enumerate(rewards):
            tq.add(f"{uid}_{s}_0", r, visible_at=1 + 2 * s + (uid == "b"))

    def ref_log_probs(keys, tags):
        asked.extend(keys)
        return {k: [_ref_value(k)] * 3 for k in keys}

    planner = StreamPlanner(adv_estimator="grpo", loss_agg_mode="token-mean", max_chunk_size=4)
    ctx = StepContext(
        worker_group=learner, tq=tq, recorder=StepRecorder(None, mode="thundersync"),
        make_pipeline=lambda on_done: OpPipeline(learner, pad_token_id=0, temperature=1.0, on_done=on_done, depth=1),
        forward_at_theta_k=lambda keys, tags: {}, uids=["a", "b"], n=3, timeout_s=30.0, poll_s=0.001,
        coalesce=False, fused_forward=True, ref_log_probs=ref_log_probs)
    StreamedStep(ctx, GRPOArrivals(planner)).run()
    assert sorted(asked) == sorted(KEYS)  # each trajectory scored by the reference exactly once
    seen = []
    for dest, coefs, ref in learner.chunks:
        assert ref.shape == (len(coefs), 3)
        for row in ref:
            assert torch.all(row == row[0])  # one trajectory per row, its own values on every token
            seen.append(round(float(row[0]), 6))
    assert sorted(seen) == sorted(round(_ref_value(k), 6) for k in KEYS)  # every row once, with its own values
    assert {dest for dest, _, _ in learner.chunks} > {"direct"}  # bucket chunks carried them too


def _recipe(*overrides):
    from hydra import compose, initialize_config_dir

    from thundersync_verl.demo import recipe_dir

    base = ["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z", "mode=thundersync"]
    with initialize_config_dir(config_dir=str(recipe_dir()), version_base=None):
        return compose(config_name="grpo", overrides=base + list(overrides))


KL_ON = ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
         "actor_rollout_ref.actor.entropy_coeff=0.01"]


def test_the_recipe_with_kl_loss_and_entropy_bonus_is_accepted_with_and_without_lora():
    """With LoRA verl's reference is the actor with its adapter disabled (``ref_in_actor``); the stream takes its
    reference log-probs from the same call (``benchmarks/equivalence.py --lora-rank 8 --kl``)."""
    from thundersync_verl.step.thundersync_trainer import validate_thundersync_config

    validate_thundersync_config(_recipe(*KL_ON))
    validate_thundersync_config(_recipe(*KL_ON, "actor_rollout_ref.model.lora_rank=8"))


def test_opd_turn_streaming_with_kl_or_entropy_is_refused_naming_the_keys():
    import pytest
    from hydra import compose, initialize_config_dir

    from thundersync_verl.core import StreamingConfigError
    from thundersync_verl.demo import recipe_dir
    from thundersync_verl.step.thundersync_trainer import validate_thundersync_config

    base = ["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z", "mode=thundersync",
            "distillation.teacher_models.teacher_model.model_path=t"]
    with initialize_config_dir(config_dir=str(recipe_dir()), version_base=None):
        validate_thundersync_config(compose(config_name="opd", overrides=base))
        for extra, key in ((["actor_rollout_ref.actor.entropy_coeff=0.01"], "entropy_coeff=0"),
                           (["actor_rollout_ref.actor.use_kl_loss=true"], "use_kl_loss=false")):
            with pytest.raises(StreamingConfigError, match=key) as info:
                validate_thundersync_config(compose(config_name="opd", overrides=base + extra))
            assert "OPD turn streaming" in str(info.value)
