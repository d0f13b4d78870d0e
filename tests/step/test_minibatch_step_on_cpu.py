"""The streamed step with several mini-batches (``StreamedStep`` + ``MiniBatchPlanner``), without Ray.

The TransferQueue and the learner are small in-memory stand-ins; under test are the real step loop, the
real planners, ``OpPipeline`` and the chunk building: mini-batch 1 streams, its step comes in the op
stream (no LR step) and opens a new learner batch, the later mini-batch runs as PPO chunks carrying the
rollout's log-probs, and the last step is the batch's (LR step). Also the trainer's config rules.
"""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from thundersync_verl import verl_adapter as va
from thundersync_verl.config import ThunderSyncConfig
from thundersync_verl.core import StreamingConfigError
from thundersync_verl.demo import recipe_dir
from thundersync_verl.learner.minibatch_loss import PPO_KEY
from thundersync_verl.step.minibatch_plan import MiniBatchPlanner
from thundersync_verl.run.step_record import StepRecorder
from thundersync_verl.step.stream_exec import OpPipeline
from thundersync_verl.step.chunk_layout import COEF_KEY, DEST_KEY, ROLLOUT_LP_KEY
from thundersync_verl.step.stream_plan import StreamPlanner
from thundersync_verl.step.streamed_step import GRPOArrivals, StepContext, StreamedStep
from thundersync_verl.step.grpo_algorithm import build_planner
from thundersync_verl.step.thundersync_trainer import validate_thundersync_config


class _TQ:
    """TransferQueue stand-in: a record is listed from its ``visible_at`` poll on."""

    def __init__(self):
        self.records, self.polls = {}, 0

    def add(self, key: str, reward: float, visible_at: int, lp: float):
        fields = {"prompts": torch.tensor([1, 2]), "responses": torch.tensor([3, 4, 5]),
                  "response_mask": torch.tensor([1, 1, 1]), "rm_scores": torch.tensor([0.0, 0.0, reward]),
                  "extra_fields": {}, "rollout_log_probs": torch.tensor([lp, lp, lp])}
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
    """One-rank learner stand-in: records every call in order."""

    world_size = 1

    def __init__(self):
        self.calls = []

    def stream_begin_batch(self, meta):
        self.calls.append(("begin",))

    def stream_backward(self, chunk):
        ppo = bool(va.non_tensor(chunk, PPO_KEY, False))
        old = va.padded_fields(chunk, ROLLOUT_LP_KEY)[ROLLOUT_LP_KEY] if ppo else None
        self.calls.append(("ppo" if ppo else "backward", chunk[DEST_KEY], chunk[COEF_KEY].tolist(), old))

    def stream_fold(self, folds):
        self.calls.append(("fold", dict(folds)))

    def finalize_step(self, scale, lr_step=True):
        self.calls.append(("step", scale, lr_step))
        peak = 0 if lr_step else 4096  # mini-batch 1 held b0's bucket; the last mini-batch holds none
        return [{"grad_norm": 1.0, "lr": 1e-3, "thundersync/peak_bucket_bytes": peak}]


def test_two_mini_batches_step_twice_the_second_as_ppo_chunks_after_the_first_step():
    tq, learner = _TQ(), _Learner()
    for s, visible in enumerate([1, 3, 5]):  # group a lands first and completes first
        tq.add(f"a_{s}_0", float(s == 1), visible, lp=-0.25)
    for s, visible in enumerate([2, 7, 9]):  # b0 lands while mini-batch 1 fills: bucketed, then dropped
        tq.add(f"b_{s}_0", float(s == 0), visible, lp=-0.75)
    planner = MiniBatchPlanner(StreamPlanner(loss_agg_mode="token-mean", max_chunk_size=4), minibatch_groups=1)
    ctx = StepContext(
        worker_group=learner, tq=tq, recorder=StepRecorder(None, mode="thundersync"),
        make_pipeline=lambda on_done: OpPipeline(learner, pad_token_id=0, temperature=1.0, on_done=on_done, depth=1),
        forward_at_theta_k=lambda keys, tags: {}, uids=["a", "b"], n=3, timeout_s=30.0, poll_s=0.001,
        coalesce=False, fused_forward=True)
    step = StreamedStep(ctx, GRPOArrivals(planner))
    out, state = step.run()
    metrics = step.metrics(out)
    kinds = [c[0] for c in learner.calls]
    first_step = kinds.index("step")
    assert learner.calls[first_step] == ("step", pytest.approx(1 / 9), False)  # a's 9 tokens, no LR step
    assert learner.calls[-1] == ("step", pytest.approx(1 / 9), True)  # b's 9 tokens: the batch's last step
    assert kinds[first_step + 1] == "begin" and kinds.count("step") == 2
    assert "ppo" not in kinds[:first_step] and "backward" not in kinds[first_step:]
    drops = [c[1] for c in learner.calls[:first_step] if c[0] == "fold" and set(c[1].values()) == {0.0}]
    assert len(drops) == 1 and all(k.startswith("g='b'") for k in drops[0])
    ppo = [c for c in learner.calls if c[0] == "ppo"]
    coefs = [x for c in ppo for x in c[2] if x != 0.0]
    r = torch.tensor([1.0, 0.0, 0.0])
    assert sorted(coefs) == pytest.approx(sorted(((r - r.mean()) / (r.std() + 1e-6)).tolist()), abs=1e-6)
    assert all(bool((c[3] == -0.75).all()) for c in ppo)  # old log-probs: b's rollout log-probs
    assert state.minibatch_steps == 1
    assert metrics["thundersync/optimizer_steps"] == 2 and metrics["thundersync/minibatch_policy_lag/max"] == 1
    assert metrics["thundersync/minibatch_rerun_rows"] == 1
    assert metrics["thundersync/peak_bucket_bytes"] == 4096  # the batch's peak, not its last mini-batch's


BASE = ["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z", "mode=thundersync"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(recipe_dir()), version_base=None):
        return compose(config_name="grpo", overrides=BASE + list(overrides))


def test_the_trainer_builds_the_mini_batch_planner_and_needs_the_fused_forward():
    cfg = _cfg("actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_epochs=2")
    planner = build_planner(cfg, validate_thundersync_config(cfg))
    assert isinstance(planner, MiniBatchPlanner) and planner.mb_groups == 2 and planner.epochs == 2
    assert isinstance(build_planner(_cfg(), ThunderSyncConfig.from_verl(_cfg())), StreamPlanner)
    with pytest.raises(StreamingConfigError, match=r"4 mini-batches x 1 epochs per batch need "
                                                   r"thundersync.learner_forward=fused(.|\n)*fix: set thundersync"):
        validate_thundersync_config(_cfg("actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                         "thundersync.learner_forward=separate"))
