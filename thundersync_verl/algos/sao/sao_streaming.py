"""Streamed SAO, the driver side: the planner and the client (the chunk loss runs in the learner: ``sao_loss.py``).

Why:
1. SAO's policy loss is -A_t r_t m_t with r_t = pi / pi_rollout and the detached, sign-independent band
   mask m_t (``core/sao.py``): linear in A. A trajectory's per-token coefficients are final when it arrives
   with its reward and the critic's values (``core/sao_stream.py``): its GAE g_t goes straight into the
   batch gradient, and a second backward with coefficient 1 per agent token goes into the batch's one
   whitening bucket, folded with -mean at the barrier; the normaliser (1 / agent tokens, token-mean) is
   multiplied by inv_std. The result is verl's ``update_actor`` with ``adv_estimator=sao`` and
   ``policy_loss.loss_mode=sao`` on the whole batch.
2. The loss is the core's ``sao_policy_loss`` on each chunk, with the chunk's per-token coefficients in
   place of the advantages and the rollout log-probs carried in ``ts_rollout_log_prob`` (verl's bypass mode
   makes old_log_prob = rollout_log_prob; so does this chunk). The band rides as two non-tensor floats.
   Summed, not averaged, times dp_size (as every streamed chunk, ``stream_loss.py`` point 3).
3. ``sao_settings`` is the worker's check of the actor config for SAO streaming: one optimizer step per
   batch (one epoch, one mini-batch), policy loss ``sao``, a mode whose normaliser can be deferred, no KL or
   entropy term (the per-token path carries the policy term only). verl's generic streaming validator
   refuses ``loss_mode=sao`` (it accepts only losses linear at ratio 1); this one knows SAO's mask.
4. Not here: the critic's own streamed update (``critic_stream.py``) and the ThunderSync trainer's arrival
   loop (``sao_trainer_step.py``: the critic's forward on arrival, this planner behind ``StreamedStep``).
   ``tests/harness/sao_steps.py`` drives this module against verl's ``update_actor`` on the FSDP2 engine.
5. Cost: with whitening every trajectory is backpropagated twice (its GAE row and its bucket row), where
   verl's update runs one pass over the batch; a trajectory's two backwards run while later ones are still
   generated. Without whitening (``whiten=False``) one backward. Rollout importance weights
   (``algorithm.rollout_correction.rollout_is``, which verl's ``sao`` loss would multiply in) are not carried
   by SAO chunks: a caller must refuse them.
Flow: begin_batch(ids) -> arrive(SAOTrajectory) ... -> next_ops() -> client.run(ops) -> finalize() -> barrier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingConfigError, StreamingStateError, batch_scale
from thundersync_verl.core.errors import fail
from thundersync_verl.core.normalizers import check_loss_agg_mode, token_weight
from thundersync_verl.core.sao_stream import SAO_BUCKET, WhitenLedger, actor_token_coefficients, trajectory_gae
from thundersync_verl.step.chunk_layout import build_token_chunk
from thundersync_verl.step.stream_plan import FinalizeOp

NAME = "sao"
EPS_LOW_KEY, EPS_HIGH_KEY = "ts_sao_eps_low", "ts_sao_eps_high"  # non-tensor: the double-sided band
MASKED_METRIC, SCORED_METRIC = "stream/sao_masked_tokens", "stream/scored_tokens"



# ----- driver side --------------------------------------------------------------------------------
@dataclass(frozen=True)
class SAOTrajectory:
    """One finished single-rollout trajectory with its reward and the critic's values (per response token)."""

    traj_id: Hashable
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    agent_mask: tuple[int, ...]  # 1 on the agent's tokens, 0 on tool observations
    rewards: tuple[float, ...]  # token-level rewards (the score on the last agent token)
    values: tuple[float, ...]  # the critic's values at the step-start weights
    rollout_log_probs: tuple[float, ...]  # the rollout engine's log-probs of the response tokens

    def __post_init__(self):
        for name in ("prompt", "response", "agent_mask", "rewards", "values", "rollout_log_probs"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        n = len(self.response)
        if not n or any(len(getattr(self, k)) != n for k in ("agent_mask", "rewards", "values", "rollout_log_probs")):
            fail(f"trajectory {self.traj_id!r}: agent_mask, rewards, values and rollout_log_probs need one entry "
                  f"per response token ({n})", "SAO's coefficients are per token",
                  "pass the unpadded per-token lists of the response")
        if not all(math.isfinite(float(x)) for x in self.rollout_log_probs):
            fail(f"trajectory {self.traj_id!r}: rollout log-probs must be finite", "the band mask compares "
                  "the learner's log-probs with them", "check the rollout engine's log-probs")


@dataclass(frozen=True)
class SAOBackwardOp:
    """Backpropagate ``rows`` (trajectory, per-token coefficients) into ``dest`` ("direct" or the bucket)."""

    rows: tuple[tuple[SAOTrajectory, tuple[float, ...]], ...]
    dest: str
    band: tuple[float, float] = (0.2, 0.2)  # (eps_low, eps_high): actor.clip_ratio_low / clip_ratio_high

    @property
    def items(self) -> tuple[Hashable, ...]:
        return tuple(t.traj_id for t, _ in self.rows)


class SAOStreamPlanner:
    """Arrivals -> per-token coefficients and chunks; the deferred whitening and normaliser at the barrier."""

    def __init__(self, *, eps_low: float, eps_high: float, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True,
                 loss_agg_mode: str = "token-mean", loss_scale_factor: float | None = None, max_chunk_size: int = 4):
        check_loss_agg_mode(loss_agg_mode, loss_scale_factor)
        if not (float(eps_low) > 0 and float(eps_high) > 0):
            fail(f"band offsets must be positive (got {eps_low}, {eps_high})", "the band must contain ratio 1",
                  "set actor.clip_ratio_low / clip_ratio_high", StreamingConfigError)
        self.band = (float(eps_low), float(eps_high))
        if int(max_chunk_size) < 1:
            fail(f"max_chunk_size must be >= 1 (got {max_chunk_size})", "a chunk holds at least one trajectory",
                  "use e.g. 4", StreamingConfigError)
        self.gamma, self.lam, self.whiten = float(gamma), float(lam), bool(whiten)
        self.loss_agg_mode, self.loss_scale_factor = loss_agg_mode, loss_scale_factor
        self.max_chunk_size = int(max_chunk_size)
        self._ids: set | None = None

    def begin_batch(self, traj_ids: Iterable[Hashable]) -> None:
        ids = list(traj_ids)
        if not ids or len(set(ids)) != len(ids):
            fail("a batch needs distinct trajectory ids, at least one", "each trajectory is counted once",
                  "pass each id once")
        self._ids, self._ledger = set(ids), WhitenLedger()
        self._ready: dict[str, list] = {"direct": [], SAO_BUCKET: []}
        self.num_tokens, self.num_sequences, self.returns = 0, 0, {}

    def arrive(self, traj: SAOTrajectory) -> None:
        """The trajectory's reward and critic values exist: its coefficients are final (core/sao_stream point 1)."""
        if self._ids is None:
            fail("no SAO batch open", "trajectories belong to one batch", "call begin_batch first", StreamingStateError)
        if traj.traj_id not in self._ids:
            fail(f"trajectory {traj.traj_id!r} is not in this batch", "its weights may differ from the batch's",
                  "list it in begin_batch")
        gae, returns = trajectory_gae(traj.rewards, traj.values, traj.agent_mask, gamma=self.gamma, lam=self.lam)
        self._ledger.add(traj.traj_id, gae, traj.agent_mask)
        n_agent = sum(1 for m in traj.agent_mask if m)
        w = token_weight(self.loss_agg_mode, n_agent)
        for dest, coefs in actor_token_coefficients(gae, traj.agent_mask, whiten=self.whiten).items():
            self._ready[dest].append((traj, tuple(c * w for c in coefs)))
        self.num_tokens += n_agent
        self.num_sequences += 1 if n_agent else 0
        self.returns[traj.traj_id] = returns.tolist()

    def next_ops(self, max_chunk_size: int | None = None) -> list[SAOBackwardOp]:
        """Every ready row in chunks: per chunk its direct backward, then its bucket backward."""
        size = int(max_chunk_size or self.max_chunk_size)
        direct, bucket = self._ready["direct"], self._ready[SAO_BUCKET]
        ops = []
        for i in range(0, len(direct), size):
            ops.append(SAOBackwardOp(tuple(direct[i : i + size]), "direct", self.band))
            if bucket:
                ops.append(SAOBackwardOp(tuple(bucket[i : i + size]), SAO_BUCKET, self.band))
        self._ready = {"direct": [], SAO_BUCKET: []}
        return ops

    def finalize(self) -> tuple[dict, FinalizeOp]:
        """``(folds, FinalizeOp)``: fold the bucket with -mean, then step with the normaliser times inv_std."""
        if self._ids is None or len(self._ledger) != len(self._ids) or any(self._ready.values()):
            fail(f"finalize refused: {len(self._ledger) if self._ids else 0} of {len(self._ids or ())} trajectories "
                  "arrived and were planned", "the whitening statistics and the step need every trajectory",
                  "arrive every trajectory and run next_ops() first", StreamingStateError)
        scale = batch_scale(self.loss_agg_mode, num_tokens=self.num_tokens, num_sequences=self.num_sequences,
                            dp_size=1, loss_scale_factor=self.loss_scale_factor)
        if scale is None:
            fail("finalize refused: the batch has no agent tokens", "the normaliser divides by them",
                  "drop the batch", StreamingStateError)
        folds = {}
        if self.whiten:
            fold = self._ledger.fold()
            folds, scale = {SAO_BUCKET: fold.bucket_coef}, fold.scale(scale)
        self._ids = None
        return folds, FinalizeOp(scale, self.num_tokens, self.num_sequences)


def sao_chunk(op: SAOBackwardOp, *, dp_size: int, pad_token_id: int, temperature: float = 1.0):
    """The per-token chunk of one op for ``stream_token_backward`` (the band as two non-tensor floats)."""
    trajs = [t for t, _ in op.rows]
    chunk = build_token_chunk([t.prompt for t in trajs], [t.response for t in trajs], [c for _, c in op.rows],
                              dp_size=dp_size, pad_token_id=pad_token_id, dest=op.dest, temperature=temperature,
                              rollout_log_probs=[t.rollout_log_probs for t in trajs])
    va.assign_non_tensor(chunk, **{EPS_LOW_KEY: op.band[0], EPS_HIGH_KEY: op.band[1]})
    return chunk


class SAOStreamClient:
    """Sends the planner's SAO chunks, folds and barrier to a worker group of ``StreamingActorWorker``, one
    blocking call each (the trainer-side ``stream_exec.OpPipeline`` queues the same ops)."""

    def __init__(self, worker_group, *, pad_token_id: int, temperature: float = 1.0, dp_size: int | None = None):
        self.wg, self.pad_token_id, self.temperature = worker_group, int(pad_token_id), float(temperature)
        self.dp_size = int(dp_size or va.actor_dp_size(worker_group))

    def begin_batch(self, meta: dict) -> None:
        self.wg.stream_begin_batch({**meta, "adv_estimator": NAME})

    def chunk(self, op: SAOBackwardOp):
        return sao_chunk(op, dp_size=self.dp_size, pad_token_id=self.pad_token_id, temperature=self.temperature)

    def run(self, ops: Sequence[SAOBackwardOp]) -> list:
        return [self.wg.stream_token_backward(self.chunk(op)) for op in ops]

    def finalize(self, folds: dict, op: FinalizeOp) -> dict:
        if folds:
            self.wg.stream_fold(folds)
        return self.wg.finalize_step(op.scale)[0]
