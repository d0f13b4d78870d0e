"""verl's ``distillation`` settings, read once: what turn streaming runs, and what it refuses before any work.

Why:
1. verl 0.9.1's distillation loss (``verl/trainer/distillation/losses.py``, ``distillation_ppo_loss``) has three
   switches: ``loss_mode`` (a single-sample estimator of KL(student || teacher) per sampled token: k1/kl, abs,
   mse/k2, low_var_kl/k3; or ``forward_kl_topk``), ``use_policy_gradient`` (true: A_t = -estimator, detached, in
   verl's vanilla policy loss; false: the estimator itself backpropagated as a supervised loss through
   ``agg_loss``) and ``use_task_rewards`` (true: verl's ``ppo_loss`` with the task-reward advantages plus
   ``distillation_loss_coef`` x the distillation loss; false: the distillation loss alone, coefficient 1).
   ``loss_max_clamp`` clamps the per-token estimator in both forms. Shipped defaults (``distillation.yaml``):
   k3, supervised, task rewards on, coefficient 1, no clamp.
2. Every single-sample estimator streams per turn in both forms: a token's loss (or advantage) depends on that
   token's student and teacher log-probs only, fixed once the teacher has scored its turn. The task-reward term
   streams as GRPO does (``opd_task.py``). ``OPDLoss`` is the one reading of these keys: the driver's planners,
   the chunks (``chunk_layout.build_token_chunk``) and the learner's loss (``stream_loss.py`` point 9) get it here.
3. Refused, naming the key (``opd_loss_from_verl_config``):
   - ``loss_mode=forward_kl_topk``: its loss needs, per token, the teacher's top-k log-probs and token ids
     (``teacher_logprobs``/``teacher_ids`` [.., topk]) and the student's full-vocabulary logits in verl's logits
     processor (``distillation_use_topk``). The turn teacher asks verl's teacher server for the sampled token's
     log-prob only (``prompt_logprobs=0``, ``turn_teacher.TEACHER_SAMPLING``) and the streamed chunk's loss sees the
     sampled tokens' log-probs only: neither carries the top-k distribution.
   - ``use_policy_gradient=false`` with ``loss_mode=k1``: verl refuses it too (its gradient does not depend on the
     teacher). ``kl`` (the same estimator under verl's other name) verl accepts, and so does this (same update).
   - ``policy_loss_mode`` other than vanilla with the policy-gradient form (verl refuses it as well): the streamed
     loss is -A_t log pi at ratio 1.
   - an unknown ``loss_mode``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from thundersync_verl.core import StreamingConfigError
from thundersync_verl.core.config_validation import config_value as _get
from thundersync_verl.core.errors import fail

ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")  # verl's single-sample estimators (use_estimator)
TOPK_MODES = ("forward_kl_topk",)  # verl's top-k losses (use_topk): refused (point 3)
KEY = "distillation.distillation_loss"


@dataclass(frozen=True)
class OPDLoss:
    """The distillation term of one batch (point 1); the defaults are the project's original k1 policy gradient."""

    estimator: str = "k1"
    policy_gradient: bool = True
    use_task_rewards: bool = False
    coef: float = 1.0  # distillation_loss_coef with task rewards, 1 without (as verl)
    clamp: float | None = None  # loss_max_clamp

    def __post_init__(self):
        problems = check_loss(self.estimator, self.policy_gradient)
        if problems:
            fail("OPD turn streaming refuses " + "; ".join(p for p, _ in problems),
                 "; ".join(w for _, w in problems), "see thundersync_verl/algos/opd/opd_config.py point 3",
                 StreamingConfigError)
        if self.clamp is not None and not float(self.clamp) > 0:
            fail(f"{KEY}.loss_max_clamp must be positive or null (got {self.clamp!r})",
                 "it bounds the per-token distillation loss", f"set {KEY}.loss_max_clamp=null or a positive value",
                 StreamingConfigError)

    @property
    def supervised(self) -> bool:
        return not self.policy_gradient

    def describe(self) -> dict:
        """The settings as the results JSON records them."""
        return {"loss_mode": self.estimator, "use_policy_gradient": self.policy_gradient,
                "use_task_rewards": self.use_task_rewards, "distillation_loss_coef": self.coef,
                "loss_max_clamp": self.clamp}


def check_loss(estimator: str, policy_gradient: bool, policy_loss_mode: str = "vanilla") -> list[tuple[str, str]]:
    """(setting, why) for each refused part of these distillation settings (point 3); empty when they stream."""
    out = []
    if estimator in TOPK_MODES:
        out.append((f"{KEY}.loss_mode={estimator}",
                    "its loss needs the teacher's top-k log-probs and ids per token and the student's full logits "
                    "(verl's logits processor); the turn teacher scores the sampled token only (prompt_logprobs=0) "
                    "and a streamed chunk's loss sees the sampled tokens' log-probs only: use k3 (verl's default), "
                    "k2, abs or low_var_kl, or train forward_kl_topk with mode=sync"))
    elif estimator not in ESTIMATORS:
        out.append((f"{KEY}.loss_mode={estimator!r}", f"unknown to verl 0.9.1; its estimators are {list(ESTIMATORS)}"))
    elif estimator == "k1" and not policy_gradient:
        out.append((f"{KEY}.loss_mode=k1 with use_policy_gradient=false",
                    "verl refuses it too: the gradient of k1 does not depend on the teacher; use k3, or "
                    "use_policy_gradient=true"))
    if policy_gradient and policy_loss_mode != "vanilla":
        out.append((f"{KEY}.policy_loss_mode={policy_loss_mode!r}",
                    "the streamed distillation policy gradient is verl's vanilla loss at ratio 1 "
                    "(verl refuses others too)"))
    return out


def opd_loss_from_verl_config(config: Any) -> OPDLoss:
    """verl's ``distillation.distillation_loss`` as an ``OPDLoss``; refuses what does not stream (point 3)."""
    dist = _get(config, "distillation")
    if not bool(_get(dist, "enabled", False)):
        fail("OPD turn streaming needs distillation.enabled=true", "without it verl trains no distillation term",
             "set distillation.enabled=true", StreamingConfigError)
    loss = _get(dist, "distillation_loss")
    estimator = str(_get(loss, "loss_mode", "k3"))
    policy_gradient = bool(_get(loss, "use_policy_gradient", False))
    problems = check_loss(estimator, policy_gradient, str(_get(loss, "policy_loss_mode", "vanilla")))
    if problems:
        fail("OPD turn streaming refuses " + ", ".join(p for p, _ in problems), "; ".join(w for _, w in problems),
             "change " + ", ".join(p.split("=")[0] for p, _ in problems), StreamingConfigError)
    tasks = bool(_get(loss, "use_task_rewards", True))
    clamp = _get(loss, "loss_max_clamp")
    return OPDLoss(estimator=estimator, policy_gradient=policy_gradient, use_task_rewards=tasks,
                   coef=float(_get(loss, "distillation_loss_coef", 1.0)) if tasks else 1.0,
                   clamp=None if clamp is None else float(clamp))
