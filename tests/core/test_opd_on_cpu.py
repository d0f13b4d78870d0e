"""On-policy distillation per turn == the whole-trajectory loss (real tiny transformer).

Each multi-turn trajectory is prompt, then turns of policy tokens separated by tool
observations (not scored). A turn is backpropagated as soon as the teacher has scored it,
recomputing the prefix with grad; the sum over turns, normalised once at the barrier, must
equal verl's vanilla policy loss with per-token advantages -(log pi_s - log pi_t) over all
trajectories in one padded batch (token-mean over scored tokens).

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import random

import pytest
import torch

from thundersync_verl.core import (
    GRPOEstimator,
    StreamingConfigError,
    StreamingGradientAccumulator,
    check_opd_turn_mode,
    opd_token_advantages,
    opd_turn_loss,
)


def _multi_turn(seed: int, n_traj: int, vocab: int = 128):
    """[(token ids, [(start, end) of each scored turn])]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_traj):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(3, 5))]
        turns = []
        for _ in range(rng.randint(1, 3)):
            start = len(ids)
            ids += [rng.randrange(vocab) for _ in range(rng.randint(2, 5))]
            turns.append((start, len(ids)))
            ids += [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]  # tool observation
        out.append((ids, turns))
    return out


def _log_probs(model, rows: list[list[int]]):
    """log pi(x_p | x_<p) for every position p >= 1 of right-padded rows: [B, L-1]."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        attn[b, : len(r)] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits  # [B, L, V]
    logp = torch.log_softmax(logits[:, :-1], dim=-1)  # [B, L-1, V]
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, L-1]


def _scored_mask(trajs, width: int) -> torch.Tensor:
    mask = torch.zeros(len(trajs), width - 1, dtype=torch.bool)
    for b, (_, turns) in enumerate(trajs):
        for s, e in turns:
            mask[b, s - 1 : e - 1] = True  # token p is predicted at column p - 1
    return mask


def _verl_whole_batch_gradient(student, teacher, trajs):
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
    from verl.workers.config import ActorConfig

    rows = [ids for ids, _ in trajs]
    logp = _log_probs(student, rows)  # [B, L-1]
    with torch.no_grad():
        t_logp = _log_probs(teacher, rows)  # [B, L-1]
    mask = _scored_mask(trajs, max(len(r) for r in rows))
    adv = opd_token_advantages(logp, t_logp) * mask  # [B, L-1]
    cfg = ActorConfig(strategy="fsdp2", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                      use_dynamic_bsz=False)
    cfg.global_batch_info.update(dp_size=1)
    loss, _ = compute_policy_loss_vanilla(logp.detach(), logp, adv, mask, "token-mean", cfg)
    student.zero_grad(set_to_none=True)
    loss.backward()
    out = [p.grad.clone() for p in student.parameters()]
    student.zero_grad(set_to_none=True)
    return out


def test_turn_by_turn_equals_whole_trajectory_loss(harness):
    student, teacher = harness.tiny_qwen2(0, torch.float64), harness.tiny_qwen2(4, torch.float64)
    trajs = _multi_turn(0, 4)
    expected = _verl_whole_batch_gradient(student, teacher, trajs)
    params = list(student.parameters())
    acc = StreamingGradientAccumulator(params, estimator=GRPOEstimator(), loss_agg_mode="token-mean")
    acc.begin_batch({})  # no groups: every OPD gradient is reward-independent
    # turns of different trajectories interleave, as they would when tool calls overlap
    events = [(b, k) for b, (_, turns) in enumerate(trajs) for k in range(len(turns))]
    random.Random(1).shuffle(events)
    events.sort(key=lambda e: e[1])  # within a trajectory turns still come in order
    for b, k in events:
        ids, turns = trajs[b]
        start, end = turns[k]
        prefix = ids[:end]
        logp = _log_probs(student, [prefix])[:, start - 1 : end - 1]  # [1, turn tokens]
        with torch.no_grad():
            t_logp = _log_probs(teacher, [prefix])[:, start - 1 : end - 1]
        student.zero_grad(set_to_none=True)
        opd_turn_loss(logp, t_logp, torch.ones_like(logp, dtype=torch.bool)).backward()
        acc.add_independent_grad_from_params(params, num_tokens=end - start, num_sequences=int(k == 0))
    got = acc.compute_batch_gradient()
    assert harness.relative_error(got, expected) <= 1e-12
    assert acc.counts.num_sequences == len(trajs)


def test_turn_streaming_refuses_seq_mean_token_mean():
    check_opd_turn_mode("token-mean")
    with pytest.raises(StreamingConfigError, match="1/\\|o_i\\|"):
        check_opd_turn_mode("seq-mean-token-mean")
