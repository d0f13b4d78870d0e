"""Streamed SAO's planner, chunks and loss (thundersync_verl/algos/sao/sao_streaming.py) without an engine.

1. The chunk loss is -sum_t c_t r_t m_t (dp_size times), r and m against the chunk's rollout log-probs;
   its gradient w.r.t. the learner's log-probs is -c r m, and masked tokens get none.
2. End to end on free per-token log-probs (a model whose parameters ARE the log-probs): the streamed
   chunks (trajectories in a random order, direct + whitening bucket), the fold with -mean and the
   deferred scale give the gradient of verl's registered ``sao`` policy loss (token-mean over the batch)
   fed with verl's registered ``sao`` advantages: the update verl's ``update_actor`` takes.
3. The planner refuses an early barrier, unknown trajectories and misaligned per-token lists; the worker's
   config check refuses a non-SAO loss or several optimizer steps per batch.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import random

import pytest
import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingConfigError, StreamingInputError, StreamingStateError
from thundersync_verl.core.sao_stream import SAO_BUCKET
from thundersync_verl.algos.sao.sao_streaming import MASKED_METRIC, SAOStreamClient, SAOStreamPlanner, SAOTrajectory
from thundersync_verl.algos.sao.sao_loss import is_sao_chunk, sao_settings, sao_token_loss

PAD = 0
EPS_LOW, EPS_HIGH = 0.3, 5.0


class _Recorder:
    """Stands in for the worker group where only the chunk layout is needed (``SAOStreamClient.chunk``)."""

    world_size = 1


def _client() -> SAOStreamClient:
    return SAOStreamClient(_Recorder(), pad_token_id=PAD, dp_size=1)


def _planner(**kw) -> SAOStreamPlanner:
    return SAOStreamPlanner(eps_low=EPS_LOW, eps_high=EPS_HIGH, **kw)


def _trajs(seed: int, n: int = 5) -> list[SAOTrajectory]:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = tuple(rng.randrange(3, 50) for _ in range(rng.randint(2, 5)))
        length = rng.randint(3, 9)
        mask = [1] * length
        if length > 5:
            mask[2:4] = [0, 0]  # a tool observation
        rewards = [0.0] * length
        rewards[-1] = float(rng.random() < 0.5)
        values = (0.5 * torch.randn(length, generator=gen)).tolist()
        rollout = (-1.0 + 0.4 * torch.randn(length, generator=gen)).tolist()
        out.append(SAOTrajectory(f"t{i}", prompt, tuple(rng.randrange(3, 50) for _ in range(length)), tuple(mask),
                                 rewards, values, rollout))
    return out


def _log_probs_for(chunk, table: dict, trajs: list[SAOTrajectory]):
    """The chunk's model output: row b's response token j reads ``table[traj][j]`` (a leaf with grad)."""
    offsets = chunk["input_ids"].offsets()
    pieces = []
    for b in range(chunk.batch_size[0]):
        total = int(offsets[b + 1] - offsets[b])
        t = trajs[b] if b < len(trajs) else trajs[-1]  # DP padding rows copy the last row
        start = len(t.prompt) - 1
        piece = torch.zeros(total, dtype=torch.float64)
        piece = torch.cat([piece[:start], table[t.traj_id], piece[start + len(t.response):]])
        pieces.append(piece)
    values = torch.cat(pieces)
    return {"log_probs": torch.nested.nested_tensor_from_jagged(values, offsets=offsets)}


def test_chunk_loss_is_minus_c_r_m_and_masked_tokens_get_no_gradient():
    t = _trajs(0, 1)[0]
    coefs = [0.5 * (j + 1) * m for j, m in enumerate(t.agent_mask)]
    from thundersync_verl.algos.sao.sao_streaming import SAOBackwardOp

    chunk = _client().chunk(SAOBackwardOp(((t, tuple(coefs)),), "direct", (EPS_LOW, EPS_HIGH)))
    assert is_sao_chunk(chunk)
    rollout = torch.tensor(t.rollout_log_probs, dtype=torch.float64)
    shift = torch.tensor([0.0, -0.5, 0.1, 2.5, 0.0, -1.0, 0.2, 0.0, 0.0][: len(coefs)], dtype=torch.float64)
    lp = (rollout + shift).clone().requires_grad_(True)  # ratios exp(shift): 0.61 and 12.2 fall outside the band
    loss, metrics = sao_token_loss(_log_probs_for(chunk, {t.traj_id: lp}, [t]), chunk)
    loss.backward()
    ratio = torch.exp(shift)
    keep = (ratio > 1 - EPS_LOW) & (ratio < 1 + EPS_HIGH)
    c = torch.tensor(coefs, dtype=torch.float64)
    assert float(loss.detach()) == pytest.approx(float(-(c * ratio * keep).sum()), rel=1e-6)
    assert torch.allclose(lp.grad, (-c * ratio * keep).to(lp.grad.dtype), rtol=1e-6, atol=1e-7)
    assert metrics[MASKED_METRIC] == int(((~keep) & (c != 0)).sum()) >= 1
    assert metrics["stream/rollout_logprob_diff_max"] == pytest.approx(float(shift[c != 0].abs().max()), rel=1e-6)


@pytest.mark.parametrize("seed", [1, 2])
def test_streamed_gradient_equals_verls_sao_loss_on_the_batch(seed):
    import verl  # noqa: F401  (the plugin registers estimator and loss "sao")
    from omegaconf import OmegaConf

    trajs = _trajs(seed)
    gen = torch.Generator().manual_seed(seed + 7)
    table = {t.traj_id: (torch.tensor(t.rollout_log_probs, dtype=torch.float64)
                         + 0.3 * torch.randn(len(t.response), generator=gen, dtype=torch.float64)).requires_grad_(True)
             for t in trajs}

    # verl: padded batch, registered estimator and policy loss, token-mean over the batch
    width = max(len(t.response) for t in trajs)
    def padded(key, dtype=torch.float32):
        out = torch.zeros(len(trajs), width, dtype=dtype)
        for b, t in enumerate(trajs):
            out[b, : len(t.response)] = torch.tensor(getattr(t, key), dtype=dtype)
        return out
    mask = padded("agent_mask", torch.int64)
    adv, _ = va.advantage_estimator_fn("sao")(token_level_rewards=padded("rewards"), response_mask=mask,
                                              values=padded("values"), gamma=1.0, lam=1.0)
    log_prob = torch.stack([torch.cat([table[t.traj_id], table[t.traj_id].new_zeros(width - len(t.response))])
                            for t in trajs])  # [B, T]
    actor = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": EPS_LOW, "clip_ratio_high": EPS_HIGH})
    loss, _ = va.policy_loss_fn("sao")(old_log_prob=padded("rollout_log_probs", torch.float64), log_prob=log_prob,
                                       advantages=adv.double(), response_mask=mask, loss_agg_mode="token-mean",
                                       config=actor)
    expected = torch.autograd.grad(loss, [table[t.traj_id] for t in trajs])

    # streamed: random arrival, chunks of 2, bucket kept apart, folded, scaled
    planner, client = _planner(max_chunk_size=2), _client()
    planner.begin_batch([t.traj_id for t in trajs])
    grads = {"direct": [torch.zeros_like(table[t.traj_id]) for t in trajs], SAO_BUCKET: [torch.zeros_like(table[t.traj_id]) for t in trajs]}
    order = list(range(len(trajs)))
    random.Random(seed).shuffle(order)
    index = {t.traj_id: i for i, t in enumerate(trajs)}
    for k, i in enumerate(order):
        planner.arrive(trajs[i])
        if k % 2 == 1 or k == len(order) - 1:
            for op in planner.next_ops():
                rows = [t for t, _ in op.rows]
                chunk = client.chunk(op)
                out, _ = sao_token_loss(_log_probs_for(chunk, table, rows), chunk)
                for t, g in zip(rows, torch.autograd.grad(out, [table[t.traj_id] for t in rows])):
                    grads[op.dest][index[t.traj_id]] += g
    folds, final = planner.finalize()
    assert set(folds) == {SAO_BUCKET} and final.num_tokens == int(mask.sum())
    streamed = [final.scale * (d + folds[SAO_BUCKET] * b) for d, b in zip(grads["direct"], grads[SAO_BUCKET])]
    for s, e in zip(streamed, expected):
        assert torch.allclose(s, e, rtol=1e-5, atol=1e-7)  # verl whitens in float32
    assert any(float(g.abs().max()) > 1e-3 for g in expected)


def test_planner_refusals():
    trajs = _trajs(3, 2)
    planner = _planner()
    with pytest.raises(StreamingStateError, match="no SAO batch open"):
        planner.arrive(trajs[0])
    planner.begin_batch([trajs[0].traj_id])
    with pytest.raises(StreamingInputError, match="not in this batch"):
        planner.arrive(trajs[1])
    with pytest.raises(StreamingStateError, match="finalize refused"):
        planner.finalize()
    planner.arrive(trajs[0])
    with pytest.raises(StreamingStateError, match="finalize refused"):
        planner.finalize()  # arrived but not planned
    ops = planner.next_ops()
    assert [op.dest for op in ops] == ["direct", SAO_BUCKET]
    folds, final = planner.finalize()
    assert final.scale > 0 and folds[SAO_BUCKET] != 0
    t = trajs[0]
    with pytest.raises(StreamingInputError, match="one entry per response token"):
        SAOTrajectory("x", t.prompt, t.response, t.agent_mask[:-1], t.rewards, t.values, t.rollout_log_probs)


def test_unwhitened_batches_need_no_bucket():
    planner = _planner(whiten=False)
    trajs = _trajs(4, 3)
    planner.begin_batch([t.traj_id for t in trajs])
    for t in trajs:
        planner.arrive(t)
    assert {op.dest for op in planner.next_ops()} == {"direct"}
    folds, final = planner.finalize()
    assert folds == {} and final.scale == pytest.approx(1.0 / sum(sum(t.agent_mask) for t in trajs))


def test_worker_config_check():
    from omegaconf import OmegaConf

    good = {"actor": {"loss_agg_mode": "token-mean", "ppo_epochs": 1, "ppo_mini_batch_size": 4,
                      "policy_loss": {"loss_mode": "sao"}, "use_kl_loss": False, "entropy_coeff": 0.0}}
    assert sao_settings(OmegaConf.create(good), {"train_batch_size": 4}).loss_agg_mode == "token-mean"
    for change, match in ((("policy_loss", {"loss_mode": "vanilla"}), "loss_mode=sao"), (("ppo_epochs", 2), "ppo_epochs=1"),
                          (("use_kl_loss", True), "use_kl_loss=false")):
        bad = OmegaConf.create(good)
        bad.actor[change[0]] = change[1]
        with pytest.raises(StreamingConfigError, match=match):
            sao_settings(bad, {"train_batch_size": 4})
    with pytest.raises(StreamingConfigError, match="ppo_mini_batch_size=8"):
        sao_settings(OmegaConf.create(good), {"train_batch_size": 8})


def test_critic_coefficients_with_a_deferred_normaliser_give_verls_value_loss_gradient():
    """The critic's first pass over a batch streams too: per trajectory sum_t (V_t - G_t) grad V_t, times 1/N at
    the barrier, is the gradient of verl's clipped value loss at the step-start weights (V = V_old)."""
    from verl.trainer.ppo.core_algos import compute_value_loss

    from thundersync_verl.core.sao_stream import critic_token_coefficients

    trajs = _trajs(5)
    width = max(len(t.response) for t in trajs)
    v = torch.zeros(len(trajs), width, dtype=torch.float64)
    g = torch.zeros_like(v)
    mask = torch.zeros(len(trajs), width, dtype=torch.int64)
    streamed = torch.zeros_like(v)
    planner = _planner()
    planner.begin_batch([t.traj_id for t in trajs])
    for b, t in enumerate(reversed(trajs)):  # any arrival order
        planner.arrive(t)
        n = len(t.response)
        returns = planner.returns[t.traj_id]
        v[b, :n], g[b, :n], mask[b, :n] = torch.tensor(t.values), torch.tensor(returns), torch.tensor(t.agent_mask)
        streamed[b, :n] = torch.tensor(critic_token_coefficients(t.values, returns, t.agent_mask))
    streamed = streamed / int(mask.sum())  # the deferred token-mean normaliser
    leaf = v.clone().requires_grad_(True)
    loss, _ = compute_value_loss(vpreds=leaf, returns=g, values=v, response_mask=mask, cliprange_value=0.5)
    loss.backward()
    assert torch.allclose(streamed, leaf.grad, rtol=1e-7, atol=1e-12)  # verl's agg_loss rounds its divisor
    assert float(leaf.grad.abs().max()) > 1e-3


def test_the_trainers_op_pipeline_sends_sao_ops_as_per_token_chunks():
    from thundersync_verl.step.stream_exec import _request
    from thundersync_verl.step.chunk_layout import SEQ_KEY, TOKEN_COEF_KEY

    planner = _planner()
    trajs = _trajs(6, 2)
    planner.begin_batch([t.traj_id for t in trajs])
    for t in trajs:
        planner.arrive(t)
    direct, bucket = planner.next_ops()
    method, (chunk,) = _request(_Recorder(), bucket, {}, pad_token_id=PAD, temperature=1.0, queued=True, seq=3)
    assert method == "stream_token_backward_queued" and is_sao_chunk(chunk)
    assert va.non_tensor(chunk, SEQ_KEY) == 3 and va.non_tensor(chunk, "ts_dest") == SAO_BUCKET
    assert chunk[TOKEN_COEF_KEY].sum() == sum(sum(t.agent_mask) for t in trajs)  # 1 per agent token
    method, (chunk,) = _request(_Recorder(), direct, {}, pad_token_id=PAD, temperature=1.0, queued=False)
    assert method == "stream_token_backward" and va.non_tensor(chunk, "ts_dest") == "direct"


def test_the_trainers_step_planner_plans_the_fold_last_and_steps_like_the_plain_planner():
    """``SAOStepPlanner`` (the ThunderSync trainer's): rows as they arrive, the whitening fold once the last
    trajectory is planned, and the same barrier scale as ``SAOStreamPlanner.finalize`` on the same batch."""
    from thundersync_verl.algos.sao.sao_trainer_step import BATCH_GROUP, SAOArrivals, SAOStepPlanner
    from thundersync_verl.step.stream_plan import FoldOp

    trajs = _trajs(3, n=3)
    step = SAOStepPlanner(_planner())
    step.begin_batch([t.traj_id for t in trajs])
    assert step.ready_count == 0
    step.arrive(trajs[0])
    assert step.ready_count == 1
    first = step.next_ops()
    assert [op.dest for op in first] == ["direct", SAO_BUCKET] and step.ready_count == 0
    with pytest.raises(StreamingStateError, match="1 of 3 trajectories"):
        step.finalize()  # no step on part of the batch
    for t in trajs[1:]:
        step.arrive(t)
    assert step.ready_count == 3  # two rows and the fold
    ops = step.next_ops()
    assert isinstance(ops[-1], FoldOp) and ops[-1].group_id == BATCH_GROUP and SAO_BUCKET in ops[-1].folds
    assert not any(isinstance(op, FoldOp) for op in ops[:-1]) and step.ready_count == 0 and step.next_ops() == []
    plain = _planner()
    plain.begin_batch([t.traj_id for t in trajs])
    for t in trajs:
        plain.arrive(t)
    plain.next_ops()
    folds, final = plain.finalize()
    got = step.finalize()
    assert got.scale == final.scale and got.num_tokens == final.num_tokens and ops[-1].folds == folds
    # a landed row without the critic's values (or the rollout's log-probs) is refused by name, not guessed
    arrivals = SAOArrivals(SAOStepPlanner(_planner()))
    arrivals.planner.begin_batch(["u1"])
    row = {"prompt": [1, 2], "response": [3, 4], "mask": [1, 1], "scores": [0.0, 1.0], "rollout_lp": [-1.0, -1.0]}
    with pytest.raises(StreamingStateError, match="values"):
        arrivals.admit_trajectory("u1_0_0", row, None, 0.0)
    arrivals.admit_trajectory("u1_0_0", {**row, "values": [0.1, 0.2]}, None, 0.0)
    assert arrivals.planner.ready_count == 2  # its row and the fold (the batch is complete)
    (kind, items, tokens) = arrivals.describe_op(arrivals.planner.next_ops()[0], None, 0.0)
    assert kind == "backward" and items == (("u1", "u1_0_0"),) and tokens == 4
