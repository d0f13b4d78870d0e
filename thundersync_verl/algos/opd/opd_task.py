"""OPD with task rewards (verl's shipped default ``use_task_rewards: true``), streamed: two terms, one barrier.

Why:
1. verl's ``distillation_ppo_loss`` with task rewards is, term by term,
       L = ppo_loss(A^task) + coef * D,
   ``ppo_loss`` the task-reward policy loss (verl's advantage estimator on the trajectories' rewards, GRPO by
   default) and D the distillation loss (``opd_config.py`` point 1: supervised ``agg_loss(est)`` or the policy
   gradient with A_t = -est), both aggregated by ``agg_loss`` with the same ``loss_agg_mode`` and the same global
   normaliser (``batch_num_tokens`` / ``global_batch_size``). With one optimizer step per batch (ratio 1) the
   gradient is
       g = c_batch * ( sum_i A_i * G_i  +  coef * sum_{turns j} grad sum_{t in j} w_t d_t ),
   G_i = grad(-sum_t w_{i,t} log pi) the trajectory's policy term, d_t the token's distillation loss.
2. The two terms have different inputs, so each streams on its own schedule:
   - the distillation term of a turn is fixed once the teacher has scored it, and is reward-independent (the KL
     loss of the GRPO stream, with the teacher as reference): each turn's prefix row goes straight into the batch
     gradient, ``ts_coef`` = coef (``OPDTurnPlanner``, ``TurnBackwardOp`` -> ``stream_token_backward``);
   - the task term of a trajectory needs its group's rewards (GRPO's deferred group statistics): the landed
     trajectory (reward known) goes to the GRPO ``StreamPlanner``, whose row runs straight into the batch gradient
     once its group has closed (coefficient A_i), or earlier into a (group, reward) bucket folded with A(r) when the
     group closes (``BackwardOp`` / ``FoldOp`` -> ``stream_backward`` / ``stream_fold``). A bucket holds the task
     term only: the distillation term never enters a bucket, so no fold scales it.
3. One barrier: both planners' deferred normalisers are the same number (token-mean: 1 / scored tokens of the
   batch, the turns' tokens being exactly the trajectories' mask-1 tokens; seq-mean modes: 1 / trajectories).
   ``finalize`` checks that they agree (an estimator with a barrier factor, e.g. GPG's alpha, would scale the
   distillation term too: refused there) and returns one ``FinalizeOp``.
4. Order: turns and trajectories arrive in any order; the ops of both planners are independent except a fold after
   its bucket's backwards, which the GRPO planner already orders. ``next_ops`` returns the turn ops, then the GRPO
   planner's (its folds first). seq-mean-token-mean stays refused (a turn's weight 1/|o_i| needs the trajectory's
   final length: ``core.check_opd_turn_mode``).
Flow: begin_batch(traj_ids, group_sizes) -> add_turn / end_trajectory (scored turns) and arrive(group, traj,
reward, num_tokens) (landed trajectories) in any order -> next_ops() -> finalize().
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Iterable, Mapping

from thundersync_verl.algos.opd.opd_stream import OPDTurn, OPDTurnPlanner, opd_planner_from_verl_config
from thundersync_verl.core import StreamingConfigError, StreamingStateError
from thundersync_verl.core.errors import fail
from thundersync_verl.step.contracts import PlannerDefaults
from thundersync_verl.step.stream_plan import FinalizeOp, StreamPlanner, settings_from_verl_config

SCALE_RTOL = 1e-12  # the two planners compute the same normaliser from the same counts


class OPDTaskPlanner(PlannerDefaults):
    """The distillation turns and the task-reward trajectories of one batch (module docstring)."""

    def __init__(self, turns: OPDTurnPlanner, task: StreamPlanner):
        if not turns.loss.use_task_rewards:
            fail("OPDTaskPlanner streams distillation_loss.use_task_rewards=true", "without task rewards verl's loss "
                 "is the distillation term alone", "use OPDTurnPlanner", StreamingConfigError)
        if (turns.loss_agg_mode, turns.loss_scale_factor) != (task.loss_agg_mode, task.loss_scale_factor):
            fail(f"both terms need one loss_agg_mode (turns {turns.loss_agg_mode!r}, task {task.loss_agg_mode!r})",
                 "verl aggregates ppo_loss and the distillation loss with the actor's one loss_agg_mode",
                 "build both planners from the same config (OPDTaskPlanner.from_verl_config)", StreamingConfigError)
        self.turns, self.task = turns, task
        self.loss = turns.loss
        self.loss_agg_mode = turns.loss_agg_mode
        self.verl_settings = dict(task.verl_settings)

    @classmethod
    def from_verl_config(cls, config: Any, *, max_chunk_size: int = 8) -> "OPDTaskPlanner":
        """Both planners from verl's config: the distillation settings and the task term's estimator and loss."""
        turns = opd_planner_from_verl_config(config, max_chunk_size=max_chunk_size, task_rewards=True)
        task = StreamPlanner.from_settings(settings_from_verl_config(config), max_chunk_size=max_chunk_size)
        return cls(turns, task)

    def begin_batch(self, traj_ids: Iterable[Hashable], group_sizes: Mapping[Hashable, int]) -> None:
        ids = list(traj_ids)
        if len(ids) != sum(group_sizes.values()):
            fail(f"{len(ids)} trajectories but the groups hold {sum(group_sizes.values())}",
                 "every trajectory carries a distillation term (its turns) and a task term (its group)",
                 "list each trajectory once and each group with its size")
        self.turns.begin_batch(ids)
        self.task.begin_batch(group_sizes)

    def add_turn(self, turn: OPDTurn) -> None:
        self.turns.add_turn(turn)

    def end_trajectory(self, traj_id: Hashable, num_turns: int) -> None:
        self.turns.end_trajectory(traj_id, num_turns)

    def arrive(self, group_id: Hashable, traj_id: Hashable, reward: float, num_tokens: int) -> None:
        """A landed trajectory with its task reward (``num_tokens``: its mask-1 tokens)."""
        self.task.arrive(group_id, traj_id, reward, num_tokens)

    @property
    def max_chunk_size(self) -> int:
        return self.turns.max_chunk_size

    @property
    def ready_count(self) -> int:
        return self.turns.ready_count + self.task.ready_count

    @property
    def queued_folds(self) -> int:
        return self.task.queued_folds

    def memory(self) -> dict[str, int]:
        return self.task.memory()

    def next_ops(self, max_chunk_size: int | None = None) -> list:
        """The scored turns' chunks, then the GRPO planner's folds and backward chunks (point 4)."""
        return self.turns.next_ops(max_chunk_size) + self.task.next_ops(max_chunk_size)

    def missing(self) -> list[str]:
        return self.turns.missing() + self.task.pending_work()

    def finalize(self) -> FinalizeOp:
        """One barrier for both terms; their normalisers must agree (point 3)."""
        work = self.missing()
        if work:
            fail("finalize refused: " + "; ".join(work[:6]), "the step must see every turn's distillation term and "
                 "every trajectory's task term", "add the missing turns and trajectories and run next_ops()",
                 StreamingStateError)
        task = self.task.finalize()
        turns = self.turns.finalize()
        if not math.isclose(task.scale, turns.scale, rel_tol=SCALE_RTOL) or task.num_tokens != turns.num_tokens:
            fail(f"the task term's normaliser {task.scale!r} ({task.num_tokens} tokens) differs from the distillation "
                 f"term's {turns.scale!r} ({turns.num_tokens} tokens)",
                 "one barrier scales both; verl divides both by the same batch count (an estimator with a barrier "
                 "factor, e.g. algorithm.adv_estimator=gpg, would scale the distillation term too)",
                 "report each trajectory's mask-1 token count on arrival, and use an estimator without a barrier "
                 "factor (grpo, rloo, ...)", StreamingStateError)
        return task
