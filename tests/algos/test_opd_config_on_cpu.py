"""verl's distillation settings read by the project (``algos/opd/opd_config.py``), the refusals, the per-token
supervised loss against verl's own ``kl_penalty``, and the task-reward planner's bookkeeping. No Ray, no engine.
"""

from __future__ import annotations

import pytest
import torch

from thundersync_harness.engine_setup import opd_overrides
from thundersync_verl import verl_adapter as va
from thundersync_verl.algos.opd.opd_config import ESTIMATORS, OPDLoss, opd_loss_from_verl_config
from thundersync_verl.algos.opd.opd_stream import OPDTurn, TurnBackwardOp, opd_planner_from_verl_config
from thundersync_verl.algos.opd.opd_task import OPDTaskPlanner
from thundersync_verl.core import StreamingConfigError, StreamingStateError, distillation_token_loss
from thundersync_verl.step.stream_plan import BackwardOp, FoldOp

LOSS = "distillation.distillation_loss"


@pytest.fixture(scope="module")
def shipped():
    """verl's config with distillation on and every distillation_loss key as verl ships it."""
    return va.compose_ppo_config(["actor_rollout_ref.model.path=/tmp/student", "algorithm.adv_estimator=grpo"]
                                 + opd_overrides("/tmp/teacher", {}))


def _with(config, **loss):
    from omegaconf import OmegaConf

    out = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    for key, value in loss.items():
        OmegaConf.update(out, f"{LOSS}.{key}", value)
    return out


def test_verls_shipped_settings_are_read_as_shipped(shipped):
    loss = opd_loss_from_verl_config(shipped)
    assert loss == OPDLoss(estimator="k3", policy_gradient=False, use_task_rewards=True, coef=1.0, clamp=None)
    assert opd_loss_from_verl_config(_with(shipped, distillation_loss_coef=0.25)).coef == 0.25
    assert opd_loss_from_verl_config(_with(shipped, distillation_loss_coef=0.25, use_task_rewards=False)).coef == 1.0


@pytest.mark.parametrize("loss, match", [
    ({"loss_mode": "forward_kl_topk"}, f"(?s){LOSS}.loss_mode=forward_kl_topk.*top-k"),
    ({"loss_mode": "k1"}, "loss_mode=k1 with use_policy_gradient=false"),
    ({"loss_mode": "k4"}, "loss_mode='k4'"),
    ({"loss_mode": "k3+"}, "loss_mode='k3\\+'"),
    ({"loss_max_clamp": -1.0}, "loss_max_clamp must be positive"),
])
def test_what_does_not_stream_is_refused_naming_the_key(shipped, loss, match):
    with pytest.raises(StreamingConfigError, match=match):
        opd_loss_from_verl_config(_with(shipped, **loss))
    with pytest.raises(StreamingConfigError, match=match):  # the trainer's and the task planner's readings too
        OPDTaskPlanner.from_verl_config(_with(shipped, **loss))


def test_distillation_off_and_task_rewards_without_the_task_planner_are_refused(shipped):
    from thundersync_verl.algos.opd.opd_trainer_step import validate_opd_config

    with pytest.raises(StreamingConfigError, match="distillation.enabled=true"):
        opd_loss_from_verl_config(va.compose_ppo_config(["actor_rollout_ref.model.path=/tmp/student"]))
    with pytest.raises(StreamingConfigError, match=f"{LOSS}.use_task_rewards=true: a turn planner alone"):
        opd_planner_from_verl_config(shipped)
    assert opd_planner_from_verl_config(_with(shipped, use_task_rewards=False)).loss.supervised
    assert isinstance(validate_opd_config(shipped), OPDTaskPlanner)  # the trainer's planner (OPDAlgorithm.validate)


@pytest.mark.parametrize("kind", ESTIMATORS)
@pytest.mark.parametrize("clamp", [None, 0.3])
def test_the_per_token_loss_and_its_gradient_are_verls(kind, clamp):
    from verl.trainer.ppo.core_algos import kl_penalty

    gen = torch.Generator().manual_seed(3)
    student = (-3 * torch.rand(4, 7, generator=gen, dtype=torch.float64)).requires_grad_()
    teacher = -3 * torch.rand(4, 7, generator=gen, dtype=torch.float64)
    ours = distillation_token_loss(student, teacher, kind, clamp)
    theirs = kl_penalty(logprob=student, ref_logprob=teacher, kl_penalty=kind)
    if clamp is not None:  # verl's distillation_loss clamps the estimator matrix before agg_loss
        theirs = theirs.clamp(min=-clamp, max=clamp)
    weights = torch.rand(4, 7, generator=gen, dtype=torch.float64)
    (g_ours,) = torch.autograd.grad((weights * ours).sum(), student)
    (g_theirs,) = torch.autograd.grad((weights * theirs).sum(), student)
    assert torch.equal(ours, theirs) and torch.equal(g_ours, g_theirs)
    assert bool((g_theirs != 0).any())


def _turn(tid, j, n_prev, n_new):
    response = tuple(range(10, 10 + n_prev + n_new))
    return OPDTurn(tid, j, (5, 6), response, n_prev, tuple([-1.0] * n_new))


def test_the_task_planner_streams_both_terms_with_one_normaliser(shipped):
    planner = OPDTaskPlanner.from_verl_config(_with(shipped, distillation_loss_coef=0.5), max_chunk_size=4)
    planner.begin_batch(["a", "b"], {"g": 2})
    planner.add_turn(_turn("b", 1, 3, 2))  # out of order: b's second turn first
    planner.arrive("g", "a", 1.0, 4)  # a landed while its group is open: its task row goes to a bucket
    ops = planner.next_ops()
    assert [type(op) for op in ops] == [TurnBackwardOp, BackwardOp] and ops[1].dest != "direct"
    assert ops[0].loss.coef == 0.5 and ops[0].loss.supervised
    planner.add_turn(_turn("a", 0, 0, 4))
    planner.end_trajectory("a", 1)
    with pytest.raises(StreamingStateError, match="lacks turns|has not ended"):
        planner.finalize()
    planner.add_turn(_turn("b", 0, 0, 3))
    planner.end_trajectory("b", 2)
    planner.arrive("g", "b", 0.0, 5)  # closes the group: the bucket is folded, b's row runs direct
    kinds = [type(op) for op in planner.next_ops()]
    assert kinds.count(TurnBackwardOp) == 1 and FoldOp in kinds and BackwardOp in kinds
    assert planner.finalize().scale == pytest.approx(1 / 9)  # token-mean: 4 + 5 scored tokens


def test_the_task_planner_refuses_token_counts_that_disagree(shipped):
    planner = OPDTaskPlanner.from_verl_config(shipped)
    planner.begin_batch(["a"], {"g": 1})
    planner.add_turn(_turn("a", 0, 0, 4))
    planner.end_trajectory("a", 1)
    planner.arrive("g", "a", 1.0, 6)  # 6 tokens reported, 4 scored by the turns
    planner.next_ops()
    with pytest.raises(StreamingStateError, match="normaliser"):
        planner.finalize()
