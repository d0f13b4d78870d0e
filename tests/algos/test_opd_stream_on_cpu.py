"""OPD turn streaming without the engine: the planner, the per-token chunk and its loss. No GPU, no Ray.

The central check: on a real (tiny, float64) transformer, the gradients of the per-turn prefix
rows, summed, equal the gradient of the whole trajectories, and equal verl's own distillation
loss (k1 advantage, vanilla policy loss, agg_loss token-mean) once the deferred 1/N is applied.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from thundersync_harness.engine_setup import opd_overrides
from thundersync_harness.teacher import TurnScorer, score_turn
from thundersync_verl import verl_adapter as va
from thundersync_verl.algos.opd.turn_teacher import TeacherRetryPolicy, TeacherScoringError
from thundersync_verl.core import StreamingConfigError, StreamingInputError, StreamingStateError
from thundersync_verl.algos.opd.opd_stream import (
    OPDTurn,
    OPDTurnPlanner,
    TrajectoryRow,
    TurnBackwardOp,
    opd_planner_from_verl_config,
    turns_of_trajectory,
)
from thundersync_verl.step.chunk_layout import ADV_CLAMP_KEY, COEF_KEY, TEACHER_KEY, TOKEN_COEF_KEY, build_token_chunk
from thundersync_verl.learner.stream_loss import stream_token_loss

PAD = 0
PROMPT = (5, 6, 7)
RESPONSE = (10, 11, 12, 20, 21, 13, 14, 22, 15)
MASK = (1, 1, 1, 0, 0, 1, 1, 0, 1)
TEACHER = tuple(-0.5 - 0.1 * i for i in range(len(RESPONSE)))


def test_a_trajectory_splits_into_prefix_rows_that_score_one_turn_each():
    turns = turns_of_trajectory("a", PROMPT, RESPONSE, MASK, TEACHER)
    assert [(t.turn, t.action_start, len(t.response)) for t in turns] == [(0, 0, 3), (1, 5, 7), (2, 8, 9)]
    assert turns[1].response == RESPONSE[:7] and turns[1].token_coefs() == [0, 0, 0, 0, 0, 1, 1]
    assert turns[1].teacher_row() == [0.0] * 5 + list(TEACHER[5:7])
    assert sum(t.num_tokens for t in turns) == sum(MASK)
    as_lists = OPDTurn("a", 1, list(PROMPT), list(RESPONSE[:7]), 5, list(TEACHER[5:7]))
    assert as_lists == turns[1] and as_lists.prompt == PROMPT  # stored as tuples: compared by value
    assert all(t.rollout_log_probs == () for t in turns)  # none given: none carried
    behaviour = tuple(-1.0 - 0.01 * i for i in range(len(RESPONSE)))
    with_lp = turns_of_trajectory("a", PROMPT, RESPONSE, MASK, TEACHER, behaviour)
    assert [t.rollout_log_probs for t in with_lp] == [behaviour[0:3], behaviour[5:7], behaviour[8:9]]
    with pytest.raises(StreamingInputError, match="one entry per response token"):
        turns_of_trajectory("a", PROMPT, RESPONSE, MASK, TEACHER, behaviour[:-1])


def _planner_with(turns, mode="token-mean"):
    planner = OPDTurnPlanner(loss_agg_mode=mode, max_chunk_size=2)
    planner.begin_batch(["a", "b"])
    for t in turns:
        planner.add_turn(t)
    return planner


def test_turns_in_any_order_then_the_deferred_normaliser():
    a = turns_of_trajectory("a", PROMPT, RESPONSE, MASK, TEACHER)
    b = turns_of_trajectory("b", (9,), (30, 31), (1, 1), (-1.0, -2.0))
    planner = _planner_with([a[2], b[0]])
    planner.end_trajectory("a", 3)  # announced before its earlier turns arrive
    ops = planner.next_ops()
    assert [op.items for op in ops] == [(("a", 2), ("b", 0))]
    planner.add_turn(a[0])
    planner.end_trajectory("b", 1)
    with pytest.raises(StreamingStateError, match=r"lacks turns \[1\].*1 scored turn\(s\) not taken"):
        planner.finalize()
    planner.add_turn(a[1])
    (op,) = planner.next_ops()  # a's turns 0 and 1, ready together, share one row: turn 1's prefix
    assert op.items == (("a", 0), ("a", 1)) and len(op.turns) == 1
    row = op.turns[0]
    assert row.response == a[1].response and row.token_coefs() == [1.0] * 3 + [0.0] * 2 + [1.0] * 2
    final = planner.finalize()
    assert final.num_tokens == 8 and final.num_sequences == 2 and final.scale == pytest.approx(1 / 8)
    with pytest.raises(StreamingStateError, match="no OPD batch open"):
        planner.add_turn(a[0])


def test_seq_mean_modes_divide_by_trajectories_and_seq_mean_token_mean_is_refused():
    planner = _planner_with(turns_of_trajectory("a", PROMPT, RESPONSE, MASK, TEACHER), mode="seq-mean-token-sum")
    planner.end_trajectory("a", 3)
    planner.end_trajectory("b", 0)
    planner.next_ops()
    assert planner.finalize().scale == pytest.approx(1 / 2)
    with pytest.raises(StreamingConfigError, match="seq-mean-token-mean"):
        OPDTurnPlanner(loss_agg_mode="seq-mean-token-mean")


def _turn(**changes):
    base = dict(traj_id="a", turn=1, prompt=PROMPT, response=RESPONSE[:7], action_start=5, teacher_log_probs=TEACHER[5:7])
    return OPDTurn(**{**base, **changes})


@pytest.mark.parametrize(
    "turn, match",
    [
        (_turn(teacher_log_probs=(-1.0,)), "needs 2 finite teacher log-probs"),
        (_turn(teacher_log_probs=(-1.0, float("nan"))), "needs 2 finite teacher log-probs"),
        (_turn(action_start=7), "action_start must satisfy"),
        (_turn(turn=-1), "turn index must be an int >= 0"),
        (_turn(traj_id="zzz"), "not in this batch"),
        (_turn(prompt=(5, 6, 8)), "inconsistent"),
        (_turn(response=(10, 11, 99, 20, 21, 13, 14)), "inconsistent"),
        (_turn(action_start=2, teacher_log_probs=TEACHER[2:7]), "inconsistent"),  # overlaps turn 0
        (_turn(turn=0, response=RESPONSE[:3], action_start=0, teacher_log_probs=TEACHER[:3]), "already added"),
    ],
)
def test_bad_turns_are_refused_with_the_rule(turn, match):
    planner = _planner_with([turns_of_trajectory("a", PROMPT, RESPONSE, MASK, TEACHER)[0]])
    with pytest.raises(StreamingInputError, match=match):
        planner.add_turn(turn)


def test_end_trajectory_and_begin_batch_validation():
    planner = _planner_with(turns_of_trajectory("a", PROMPT, RESPONSE, MASK, TEACHER)[:2])
    with pytest.raises(StreamingInputError, match="already has turn 1 but ends with 1 turns"):
        planner.end_trajectory("a", 1)
    planner.end_trajectory("a", 2)
    with pytest.raises(StreamingInputError, match="already ended"):
        planner.end_trajectory("a", 2)
    with pytest.raises(StreamingInputError, match="past its end"):
        planner.add_turn(_turn(turn=2, response=RESPONSE, action_start=8, teacher_log_probs=TEACHER[8:]))
    with pytest.raises(StreamingInputError, match="distinct trajectory ids"):
        planner.begin_batch(["x", "x"])


def test_a_turn_the_teacher_cannot_score_is_never_dropped():
    class DownTeacher:
        def score(self, prefix_ids, span):
            raise TimeoutError("teacher unreachable")

    scorer = TurnScorer(DownTeacher(), TeacherRetryPolicy(max_attempts=2), incremental=False)
    turns = turns_of_trajectory("a", PROMPT, RESPONSE, MASK)
    planner = _planner_with([])
    planner.end_trajectory("b", 0)
    planner.add_turn(replace(turns[0], teacher_log_probs=TEACHER[:3]))
    with pytest.raises(TeacherScoringError, match="turn 1 of trajectory 'a'"):
        planner.add_turn(score_turn(scorer, turns[1]))
    planner.end_trajectory("a", 3)
    planner.next_ops()
    with pytest.raises(StreamingStateError, match=r"lacks turns \[1, 2\]"):
        planner.finalize()
    assert scorer.pending() == [("a", 1)]


def test_token_chunk_layout_and_refusals():
    chunk = build_token_chunk([PROMPT, (9,)], [RESPONSE[:7], (30, 31)], [[0, 0, 0, 0, 0, 1, 1], [1, 1]], dp_size=4,
                              pad_token_id=PAD, teacher_log_probs=[[0.0] * 5 + [-1.0, -2.0], [-3.0, -4.0]], opd_clamp=5.0)
    assert chunk.batch_size[0] == 4 and chunk[COEF_KEY].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert chunk["loss_mask"].sum(dim=-1).tolist() == [2, 2, 0, 0]  # verl counts only the scored tokens
    assert chunk[TOKEN_COEF_KEY][0].tolist() == [0, 0, 0, 0, 0, 1, 1] and chunk[TOKEN_COEF_KEY][2].abs().sum() == 0
    assert chunk[TEACHER_KEY].dtype == torch.float32 and va.non_tensor(chunk, ADV_CLAMP_KEY) == 5.0
    with pytest.raises(StreamingInputError, match="one value per response token"):
        build_token_chunk([PROMPT], [RESPONSE], [[1.0]], dp_size=1, pad_token_id=PAD)
    with pytest.raises(StreamingInputError, match="must be finite"):
        build_token_chunk([PROMPT], [(1, 2)], [[1.0, 1.0]], dp_size=1, pad_token_id=PAD, teacher_log_probs=[[0.0, float("inf")]])


# ----- the loss on a real transformer, against verl's own distillation loss functions --------
@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # shared 2-core machines: multi-threaded float64 kernels crawl under load
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model64():
    """A float64 tiny Qwen2 that stays float64 inside: HF computes RoPE and RMSNorm in float32
    (right for bf16 training), which would cap a float64 check at ~1e-8; both are replaced here
    by the same formulas in float64. sdpa attention keeps the softmax in the input dtype."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).double()
    rope = model.model.rotary_emb

    def rope_float64(x, position_ids):
        freqs = position_ids[:, :, None].double() * rope.inv_freq.double()[None, None, :]  # [B, L, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, L, D]
        return (emb.cos() * rope.attention_scaling).to(x.dtype), (emb.sin() * rope.attention_scaling).to(x.dtype)

    def rms_norm_float64(norm):
        def forward(hidden):
            variance = hidden.pow(2).mean(-1, keepdim=True)  # [B, L, 1]
            return norm.weight * (hidden * torch.rsqrt(variance + norm.variance_epsilon))
        return forward

    rope.forward = rope_float64
    for module in model.modules():
        if type(module).__name__ == "Qwen2RMSNorm":
            module.forward = rms_norm_float64(module)
    return model


def _engine_output(model, chunk):
    """What verl's engine hands the loss: next-token log-probs over each unpadded row, nested."""
    offsets = chunk["input_ids"].offsets()
    values = []
    for b in range(len(offsets) - 1):
        ids = chunk["input_ids"].values()[offsets[b] : offsets[b + 1]]
        logp = torch.log_softmax(model(input_ids=ids[None]).logits[0], dim=-1)  # [L, V]
        nxt = logp[:-1].gather(-1, ids[1:, None]).squeeze(-1)  # [L - 1]
        values.append(torch.cat([nxt, nxt.new_zeros(1)]))
    return {"log_probs": torch.nested.nested_tensor_from_jagged(torch.cat(values), offsets=offsets)}


def _grad(model, chunks) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    for chunk in chunks:
        loss, _ = stream_token_loss(_engine_output(model, chunk), chunk)
        loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _trajectories(n=5, seed=0):
    rng, out = random.Random(seed), []
    for i in range(n):
        prompt, response, mask = [rng.randrange(1, 64) for _ in range(rng.randint(2, 5))], [], []
        for j in range(rng.randint(2, 4)):
            action = [rng.randrange(1, 64) for _ in range(rng.randint(1, 5))]
            obs = [rng.randrange(1, 64) for _ in range(rng.randint(1, 3))] if j < 3 else []
            response, mask = response + action + obs, mask + [1] * len(action) + [0] * len(obs)
        teacher = [rng.uniform(-6.0, -0.1) for _ in response]
        out.append((prompt, response, mask, teacher))
    return out


def test_per_turn_prefix_rows_sum_to_the_whole_trajectory_gradient_and_match_verls_loss(model64):
    trajs = _trajectories()
    whole = build_token_chunk([t[0] for t in trajs], [t[1] for t in trajs], [t[2] for t in trajs], dp_size=1,
                              pad_token_id=PAD, teacher_log_probs=[t[3] for t in trajs])
    turns = [u for i, t in enumerate(trajs) for u in turns_of_trajectory(i, *t)]
    random.Random(1).shuffle(turns)
    ops = [TurnBackwardOp(tuple(turns[i : i + 3])) for i in range(0, len(turns), 3)]
    chunks = [build_token_chunk([u.prompt for u in op.turns], [u.response for u in op.turns],
                                [u.token_coefs() for u in op.turns], dp_size=1, pad_token_id=PAD,
                                teacher_log_probs=[u.teacher_row() for u in op.turns]) for op in ops]
    g_whole, g_turns = _grad(model64, [whole]), _grad(model64, chunks)
    assert float(g_whole.norm()) > 1e-3
    assert float((g_turns - g_whole).norm() / g_whole.norm()) < 1e-10  # float64: summation order only

    kl_penalty, vanilla, agg_loss = va.distillation_loss_fns()
    mask = whole["response_mask"].double()  # [B, R]
    log_prob = va.response_log_probs(_engine_output(model64, whole), whole)  # [B, R]
    teacher = whole[TEACHER_KEY].double()  # [B, R]
    config = type("LossConfig", (), {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
                                     "get": lambda self, k, d=None: d, "global_batch_info": {
                                         "dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": len(trajs),
                                         "loss_scale_factor": None}})()
    advantages = -kl_penalty(log_prob, teacher, "k1").detach()  # verl: the negated k1 distillation loss
    loss, _ = vanilla(log_prob.detach(), log_prob, advantages, mask.bool(), "token-mean", config)
    model64.zero_grad(set_to_none=True)
    loss.backward()
    g_verl = torch.cat([p.grad.reshape(-1) for p in model64.parameters()])
    g_deferred = g_turns / float(mask.sum())  # the barrier's scale, applied once
    assert float((g_deferred - g_verl).norm() / g_verl.norm()) < 1e-10


def test_trajectory_granularity_releases_one_row_per_finished_trajectory():
    a = turns_of_trajectory("a", PROMPT, RESPONSE, MASK, TEACHER)
    b = turns_of_trajectory("b", (9,), (30, 31), (1, 1), (-1.0, -2.0))
    planner = OPDTurnPlanner(granularity="trajectory", max_chunk_size=4)
    planner.begin_batch(["a", "b"])
    for turn in (a[2], a[0], b[0]):
        planner.add_turn(turn)
    assert planner.next_ops() == []  # nothing has ended yet
    planner.end_trajectory("b", 1)
    planner.end_trajectory("a", 3)  # a still lacks turn 1
    (op,) = planner.next_ops()
    assert op.items == (("b", 0),)
    planner.add_turn(a[1])
    (op,) = planner.next_ops()
    assert op.items == (("a", 0), ("a", 1), ("a", 2))
    row = op.turns[0]
    assert row.response == RESPONSE and row.token_coefs() == [float(m) for m in MASK]
    assert [v for v, m in zip(row.teacher_row(), MASK) if m] == [t for t, m in zip(TEACHER, MASK) if m]
    assert planner.finalize().num_tokens == 8
    with pytest.raises(StreamingConfigError, match="granularity"):
        OPDTurnPlanner(granularity="group")


def test_trajectory_rows_and_merged_ready_turns_give_the_turn_rows_gradient(model64):
    trajs = _trajectories(seed=7)
    turns = [u for i, t in enumerate(trajs) for u in turns_of_trajectory(i, *t)]
    grads = {}
    # (granularity, plan after every k-th scored turn): k > 1 is a learner that fell behind, whose plans find
    # several turns of one trajectory ready at once and merge them, from any turn on (not only turn 0)
    for granularity, every in (("turn", 1), ("trajectory", 1), ("turn", 3)):
        planner = OPDTurnPlanner(granularity=granularity, max_chunk_size=3)
        planner.begin_batch(range(len(trajs)))
        ops = []
        for n, turn in enumerate(turns, 1):
            planner.add_turn(turn)
            if n % every == 0:
                ops += planner.next_ops()
        for i, t in enumerate(trajs):
            planner.end_trajectory(i, len(turns_of_trajectory(i, *t)))
            ops += planner.next_ops()
        chunks = [build_token_chunk([u.prompt for u in op.turns], [u.response for u in op.turns],
                                    [u.token_coefs() for u in op.turns], dp_size=1, pad_token_id=PAD,
                                    teacher_log_probs=[u.teacher_row() for u in op.turns]) for op in ops]
        grads[granularity, every] = _grad(model64, chunks)
        assert sorted(i for op in ops for i in op.items) == sorted((u.traj_id, u.turn) for u in turns)
        rows = [row for op in ops for row in op.turns]
        if (granularity, every) == ("turn", 3):  # merged rows, some starting past turn 0, fewer rows than turns
            assert any(isinstance(r, TrajectoryRow) and r.parts[0].turn > 0 for r in rows) and len(rows) < len(turns)
    for other in (("trajectory", 1), ("turn", 3)):
        rel = (grads[other] - grads["turn", 1]).norm() / grads["turn", 1].norm()
        assert float(rel) < 1e-10  # float64: summation order only


def test_turn_backwards_report_the_reverse_kl_of_the_whole_trajectories(model64):
    """Summed over the turn chunks, the loss's KL sums equal the whole trajectories' (unclamped) reverse KL."""
    trajs = _trajectories(seed=5)
    whole = build_token_chunk([t[0] for t in trajs], [t[1] for t in trajs], [t[2] for t in trajs], dp_size=1,
                              pad_token_id=PAD, teacher_log_probs=[t[3] for t in trajs])
    with torch.no_grad():
        log_prob = va.response_log_probs(_engine_output(model64, whole), whole)  # [B, R]
        mask = whole["response_mask"].double()  # [B, R]
        expected = float(((log_prob - whole[TEACHER_KEY].double()) * mask).sum())
    turns = [u for i, t in enumerate(trajs) for u in turns_of_trajectory(i, *t)]
    kl_sum, kl_tokens = 0.0, 0
    for i in range(0, len(turns), 2):
        part = turns[i : i + 2]
        chunk = build_token_chunk([u.prompt for u in part], [u.response for u in part], [u.token_coefs() for u in part],
                                  dp_size=2, pad_token_id=PAD, teacher_log_probs=[u.teacher_row() for u in part], opd_clamp=0.5)
        with torch.no_grad():
            _, metrics = stream_token_loss(_engine_output(model64, chunk), chunk)
        kl_sum += metrics["stream/opd_reverse_kl_sum"]
        kl_tokens += metrics["stream/opd_reverse_kl_tokens"]
    assert kl_tokens == int(mask.sum())
    assert kl_sum == pytest.approx(expected, rel=1e-9)


def test_the_opd_clamp_bounds_the_advantage_like_verls_loss_max_clamp(model64):
    prompt, response, mask, teacher = _trajectories(1, seed=3)[0]
    far = [-30.0] * len(teacher)  # |log pi - log p_teacher| far above the clamp
    chunk = build_token_chunk([prompt], [response], [mask], dp_size=1, pad_token_id=PAD, teacher_log_probs=[far], opd_clamp=2.0)
    log_prob = va.response_log_probs(_engine_output(model64, chunk), chunk)  # [1, R]
    loss, metrics = stream_token_loss({"log_probs": None} | _engine_output(model64, chunk), chunk)
    m = torch.tensor([mask], dtype=torch.float64)
    expected = -(m * (-(log_prob.detach() - torch.tensor([far])).clamp(-2.0, 2.0)) * log_prob).sum()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-12) and metrics["stream/scored_tokens"] == sum(mask)


def test_planner_from_verl_config_checks_the_distillation_settings():
    base = ["actor_rollout_ref.model.path=/tmp/student"]
    good = base + opd_overrides("/tmp/teacher")
    planner = opd_planner_from_verl_config(va.compose_ppo_config(good + ["distillation.distillation_loss.loss_max_clamp=3.0"]))
    assert planner.loss_agg_mode == "token-mean" and planner.opd_clamp == 3.0
    with pytest.raises(StreamingConfigError, match="distillation.enabled=true"):
        opd_planner_from_verl_config(va.compose_ppo_config(base))
    bad = good + ["distillation.distillation_loss.loss_mode=forward_kl_topk"]
    with pytest.raises(StreamingConfigError, match=r"distillation.distillation_loss.loss_mode=forward_kl_topk"):
        opd_planner_from_verl_config(va.compose_ppo_config(bad))
    with pytest.raises(StreamingConfigError, match="seq-mean-token-mean"):
        opd_planner_from_verl_config(va.compose_ppo_config(good + ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"]))


def test_a_plan_into_free_slots_leaves_the_rest_to_merge_with_later_turns():
    a = turns_of_trajectory("a", PROMPT, RESPONSE, MASK, TEACHER)
    b = turns_of_trajectory("b", (9,), (30, 31), (1, 1), (-1.0, -2.0))
    planner = OPDTurnPlanner(max_chunk_size=1)
    planner.begin_batch(["a", "b"])
    for turn in (b[0], a[0], a[1]):
        planner.add_turn(turn)
    (op,) = planner.next_ops(max_backwards=1)  # one free slot: one chunk of one row, the oldest first
    assert op.items == (("b", 0),) and planner.ready_count == 2
    assert planner.next_ops(max_backwards=0) == [] and planner.ready_count == 2  # no free slot: nothing planned
    planner.add_turn(a[2])  # lands while the learner is busy: joins a's waiting turns in one row
    (op,) = planner.next_ops(max_backwards=4)
    assert op.items == (("a", 0), ("a", 1), ("a", 2)) and op.turns[0].response == RESPONSE
    planner.end_trajectory("a", 3)
    planner.end_trajectory("b", 1)
    assert planner.finalize().num_tokens == 8
