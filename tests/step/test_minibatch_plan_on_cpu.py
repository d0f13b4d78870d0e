"""The mini-batch planner: which ops it emits and when, for 1..4 mini-batches and uneven arrivals. No GPU, no Ray.

Each trajectory gets a random stand-in gradient g_i; the ops are replayed on them exactly as the learner
runs them (direct / bucket backward, fold, PPO chunk, step). Every optimizer step must then hold
c_j * sum_{i in mini-batch j} A_i g_i and nothing else: the mini-batch's own trajectories, each once, with
verl's GRPO advantage and the mini-batch's normaliser.
"""

from __future__ import annotations

import random

import pytest
import torch

from thundersync_verl.core import StreamingConfigError, StreamingStateError
from thundersync_verl.step.minibatch_plan import MiniBatchPlanner, PPOBackwardOp, StepOp
from thundersync_verl.step.stream_plan import BackwardOp, FoldOp, StreamPlanner, independent_key

N = 4  # trajectories per group


def _batch(groups: int, seed: int):
    rng = random.Random(seed)
    trajs = []
    for g in range(groups):
        rewards = [float(rng.random() < 0.5) for _ in range(N)]
        for t in range(N):
            trajs.append((f"p{g}", f"p{g}_{t}", rewards[t], rng.randint(1, 9)))
    order = list(range(len(trajs)))
    rng.shuffle(order)  # groups interleave: they complete in an order unrelated to their ids
    return trajs, order


def _grpo(rewards):
    r = torch.tensor(rewards, dtype=torch.float32)
    return ((r - r.mean()) / (r.std() + 1e-6)).tolist()


def _planner(mb_groups: int, epochs: int = 1, chunk: int = 3) -> MiniBatchPlanner:
    return MiniBatchPlanner(StreamPlanner(max_chunk_size=chunk), minibatch_groups=mb_groups, epochs=epochs)


class Learner:
    """Replays ops on stand-in gradients as the streaming worker would; records each step's gradient."""

    def __init__(self, grads):
        self.g, self.grad, self.buckets, self.steps = grads, torch.zeros(5, dtype=torch.float64), {}, []
        self.kinds = []

    def run(self, op):
        if isinstance(op, (BackwardOp, PPOBackwardOp)):
            part = sum(c * self.g[t] for (_, t), c in zip(op.items, op.coefs))
            if op.dest == "direct":
                self.grad += part
            else:
                self.buckets[op.dest] = self.buckets.get(op.dest, 0) + part
            self.kinds.append(("ppo" if isinstance(op, PPOBackwardOp) else "stream", op))
        elif isinstance(op, FoldOp):
            for key, coef in op.folds.items():
                self.grad += coef * self.buckets.pop(key)
        elif isinstance(op, StepOp):
            self.step(op.scale, op)
        else:
            raise AssertionError(f"unexpected op {op!r}")

    def step(self, scale, op):
        assert not self.buckets, "a step with unfolded buckets"
        self.steps.append((scale * self.grad, op))
        self.grad = torch.zeros_like(self.grad)


def _run(planner, trajs, order, every: int):
    """Arrivals in ``order``; next_ops every ``every`` arrivals. Returns the learner and the op calls per arrival."""
    gen = torch.Generator().manual_seed(7)
    learner = Learner({t: torch.randn(5, generator=gen, dtype=torch.float64) for _, t, _, _ in trajs})
    planner.begin_batch({g: N for g in sorted({g for g, *_ in trajs})})
    calls, completion = [], []
    for k, i in enumerate(order):
        gid, tid, reward, tokens = trajs[i]
        planner.arrive(gid, tid, reward, tokens)
        if sum(1 for g, *_ in (trajs[j] for j in order[: k + 1]) if g == gid) == N:
            completion.append(gid)
        if (k + 1) % every == 0 or k + 1 == len(order):
            ops = planner.next_ops()
            calls.append((k + 1, ops))
            for op in ops:
                learner.run(op)
    assert planner.ready_count == 0
    final = planner.finalize()
    learner.step(final.scale, final)
    return learner, calls, completion


@pytest.mark.parametrize("groups, mb_groups", [(4, 4), (4, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("every", [1, 3])
def test_every_step_holds_its_mini_batch_once_with_its_normaliser(groups, mb_groups, every):
    trajs, order = _batch(groups, seed=groups * 10 + mb_groups + every)
    learner, _, completion = _run(_planner(mb_groups), trajs, order, every)
    k = groups // mb_groups
    assert len(learner.steps) == k
    by_group = {}
    for gid, tid, reward, tokens in trajs:
        by_group.setdefault(gid, []).append((tid, reward, tokens))
    for j, (grad, op) in enumerate(learner.steps):
        members = completion[j * mb_groups:(j + 1) * mb_groups]  # the next complete groups, in completion order
        expected, tokens = torch.zeros(5, dtype=torch.float64), 0
        for gid in members:
            rows = sorted(by_group[gid])
            for (tid, _, n), a in zip(rows, _grpo([r for _, r, _ in rows])):
                expected += a * learner.g[tid]
                tokens += n
        assert op.scale == pytest.approx(1.0 / tokens, rel=1e-12)
        torch.testing.assert_close(grad, expected / tokens, rtol=1e-6, atol=1e-9)


def test_later_mini_batches_run_ppo_chunks_after_the_previous_step_and_only_the_last_steps_the_lr():
    trajs, order = _batch(4, seed=3)
    planner = _planner(mb_groups=1, epochs=1)
    learner, calls, _ = _run(planner, trajs, order, every=2)
    flat = [op for _, ops in calls for op in ops]
    steps = [op for op in flat if isinstance(op, StepOp)]
    assert [s.minibatch for s in steps] == [1, 2, 3] and not any(s.lr_step for s in steps)
    assert [s.policy_lag for s in planner.steps] == [0, 1, 2, 3] and planner.steps[-1].lr_step
    for op in flat:  # mini-batch 1 streams (ratio 1), every later row runs the PPO loss after its predecessor step
        if isinstance(op, PPOBackwardOp):
            assert op.minibatch >= 2 and op.dest == "direct"
            assert flat.index(op) > flat.index(steps[op.minibatch - 2])
    metrics = planner.metrics()
    assert metrics["thundersync/optimizer_steps"] == 4 and metrics["thundersync/minibatch_policy_lag/max"] == 3


def test_open_buckets_of_groups_outside_mini_batch_1_are_dropped_and_rerun():
    # groups a and b interleave; a completes first and alone fills mini-batch 1 (1 group per mini-batch)
    trajs = [("a", f"a{i}", float(i % 2), 2) for i in range(N)] + [("b", f"b{i}", float(i < 2), 3) for i in range(N)]
    order = [4, 0, 5, 1, 2, 3, 6, 7]  # b0 a0 b1 a1 a2 a3 | b2 b3
    planner = _planner(mb_groups=1)
    learner, calls, completion = _run(planner, trajs, order, every=1)
    assert completion == ["a", "b"]
    drops = [op for _, ops in calls for op in ops if isinstance(op, FoldOp) and op.group_id == "b"]
    assert len(drops) == 1 and set(drops[0].folds.values()) == {0.0}  # b's buckets freed, not folded
    assert planner.metrics()["thundersync/minibatch_rerun_rows"] == 2  # b0, b1 ran at θ_k and run again
    ppo_rows = [t for kind, op in learner.kinds if kind == "ppo" for _, t in op.items]
    assert sorted(ppo_rows) == ["b0", "b1", "b2", "b3"]


def test_later_epochs_start_after_the_last_arrival_on_the_same_partition():
    trajs, order = _batch(4, seed=11)
    planner = _planner(mb_groups=2, epochs=3)
    learner, calls, completion = _run(planner, trajs, order, every=1)
    assert len(learner.steps) == 6
    last = len(order)
    for at, ops in calls:
        assert all(op.epoch == 1 for op in ops if isinstance(op, (PPOBackwardOp, StepOp))) or at == last
    epoch_rows = {}
    for kind, op in learner.kinds:
        if kind == "ppo":
            epoch_rows.setdefault((op.epoch, op.minibatch), set()).update(t for _, t in op.items)
    for mb in (1, 2):  # each epoch replays the same mini-batches
        assert epoch_rows[(2, mb)] == epoch_rows[(3, mb)]
    assert epoch_rows[(2, 2)] == epoch_rows[(1, 2)]
    assert {g for g, _ in ((t.split("_")[0], t) for t in epoch_rows[(2, 1)])} == set(completion[:2])
    first, third = learner.steps[0][0], learner.steps[4][0]  # epoch 3 mini-batch 1 = epoch 1 mini-batch 1
    torch.testing.assert_close(first, third, rtol=1e-6, atol=1e-9)


def test_refusals():
    planner = _planner(mb_groups=3)
    with pytest.raises(StreamingConfigError, match="cannot be cut into mini-batches of 3 groups"):
        planner.begin_batch({"a": N, "b": N, "c": N, "d": N})
    planner = _planner(mb_groups=1)
    planner.begin_batch({"a": N, "b": N})
    planner.arrive("a", "a0", 1.0, 3)
    planner.next_ops()
    with pytest.raises(StreamingStateError, match="mini-batch 1 of epoch 1 is not complete"):
        planner.finalize()


class TermsLearner(Learner):
    """The learner with a KL/entropy part h_i per row (advantage-free), split as the streaming worker splits it:
    direct and PPO chunks carry A_i g_i + h_i; a bucketed chunk puts g_i in the bucket and h_i in its companion."""

    def __init__(self, grads, extra):
        super().__init__(grads)
        self.h = extra

    def run(self, op):
        if isinstance(op, (BackwardOp, PPOBackwardOp)) and op.dest != "direct":
            super().run(op)
            companion = independent_key(op.dest)
            self.buckets[companion] = self.buckets.get(companion, 0) + sum(self.h[t] for _, t in op.items)
        elif isinstance(op, (BackwardOp, PPOBackwardOp)):
            super().run(op)
            self.grad += sum(self.h[t] for _, t in op.items)
        else:
            super().run(op)


@pytest.mark.parametrize("groups, mb_groups, every", [(4, 1, 1), (4, 2, 3), (6, 2, 1)])
def test_kl_entropy_parts_follow_their_rows_into_their_own_mini_batch(groups, mb_groups, every):
    trajs, order = _batch(groups, seed=groups + 5 * mb_groups + every)
    planner = MiniBatchPlanner(StreamPlanner(max_chunk_size=3), minibatch_groups=mb_groups, independent_buckets=True)
    gen = torch.Generator().manual_seed(5)
    h = {t: torch.randn(5, generator=gen, dtype=torch.float64) for _, t, _, _ in trajs}
    base, _, completion = _run(MiniBatchPlanner(StreamPlanner(max_chunk_size=3), minibatch_groups=mb_groups),
                               trajs, order, every)
    learner = TermsLearner(base.g, h)
    planner.begin_batch({g: N for g in sorted({g for g, *_ in trajs})})
    for k, i in enumerate(order):
        planner.arrive(*trajs[i])
        if (k + 1) % every == 0 or k + 1 == len(order):
            for op in planner.next_ops():
                learner.run(op)
    final = planner.finalize()
    learner.step(final.scale, final)
    assert planner.metrics()["thundersync/minibatch_rerun_rows"] > 0 or mb_groups == groups
    by_group = {}
    for gid, tid, reward, tokens in trajs:
        by_group.setdefault(gid, []).append((tid, reward, tokens))
    for j, ((grad, op), (grad_plain, _)) in enumerate(zip(learner.steps, base.steps)):
        members = completion[j * mb_groups:(j + 1) * mb_groups]
        extra = sum(h[tid] for gid in members for tid, _, _ in by_group[gid])  # each row's h once, in its mini-batch
        torch.testing.assert_close(grad, grad_plain + op.scale * extra, rtol=1e-9, atol=1e-12)
