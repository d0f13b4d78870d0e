"""Sign buckets through every route (direct, buckets, pending, chunks, canonical).

Each trajectory has two gradients, one per sign class of PPO's clip; the exact update uses
the class of its final advantage: g = scale * sum_i (-A_i) H_i^{sign(A_i)}. Synthetic
gradients keep this fast; the token weights themselves are checked against verl in
test_corrections_on_cpu.py.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync_verl.core import NEG, POS, GRPOEstimator, RLOOEstimator, StreamingGradientAccumulator

SHAPES = [(3, 2), (4,)]


def _vec(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]


def _oracle(est, sizes, rewards, grads, lengths):
    total = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for gid, n in enumerate(sizes):
        adv = est.advantages([rewards[(gid, t)] for t in range(n)])
        for t, a in enumerate(adv):
            if a != 0:
                h = grads[(gid, t)][POS if a > 0 else NEG]
                for x, y in zip(total, h):
                    x.add_(y, alpha=-a)
    scale = 1.0 / sum(lengths.values())
    return [x * scale for x in total]


def _sum(parts):
    out = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for p in parts:
        for x, y in zip(out, p):
            x.add_(y)
    return out


def _feed(acc, mode, order, rewards, grads, lengths):
    ready = []
    for i, item in enumerate(order):
        gid, tid = item
        if mode == "chunked":
            acc.report_reward(gid, tid, rewards[item])
            ready.append(item)
            if (i + 1) % 3 and i + 1 < len(order):
                continue
            chunks, ready = acc.split_into_chunks(ready, 3)
            for chunk in chunks:
                plan = acc.plan_chunk(chunk)
                n_tok = [lengths[it] for it in chunk]
                if plan.destination == "direct":
                    parts = [[w * x for x in grads[it][s]] for it, w, s in zip(chunk, plan.loss_weights, plan.sign_classes) if s]
                    acc.add_chunk_grad(plan, _sum(parts), n_tok)
                else:
                    acc.add_chunk_grad(plan, _sum(grads[it][POS] for it in chunk), n_tok,
                                       grads_negative=_sum(grads[it][NEG] for it in chunk))
            continue
        need = acc.required_variants(gid, tid)
        reward = None if (mode == "pending" and i % 2) else rewards[item]
        acc.add_policy_grad(gid, tid, grads[item][POS] if POS in need else None, lengths[item], reward=reward,
                            grads_negative=grads[item][NEG] if NEG in need else None)
        if reward is None:
            acc.report_reward(gid, tid, rewards[item])


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    mode=st.sampled_from(["buckets", "pending", "chunked", "canonical"]),
    rloo=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_sign_buckets_fold_each_reward_with_its_sign_class(sizes, mode, rloo, seed):
    rng = random.Random(seed)
    items = [(g, t) for g, n in enumerate(sizes) for t in range(n)]
    rewards = {it: rng.choice([0.0, 0.5, 1.0]) for it in items}
    grads = {it: {POS: _vec(seed + 2 * k), NEG: _vec(seed + 2 * k + 1)} for k, it in enumerate(items)}
    lengths = {it: rng.randint(1, 6) for it in items}
    est = RLOOEstimator() if rloo else GRPOEstimator()
    acc = StreamingGradientAccumulator([torch.zeros(s, dtype=torch.float64) for s in SHAPES], estimator=est,
                                       sign_buckets=True, canonical_order=mode == "canonical")
    acc.begin_batch(dict(enumerate(sizes)))
    order = items[:]
    rng.shuffle(order)
    _feed(acc, mode, order, rewards, grads, lengths)
    got = acc.compute_batch_gradient()
    expected = _oracle(est, sizes, rewards, grads, lengths)
    assert all(torch.allclose(x, y, rtol=1e-12, atol=1e-14) for x, y in zip(got, expected))
    assert acc.bytes_in_use == acc.layout.buffer_bytes  # only the batch buffer is left


def test_required_variants_follow_the_group_state():
    acc = StreamingGradientAccumulator([torch.zeros(2)], estimator=GRPOEstimator(), sign_buckets=True)
    acc.begin_batch({"g": 3})
    assert acc.required_variants("g", 0) == (POS, NEG)
    for t, r in enumerate([1.0, 0.0, 0.5]):
        acc.report_reward("g", t, r)
    assert acc.required_variants("g", 0) == (POS,)  # above the mean
    assert acc.required_variants("g", 1) == (NEG,)
    assert acc.required_variants("g", 2) == ()  # exactly the mean: advantage 0, nothing needed
