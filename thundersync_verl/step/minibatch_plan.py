"""Several optimizer steps per batch: verl's mini-batches and PPO epochs, streamed.

Why:
1. verl's sync loop cuts a batch into K = train_batch_size / ppo_mini_batch_size mini-batches, takes
   one optimizer step per mini-batch, and repeats the K steps ppo_epochs (E) times. Mini-batch j runs at
   the weights after step j-1, with PPO's ratio and clip against the batch's old log-probs.
2. The partition, stated plainly: mini-batch j is the next ``ppo_mini_batch_size`` COMPLETE groups in
   the order their groups complete (their last trajectory lands). It is one legal partition of the
   batch into equal mini-batches of whole groups; verl shuffles its mini-batches too
   (``actor.shuffle``), so any fixed partition is one verl could have drawn. Epochs >= 2 reuse it.
3. Mini-batch 1 of epoch 1 streams exactly as a one-step batch does (``StreamPlanner``: ratio 1,
   buckets for open groups, deferred normaliser) while trajectories land. Once its
   ``ppo_mini_batch_size`` groups are complete, the buckets of groups that did not make it are
   dropped (folded with coefficient 0: the gradient is untouched, the buffers freed) and a ``StepOp``
   follows; those trajectories run again in their own mini-batch.
4. Mini-batches j >= 2 hold complete groups only, so every advantage is known: their trajectories
   run as ``PPOBackwardOp`` chunks straight into the gradient (verl's policy loss with the ratio to
   the batch's log-probs, ``minibatch_loss.py``) as soon as step j-1 is queued, and their ``StepOp``
   comes once all their groups have landed and been planned. Epochs >= 2 follow the last arrival.
   Each step's normaliser is its mini-batch's (tokens or sequences of that mini-batch), as verl's.
5. Generation stays at the batch's weights (staleness 0); the policy lag of mini-batch j of epoch e,
   (e-1) x K + (j-1) optimizer steps, is what verl's sync loop has too, and is reported per step.
6. verl steps the LR scheduler once per batch, after the last mini-batch: only the last step does.
   That last step is ``finalize()``'s ``FinalizeOp``; the others are ops in the stream, in order.
7. KL loss and entropy bonus (``independent_buckets``): a bucketed row's KL/entropy part does not
   depend on the advantage, but it belongs to the row's mini-batch, which is unknown until its group
   completes. So it is held in a companion bucket (``stream_plan.independent_key``) next to the policy
   part: folded with coefficient 1 when the group lands in mini-batch 1, with 0 when it is dropped (the
   row then runs again, KL and entropy included, as a PPO chunk of its own mini-batch). Each bucket then
   costs two buffers on the learner (``grpo_algorithm.build_planner`` budgets for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping

from thundersync_verl.core import StreamingConfigError, StreamingInputError, StreamingStateError, batch_scale
from thundersync_verl.core.errors import rule_message
from thundersync_verl.core.groups import canonical_sorted
from thundersync_verl.step.stream_plan import BackwardOp, FinalizeOp, FoldOp, StreamPlanner, independent_key
from thundersync_verl.step.contracts import PlannerDefaults

Item = tuple[Hashable, Hashable]


@dataclass(frozen=True)
class PPOBackwardOp:
    """Backpropagate ``items`` into the gradient with verl's PPO ratio and clip; ``coefs[i]`` is row i's advantage."""

    items: tuple[Item, ...]
    coefs: tuple[float, ...]
    num_tokens: tuple[int, ...]
    minibatch: int  # 1-based, in the partition of point 2
    epoch: int  # 1-based
    dest: str = "direct"


@dataclass(frozen=True)
class StepOp:
    """Mini-batch ``minibatch`` of ``epoch`` is in the gradient: scale, clip, optimizer step (LR step if ``lr_step``)."""

    scale: float
    num_tokens: int
    num_sequences: int
    minibatch: int
    epoch: int
    lr_step: bool
    policy_lag: int  # optimizer steps of this batch before this mini-batch's backwards


class MiniBatchPlanner(PlannerDefaults):
    """The ``Planner`` of a batch with several optimizer steps (module docstring)."""

    def __init__(self, first: StreamPlanner, *, minibatch_groups: int, epochs: int = 1, independent_buckets: bool = False):
        if int(minibatch_groups) < 1 or int(epochs) < 1:
            raise StreamingConfigError(rule_message(
                f"a mini-batch needs >= 1 group and >= 1 epoch (got {minibatch_groups}, {epochs})",
                "each mini-batch is ppo_mini_batch_size complete groups, repeated ppo_epochs times",
                "pass actor.ppo_mini_batch_size and actor.ppo_epochs from the validated config"))
        self.first, self.mb_groups, self.epochs = first, int(minibatch_groups), int(epochs)
        self.loss_agg_mode, self.max_chunk_size = first.loss_agg_mode, first.max_chunk_size
        self.estimator, self.verl_settings = first.estimator, first.verl_settings
        self.independent_buckets = bool(independent_buckets)  # point 7: the learner keeps KL/entropy companions
        self.steps: list[StepOp] = []

    # ----- batch lifecycle ----------------------------------------------------------------
    def begin_batch(self, group_sizes: Mapping[Hashable, int]) -> None:
        """Declare the batch's groups {group_id: n}; their count must be a multiple of the mini-batch's."""
        if not group_sizes or len(group_sizes) % self.mb_groups:
            raise StreamingConfigError(rule_message(
                f"a batch of {len(group_sizes)} groups cannot be cut into mini-batches of {self.mb_groups} groups",
                "every mini-batch is the same number of complete groups, one optimizer step each",
                "make data.train_batch_size a multiple of actor_rollout_ref.actor.ppo_mini_batch_size"))
        self.first.begin_batch(group_sizes)
        self._sizes = dict(group_sizes)
        self.k = len(group_sizes) // self.mb_groups
        self._rows: dict[Hashable, dict[Hashable, tuple[float, int]]] = {g: {} for g in group_sizes}
        self._members: list[list[Hashable]] = [[] for _ in range(self.k)]  # groups of each mini-batch
        self._cursor = (1, 1)  # (epoch, mini-batch) whose backwards are being planned
        self._planned: set[Item] = set()  # items planned for the cursor's mini-batch
        self._buckets: dict[Hashable, dict[str, int]] = {}  # phase 1: open group -> {bucket key: rows}
        self._sealed = False  # mini-batch 1 of epoch 1 handed over to PPO planning
        self._final: FinalizeOp | None = None
        self.steps, self.rerun_rows = [], 0

    def arrive(self, group_id: Hashable, traj_id: Hashable, reward: float, num_tokens: int) -> None:
        """A finished trajectory; mini-batch 1's phase streams it at once (``StreamPlanner.arrive``)."""
        rows = self._rows.get(group_id)
        if rows is None or traj_id in rows:
            raise StreamingInputError(rule_message(
                f"trajectory {(group_id, traj_id)!r} is unknown to this batch or arrived twice",
                "each trajectory's gradient must enter each of its mini-batch's steps exactly once",
                "declare every group in begin_batch and give every trajectory its own id"))
        if len(self._members[0]) < self.mb_groups:  # mini-batch 1 still fills: stream as a one-step batch
            self.first.arrive(group_id, traj_id, reward, num_tokens)
        rows[traj_id] = (float(reward), int(num_tokens))
        if len(rows) == self._sizes[group_id]:
            self._members[next(j for j, m in enumerate(self._members) if len(m) < self.mb_groups)].append(group_id)

    # ----- scheduling ---------------------------------------------------------------------
    @property
    def ready_count(self) -> int:
        """Trajectory backwards ``next_ops`` would plan now (later steps' too: their steps are ops as well).

        Before mini-batch 1 is sealed: its planner's ready rows (the row that completes mini-batch 1 is
        one of them, so the seal is never missed); rows of later mini-batches wait for the seal.
        """
        if not self._sealed:
            return self.first.ready_count
        count, (epoch, mb), planned = 0, self._cursor, len(self._planned)
        while self._final is None and epoch <= self.epochs and (epoch == 1 or self._complete()):
            members = self._members[mb - 1]
            count += sum(len(self._rows[g]) for g in members) - planned
            planned = 0
            if len(members) < self.mb_groups:
                break
            epoch, mb = (epoch, mb + 1) if mb < self.k else (epoch + 1, 1)
        return count

    def next_ops(self) -> list:
        """Ops in learner order: phase-1 backwards and folds, then PPO chunks and steps as far as possible."""
        ops: list = []
        if not self._sealed:
            ops += self._stream_first()
            if not self._sealed:
                return ops
        while self._final is None and self._advance(ops):
            pass
        return ops

    def finalize(self) -> FinalizeOp:
        """The last step of the batch (LR step included), once every mini-batch of every epoch is planned."""
        if self._final is None:
            epoch, mb = self._cursor
            raise StreamingStateError(rule_message(
                f"finalize refused: mini-batch {mb} of epoch {epoch} is not complete "
                f"({sum(len(r) for r in self._rows.values())} of {sum(self._sizes.values())} trajectories landed)",
                "every mini-batch's optimizer step needs all of its groups",
                "let the missing trajectories arrive and call next_ops() until it returns nothing"))
        return self._final

    # ----- phase 1: mini-batch 1 streams ----------------------------------------------------
    def _stream_first(self) -> list:
        first_groups = set(self._members[0])
        sealing = len(first_groups) == self.mb_groups
        if sealing:
            self.first.withdraw(first_groups)  # open groups' ready rows wait for their own mini-batch
        ops = self.first.next_ops()
        for op in ops:
            if isinstance(op, BackwardOp) and op.dest != "direct":
                rows = self._buckets.setdefault(op.items[0][0], {})
                rows[op.dest] = rows.get(op.dest, 0) + len(op.items)
            elif isinstance(op, FoldOp):
                self._buckets.pop(op.group_id, None)
        ops = [self._with_companions(op, 1.0) if isinstance(op, FoldOp) else op for op in ops]
        if not sealing:
            return ops
        if self.first.ready_count:
            raise StreamingStateError("mini-batch 1 sealed with rows left in its planner (a planner bug)")
        for gid in sorted(self._buckets, key=repr):  # dropped: the coefficient 0 leaves the gradient untouched
            ops.append(self._with_companions(FoldOp(gid, {key: 0.0 for key in sorted(self._buckets[gid])}), 0.0))
            self.rerun_rows += sum(self._buckets[gid].values())
        self._buckets = {}
        self.first.end_batch()
        self._sealed = True
        self._close_step(ops, epoch=1, mb=1)
        return ops

    def _with_companions(self, op: FoldOp, coef: float) -> FoldOp:
        """Point 7: the fold of a group's buckets plus their KL/entropy companions (1: kept, 0: dropped)."""
        if not self.independent_buckets:
            return op
        return FoldOp(op.group_id, {**op.folds, **{independent_key(k): coef for k in op.folds}})

    # ----- mini-batches after the first, and later epochs ------------------------------------
    def _advance(self, ops: list) -> bool:
        """Plan what the cursor's mini-batch can run now; True when its step was planned (the cursor moved)."""
        epoch, mb = self._cursor
        members = self._members[mb - 1]
        if epoch >= 2 and not self._complete():
            return False
        todo = [(g, t) for g in members for t in canonical_sorted(self._rows[g]) if (g, t) not in self._planned]
        for start in range(0, len(todo), self.max_chunk_size):
            ops.append(self._ppo_chunk(todo[start:start + self.max_chunk_size], epoch, mb))
        self._planned.update(todo)
        if len(members) < self.mb_groups:
            return False
        self._close_step(ops, epoch=epoch, mb=mb)
        return True

    def _ppo_chunk(self, items: list[Item], epoch: int, mb: int) -> PPOBackwardOp:
        adv = {}
        for gid in {g for g, _ in items}:
            tids = canonical_sorted(self._rows[gid])
            values = self.estimator.advantages([self._rows[gid][t][0] for t in tids])
            adv.update({(gid, t): a for t, a in zip(tids, values)})
        return PPOBackwardOp(tuple(items), tuple(float(adv[it]) for it in items),
                             tuple(self._rows[g][t][1] for g, t in items), mb, epoch)

    def _close_step(self, ops: list, *, epoch: int, mb: int) -> None:
        """The step of the cursor's mini-batch (the last one is ``finalize()``'s); move the cursor on."""
        groups = self._members[mb - 1]
        tokens = sum(n for g in groups for _, n in self._rows[g].values())
        sequences = sum(self._sizes[g] for g in groups)
        scale = batch_scale(self.loss_agg_mode, num_tokens=tokens, num_sequences=sequences, dp_size=1,
                            loss_scale_factor=self.first.loss_scale_factor)
        if scale is None:
            raise StreamingStateError(rule_message(
                f"mini-batch {mb} of epoch {epoch} has no scored tokens",
                f"the {self.loss_agg_mode} normaliser divides by that count (verl would produce NaN)",
                "drop the batch (begin_batch again) instead of stepping"))
        last = epoch == self.epochs and mb == self.k
        step = StepOp(scale, tokens, sequences, mb, epoch, last, (epoch - 1) * self.k + mb - 1)
        self.steps.append(step)
        if last:
            self._final = FinalizeOp(scale, tokens, sequences)
        else:
            ops.append(step)
        self._cursor = (epoch, mb + 1) if mb < self.k else (epoch + 1, 1)
        self._planned = set()

    def _complete(self) -> bool:
        return all(len(self._rows[g]) == n for g, n in self._sizes.items())

    # ----- accounting ---------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        return self.first.memory()

    def metrics(self) -> dict[str, float]:
        """Per-step policy lag (optimizer steps of this batch before each mini-batch ran), as verl's sync loop has."""
        lags = [s.policy_lag for s in self.steps]
        return {"thundersync/optimizer_steps": len(self.steps), "thundersync/minibatch_policy_lag/mean":
                sum(lags) / max(len(lags), 1), "thundersync/minibatch_policy_lag/max": max(lags, default=0),
                "thundersync/minibatch_rerun_rows": self.rerun_rows}
