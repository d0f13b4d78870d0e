"""The stream planner with the estimators beyond GRPO/RLOO: replayed ops give verl's advantages.

Trajectories of random batches (uneven groups, ties, all-equal groups, varied lengths) arrive in a
random order and are planned in random chunk sizes; the coefficient each trajectory's gradient finally
enters the batch gradient with (direct, or bucket x fold), times the barrier's batch factor, is
compared with verl's own estimator on the same batch. The buffers a batch-scope estimator uses are
counted, and verl's own config (``ppo_trainer.yaml``) with each estimator is accepted or refused
naming the key.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from thundersync_harness.estimator_steps import verl_advantages
from thundersync_harness.plan_ops import effective_coefficients
from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingConfigError, batch_scale
from thundersync_verl.core.batch_estimators import Outcome
from thundersync_verl.core.estimators import REFUSED, STREAMED
from thundersync_verl.step.stream_plan import BackwardOp, FoldOp, StreamPlanner, settings_from_verl_config

NEW = ["grpo_passk", "opo", "gpg", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
ACTOR = "actor_rollout_ref.actor"


def replay(name: str, outcomes: list[Outcome], seed: int, norm: bool = True) -> tuple[dict, object, list]:
    """Arrivals in a random order; returns {(group, traj): effective coefficient}, the FinalizeOp, the ops."""
    rng = random.Random(seed)
    sizes = {}
    for o in outcomes:
        sizes[o.group] = sizes.get(o.group, 0) + 1
    planner = StreamPlanner(adv_estimator=name, norm_adv_by_std_in_grpo=norm, max_chunk_size=rng.randint(1, 4))
    planner.begin_batch(sizes)
    ops: list = []
    for o in rng.sample(outcomes, len(outcomes)):
        planner.arrive(o.group, o.traj, o.reward, o.length)
        if rng.random() < 0.6:
            ops += planner.next_ops(max_chunk_size=rng.randint(1, 4))
    while planner.ready_count or planner.pending_work():
        ops += planner.next_ops()
    ops += planner.next_ops()
    final = planner.finalize()
    return effective_coefficients(ops), final, ops


reward_st = st.sampled_from([0.0, 1.0, 0.5, -1.0, 2.0])
batch_st = st.lists(st.lists(st.tuples(reward_st, st.integers(1, 6)), min_size=2, max_size=5), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(groups=batch_st, name=st.sampled_from(NEW), seed=st.integers(0, 10_000), norm=st.booleans())
def test_replayed_ops_give_verls_advantages(groups, name, seed, norm):
    outcomes = [Outcome(g, t, r, n) for g, grp in enumerate(groups) for t, (r, n) in enumerate(grp)]
    coef, final, _ = replay(name, outcomes, seed, norm)
    expected = verl_advantages(name, outcomes, torch.float32, norm)  # verl's rows in the stream's order
    tokens = sum(o.length for o in outcomes)
    base = batch_scale("token-mean", num_tokens=tokens, num_sequences=len(outcomes), dp_size=1)
    factor = final.scale / base
    got = [coef[(o.group, o.traj)] * factor for o in outcomes]
    if name in ("grpo_passk", "opo"):
        assert got == expected and factor == 1.0  # bit for bit: the same float32 group statistics
    elif name == "gpg":  # s - mean_g folded, alpha at the barrier: one float32 rounding apart
        np.testing.assert_allclose(got, expected, rtol=3e-7, atol=0)
    else:  # batch whitening: per-trajectory sums vs verl's padded [B, T] reduction
        ulp = float(np.spacing(np.float32(max(map(abs, expected)) or 1.0)))
        assert factor == 1.0 and np.max(np.abs(np.subtract(got, expected))) <= 8 * ulp


def test_reinforce_plus_plus_buffers_one_bucket_per_distinct_reward():
    """Batch scope: every trajectory but the batch's last waits in a bucket of its reward, folded at the end."""
    outcomes = [Outcome(g, t, float((g + t) % 2), 2 + t) for g in range(4) for t in range(4)]
    _, _, ops = replay("reinforce_plus_plus", outcomes, seed=1)
    backward = [op for op in ops if isinstance(op, BackwardOp)]
    buckets = {op.dest for op in backward if op.dest != "direct"}
    assert len(buckets) == 2  # binary rewards: two buffers for the whole batch
    folds = [op for op in ops if isinstance(op, FoldOp)]
    assert len(folds) == 1 and set(folds[0].folds) == buckets
    last_fold = ops.index(folds[0])
    assert all(op.dest == "direct" for op in ops[last_fold + 1 :] if isinstance(op, BackwardOp))


def test_baseline_variant_keys_buckets_by_group_and_reward():
    outcomes = [Outcome(g, t, float(t % 2), 3) for g in range(3) for t in range(4)]
    _, _, ops = replay("reinforce_plus_plus_baseline", outcomes, seed=5)
    buckets = {op.dest for op in ops if isinstance(op, BackwardOp) and op.dest != "direct"}
    assert 4 <= len(buckets) <= 6  # (group, reward) classes: 3 groups x 2 rewards, the last direct


@pytest.fixture(scope="module")
def grpo_config():
    return va.compose_ppo_config([
        "algorithm.adv_estimator=grpo", "data.train_batch_size=8", f"{ACTOR}.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=4", f"{ACTOR}.ppo_micro_batch_size_per_gpu=4",
    ])


def _with(config, **changes):
    cfg = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


@pytest.mark.parametrize("name", STREAMED)
def test_verl_config_with_each_streamed_estimator_is_accepted(grpo_config, name):
    settings = settings_from_verl_config(_with(grpo_config, **{"algorithm.adv_estimator": name}))
    planner = StreamPlanner.from_settings(settings)
    assert planner.estimator.verl_name == name


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_verl_config_with_a_refused_estimator_names_key_reason_and_fix(grpo_config, name):
    with pytest.raises(StreamingConfigError) as err:
        settings_from_verl_config(_with(grpo_config, **{"algorithm.adv_estimator": name}))
    text = str(err.value)
    assert f"algorithm.adv_estimator={name!r}" in text and REFUSED[name] in text and "fix: set algorithm" in text


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"algorithm.adv_estimator": "reinforce_plus_plus", "algorithm.gamma": 0.99}, "set algorithm.gamma=1.0"),
        ({"algorithm.adv_estimator": "opo", f"{ACTOR}.ppo_mini_batch_size": 4}, "ppo_mini_batch_size = data.train"),
        ({"algorithm.adv_estimator": "reinforce_plus_plus_baseline", f"{ACTOR}.ppo_epochs": 2}, "ppo_epochs=1"),
        ({"algorithm.adv_estimator": "grpo_passk", "actor_rollout_ref.rollout.n": 1}, "rollout.n >= 2"),
    ],
)
def test_estimator_settings_that_cannot_stream_are_refused(grpo_config, changes, match):
    with pytest.raises(StreamingConfigError, match=match) as err:
        settings_from_verl_config(_with(grpo_config, **changes))
    assert "fix:" in str(err.value)


def test_group_estimators_still_stream_with_mini_batches(grpo_config):
    cfg = _with(grpo_config, **{"algorithm.adv_estimator": "grpo_passk", f"{ACTOR}.ppo_mini_batch_size": 4})
    assert settings_from_verl_config(cfg).estimator.verl_name == "grpo_passk"
