"""Property tests: streamed gradient == verl's batch-synchronous gradient (CPU, no GPU).

Random group sizes, reward patterns (binary, ties, continuous, constant), estimators, loss
aggregation modes, streaming modes and arrival orders, on a policy whose log-probs are linear
in the parameters; the oracle runs verl's own advantage estimator, vanilla policy loss,
kl_penalty and agg_loss. float64, so any error above rounding is a real mismatch.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thundersync_verl.core import GRPOEstimator, RLOOEstimator, StreamingGradientAccumulator, kl_per_token, token_weights

MODES = ("affine", "buckets", "pending", "chunked", "canonical")
AGG = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ESTIMATORS = {"grpo": lambda: GRPOEstimator(True), "grpo_no_std": lambda: GRPOEstimator(False), "rloo": RLOOEstimator}
KL_COEF = 0.1
LSF = 7.0


def _rewards(pattern: str, n: int, rng: random.Random) -> list[float]:
    if pattern == "binary":
        return [float(rng.random() < 0.5) for _ in range(n)]
    if pattern == "ties":
        return [rng.choice([-1.0, 0.25, 3.0]) for _ in range(n)]
    if pattern == "constant":
        return [2.5] * n
    return [rng.gauss(5.0, 2.0) for _ in range(n)]  # continuous, away from zero


def make_case(seed: int, sizes: list[int], pattern: str, linear_model):
    rng = random.Random(seed)
    gids, tids, rewards, lengths = [], [], [], []
    for gid, n in enumerate(sizes):
        for tid, r in enumerate(_rewards(pattern, n, rng)):
            gids.append(gid)
            tids.append(tid)
            rewards.append(r)
            lengths.append(rng.randint(1, 5))
    model = linear_model(seed, max(lengths), len(gids))
    mask = torch.zeros(len(gids), max(lengths), dtype=torch.bool)
    for b, n_tok in enumerate(lengths):
        mask[b, :n_tok] = True
    ref = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) - 2.0
    return model, gids, tids, rewards, lengths, mask, ref


def verl_oracle(model, gids, rewards, mask, ref, estimator: str, agg: str, kl_type: str) -> list[torch.Tensor]:
    from verl.trainer.ppo import core_algos as ca
    from verl.workers.config import ActorConfig

    logp = model(list(range(len(gids))))  # [B, T]
    token_rewards = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(len(gids)):
        token_rewards[b, int(mask[b].sum()) - 1] = rewards[b]
    index = np.array(gids)
    if estimator == "rloo":
        adv, _ = ca.compute_rloo_outcome_advantage(token_rewards, mask.double(), index)
    else:
        adv, _ = ca.compute_grpo_outcome_advantage(
            token_rewards, mask.double(), index, norm_adv_by_std_in_grpo=estimator == "grpo"
        )
    lsf = LSF if agg == "seq-mean-token-sum-norm" else None
    cfg = ActorConfig(strategy="fsdp2", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                      use_dynamic_bsz=False, loss_agg_mode=agg, loss_scale_factor=lsf)
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=lsf)
    loss, _ = ca.get_policy_loss_fn("vanilla")(logp.detach(), logp, adv, mask, agg, cfg, None)
    kl = ca.kl_penalty(logp, ref, kl_type)
    loss = loss + KL_COEF * ca.agg_loss(kl, mask, agg, **cfg.global_batch_info)
    model.zero_grad()
    loss.backward()
    out = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad()
    return out


def _row_terms(model, rows, mask, ref, agg, kl_type):
    logp = model(rows)  # [R, T]
    m = mask[rows]
    w = token_weights(agg, m, dtype=logp.dtype)  # [R, T]
    surrogate = (logp * w).sum(dim=-1)  # [R]
    indep = KL_COEF * (kl_per_token(logp, ref[rows], kl_type) * w).sum()
    return surrogate, indep


def _grads(model):
    out = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad()
    return out


def stream(model, gids, tids, rewards, lengths, mask, ref, estimator, agg, kl_type, mode, order, **acc_kwargs):
    lsf = LSF if agg == "seq-mean-token-sum-norm" else None
    acc = StreamingGradientAccumulator(
        list(model.parameters()), estimator=ESTIMATORS[estimator](), loss_agg_mode=agg, loss_scale_factor=lsf,
        path="buckets" if mode == "buckets" else "auto", canonical_order=mode == "canonical",
        independent_terms=mode == "canonical", **acc_kwargs,
    )
    sizes: dict[int, int] = {}
    for g in gids:
        sizes[g] = sizes.get(g, 0) + 1
    acc.begin_batch(sizes)
    model.zero_grad()
    if mode == "chunked":
        _stream_chunked(acc, model, gids, tids, rewards, lengths, mask, ref, agg, kl_type, order)
        return acc
    late = []
    for b in order:
        surrogate, indep = _row_terms(model, [b], mask, ref, agg, kl_type)
        surrogate.sum().backward(retain_graph=True)
        reward = None if mode == "pending" else rewards[b]
        acc.add_policy_grad(gids[b], tids[b], _grads(model), lengths[b], reward=reward)
        indep.backward()
        acc.add_independent_grad(_grads(model), key=(gids[b], tids[b]) if mode == "canonical" else None)
        if mode == "pending":
            late.append(b)
            if len(late) > 2:
                c = late.pop(0)
                acc.report_reward(gids[c], tids[c], rewards[c])
    for c in late:
        acc.report_reward(gids[c], tids[c], rewards[c])
    return acc


def _stream_chunked(acc, model, gids, tids, rewards, lengths, mask, ref, agg, kl_type, order):
    row_of = {(gids[b], tids[b]): b for b in range(len(gids))}
    ready = []
    for i, b in enumerate(order):
        acc.report_reward(gids[b], tids[b], rewards[b])
        ready.append((gids[b], tids[b]))
        if (i + 1) % 3 and i + 1 < len(order):
            continue
        chunks, ready = acc.split_into_chunks(ready, 4)
        for chunk in chunks:
            plan = acc.plan_chunk(chunk)
            rows = [row_of[it] for it in chunk]
            surrogate, indep = _row_terms(model, rows, mask, ref, agg, kl_type)
            loss = (torch.tensor(plan.loss_weights, dtype=torch.float64) * surrogate).sum()
            if plan.destination == "direct":
                (loss + indep).backward()
                acc.add_chunk_grad(plan, _grads(model), [lengths[r] for r in rows])
            else:
                loss.backward(retain_graph=True)
                acc.add_chunk_grad(plan, _grads(model), [lengths[r] for r in rows])
                indep.backward()
                acc.add_independent_grad(_grads(model))


def rel_err(a, b) -> float:
    num = sum(float(((x - y) ** 2).sum()) for x, y in zip(a, b)) ** 0.5
    den = sum(float((y**2).sum()) for y in b) ** 0.5
    return num / den if den > 0 else num


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    pattern=st.sampled_from(["binary", "ties", "continuous", "constant"]),
    estimator=st.sampled_from(sorted(ESTIMATORS)),
    agg=st.sampled_from(AGG),
    mode=st.sampled_from(MODES),
    kl_type=st.sampled_from(["k1", "k2", "low_var_kl", "abs", "k3+"]),
    seed=st.integers(0, 10_000),
)
def test_streamed_equals_verl_oracle(linear_model, sizes, pattern, estimator, agg, mode, kl_type, seed):
    model, gids, tids, rewards, lengths, mask, ref = make_case(seed, sizes, pattern, linear_model)
    expected = verl_oracle(model, gids, rewards, mask, ref, estimator, agg, kl_type)
    order = list(range(len(gids)))
    random.Random(seed).shuffle(order)
    acc = stream(model, gids, tids, rewards, lengths, mask, ref, estimator, agg, kl_type, mode, order)
    got = acc.compute_batch_gradient()
    assert rel_err(got, expected) <= 1e-12
    assert acc.pending_work() == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(2, 5), min_size=2, max_size=4),
    agg=st.sampled_from(AGG),
    estimator=st.sampled_from(sorted(ESTIMATORS)),
    seed=st.integers(0, 10_000),
)
def test_data_parallel_split_averages_to_oracle(linear_model, sizes, agg, estimator, seed):
    """Two ranks each stream their members; global counts + dp_size + a MEAN reduce == oracle."""
    model, gids, tids, rewards, lengths, mask, ref = make_case(seed, sizes, "ties", linear_model)
    expected = verl_oracle(model, gids, rewards, mask, ref, estimator, agg, "k1")
    rank_of = [b % 2 for b in range(len(gids))]
    total_tokens, total_seqs = sum(lengths), len(lengths)
    rank_grads = []
    for rank in (0, 1):
        local: dict[int, list[int]] = {}
        for b in range(len(gids)):
            if rank_of[b] == rank:
                local.setdefault(gids[b], []).append(tids[b])
        lsf = LSF if agg == "seq-mean-token-sum-norm" else None
        acc = StreamingGradientAccumulator(list(model.parameters()), estimator=ESTIMATORS[estimator](),
                                           loss_agg_mode=agg, loss_scale_factor=lsf)
        acc.begin_batch({g: sizes[g] for g in range(len(sizes))}, local_members=local)
        for b in range(len(gids)):
            if rank_of[b] != rank:
                acc.report_reward(gids[b], tids[b], rewards[b])  # rewards are shared across ranks
                continue
            surrogate, indep = _row_terms(model, [b], mask, ref, agg, "k1")
            surrogate.sum().backward(retain_graph=True)
            acc.add_policy_grad(gids[b], tids[b], _grads(model), lengths[b], reward=rewards[b])
            indep.backward()
            acc.add_independent_grad(_grads(model))
        rank_grads.append(acc.compute_batch_gradient(dp_size=2, global_num_tokens=total_tokens,
                                                     global_num_sequences=total_seqs))
    averaged = [(a + b) / 2 for a, b in zip(*rank_grads)]
    assert rel_err(averaged, expected) <= 1e-12


@pytest.mark.parametrize("mode", ["affine", "buckets", "canonical"])
def test_far_from_zero_rewards_keep_precision(linear_model, mode):
    """Rewards around 1e4 with unit spread: the shifted affine fold must not cancel digits."""
    model, gids, tids, _, lengths, mask, ref = make_case(3, [5, 4, 6], "continuous", linear_model)
    rng = random.Random(0)
    rewards = [1e4 + rng.gauss(0, 1) for _ in gids]
    expected = verl_oracle(model, gids, rewards, mask, ref, "grpo", "token-mean", "k1")
    order = list(range(len(gids)))
    rng.shuffle(order)
    acc = stream(model, gids, tids, rewards, lengths, mask, ref, "grpo", "token-mean", "k1", mode, order)
    assert rel_err(acc.compute_batch_gradient(), expected) <= 1e-11
