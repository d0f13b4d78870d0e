"""In-memory stand-ins for a streamed step's surroundings, without Ray: a TransferQueue whose records become
visible at a given poll, and a one-rank learner that records every call it gets. What runs against them is the
real step (``step/streamed_step.py``): polling, the real planner, pipeline and chunk building."""

from __future__ import annotations

import torch

from thundersync_verl.run.step_record import StepRecorder
from thundersync_verl.step.chunk_layout import COEF_KEY, DEST_KEY
from thundersync_verl.step.stream_exec import OpPipeline
from thundersync_verl.step.stream_plan import StreamPlanner
from thundersync_verl.step.streamed_step import GRPOArrivals, StepContext, StreamedStep


class FakeTQ:
    """The TransferQueue surface the step uses; a record is listed from its ``visible_at`` poll on."""

    def __init__(self):
        self.records: dict[str, tuple[int, dict, dict]] = {}
        self.polls = 0
        self.gets, self.puts = [], []  # (keys, fields) of each read and write: round trips to the controller

    def add(self, key: str, reward: float, visible_at: int, *, status: str = "success", is_prompt: bool = False):
        fields = {"prompts": torch.tensor([1, 2]), "responses": torch.tensor([3, 4, 5]),
                  "response_mask": torch.tensor([1, 1, 0]), "rm_scores": torch.tensor([0.0, 0.0, reward]),
                  "extra_fields": {}, "rollout_log_probs": torch.tensor([-0.5, -0.5, -0.5])}
        self.records[key] = (visible_at, fields, {"status": status, "is_prompt": is_prompt})

    def kv_list(self, partition):
        self.polls += 1
        return {partition: {k: t for k, (v, _, t) in self.records.items() if v <= self.polls}}

    def kv_batch_get(self, keys, partition_id, select_fields):
        self.gets.append((list(keys), list(select_fields)))
        return {f: [self.records[k][1][f] for k in keys] for f in select_fields}

    def kv_batch_put(self, keys, partition_id, fields):
        self.puts.append((list(keys), list(fields)))
        for f, values in fields.items():
            for k, v in zip(keys, values):
                self.records[k][1][f] = v


class FakeLearner:
    """The streaming worker group, one rank: records every chunk, fold and step."""

    world_size = 1

    def __init__(self, fail_on_chunk: int | None = None):
        self.calls, self.steps, self.fail_on_chunk = [], [], fail_on_chunk

    def stream_begin_batch(self, meta):
        self.calls.append(("begin", meta["loss_agg_mode"]))
        self.meta = dict(meta)

    def stream_backward(self, chunk):
        if self.fail_on_chunk is not None and sum(c[0] == "backward" for c in self.calls) == self.fail_on_chunk:
            raise RuntimeError("learner refused the chunk")
        coefs = chunk[COEF_KEY].tolist()
        self.calls.append(("backward", chunk[DEST_KEY], [c for c in coefs if c != 0.0]))

    def stream_fold(self, folds):
        self.calls.append(("fold", dict(folds)))

    def finalize_step(self, scale):
        self.steps.append(scale)
        return [{"grad_norm": 1.0, "lr": 1e-3}]


def grpo_step(tq: FakeTQ, learner: FakeLearner, uids: list[str], n: int, *, timeout_s: float = 30.0, coalesce: bool = True,
          budget_buckets: int | None = None, deterministic: bool = False, lost_nodes=None, tail=None):
    sizing = {} if budget_buckets is None else {"grad_numel": 1, "budget_bytes": 4 * (budget_buckets + 1)}
    planner = StreamPlanner(adv_estimator="grpo", loss_agg_mode="seq-mean-token-sum", max_chunk_size=4, **sizing)
    ctx = StepContext(
        worker_group=learner, tq=tq, recorder=StepRecorder(None, mode="thundersync"),
        make_pipeline=lambda on_done: OpPipeline(learner, pad_token_id=0, temperature=1.0, on_done=on_done, depth=1),
        forward_at_theta_k=lambda keys, tags: {}, uids=uids, n=n, timeout_s=timeout_s, poll_s=0.001,
        coalesce=coalesce, fused_forward=True, memory_budget_bytes=None if budget_buckets is None else 4 * budget_buckets,
        deterministic=deterministic, lost_nodes=lost_nodes, tail=tail)
    return StreamedStep(ctx, GRPOArrivals(planner))


def effective_coefficients(calls: list) -> list[float]:
    """Each trajectory's coefficient as the learner applied it: a direct row carries A_i; a bucket row carries 1 and
    its bucket is folded with A(r) when the group closes."""
    effective, bucket_rows = [], {}
    for call in calls:
        if call[0] == "backward" and call[1] == "direct":
            effective += call[2]
        elif call[0] == "backward":
            assert call[2] == [1.0] * len(call[2])
            bucket_rows[call[1]] = bucket_rows.get(call[1], 0) + len(call[2])
        elif call[0] == "fold":
            for key, coef in call[1].items():
                effective += [coef] * bucket_rows.pop(key)
    assert bucket_rows == {}  # every bucket folded
    return effective


def grpo_advantages(rewards: dict) -> list[float]:
    """verl's GRPO advantage of every trajectory, sorted: (r - mean) / (unbiased std + eps) per group."""
    expected = []
    for values in rewards.values():
        r = torch.tensor(values)
        expected += ((r - r.mean()) / (r.std() + 1e-6)).tolist()
    return sorted(expected)
