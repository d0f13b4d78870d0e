"""The streamed critic update, the driver side: rows, chunks, the planner and the client (the worker: ``critic_worker.py``).

Why:
1. verl's value loss at the step-start weights is 0.5 * agg(max((V-G)^2, (clip(V, V_old +- c) - G)^2)) with
   V = V_old (the values were computed at these weights), so the clip is inactive and its gradient is
   sum_t (V_old_t - G_t) grad V_t times the token-mean normaliser 1/N (N: agent tokens of the batch).
   A trajectory's coefficients c_t = V_old_t - G_t are final when it arrives with its reward and the critic's
   values (``core/sao_stream.py`` point 5): its backward runs then, straight into the critic's gradient; only
   1/N waits for the barrier. The result is verl's ``_update_critic`` with one epoch and one mini-batch.
2. Worker: ``StreamingCriticWorker`` is verl's critic worker (``TrainingWorker`` with the split
   forward_backward / optimizer_step API) plus
       stream_begin_batch(meta)        validate the critic config, zero the gradient
       stream_token_backward(chunk)    loss dp_size * sum_{i,t} c_{i,t} V_{i,t}(theta) into the gradient
       stream_token_backward_nowait(c) the same, returning at once (wait for all before finalize_step)
       finalize_step(scale)            grad *= scale, verl's clip, optimizer step, LR step, zero
       gather_flat_params()            all parameters as one float64 vector (equivalence checks)
   Gradient accumulation and the step are the project's ``StreamLearner`` (``learner/engines``), given
   the critic's engine through ``verl_adapter.engine_owner_view``. The chunk's loss is installed through
   the worker's loss-function seam for the call only, so verl's own ``train_mini_batch`` keeps its value loss.
3. What cannot stream is refused before any work, read from the ``CriticConfig`` verl's trainer binds into
   the value loss (``set_loss_fn(partial(value_loss, config=critic_cfg))``):
   - ``critic.strategy`` other than fsdp/fsdp2 (Megatron's value engine is not checked here);
   - ``critic.loss_agg_mode`` other than token-mean (only its deferred normaliser is verified here);
   - several critic mini-batches per batch (``critic.ppo_mini_batch_size`` != ``data.train_batch_size``):
     a later mini-batch's values would be read at weights that exist only after an earlier step;
   - ``critic.ppo_epochs`` = E > 1 unless the caller states it runs the rest (meta ``critic_later_epochs``
     = E - 1): the stream is the FIRST epoch only, its barrier takes no LR step, and the caller then runs
     verl's ``train_mini_batch`` with ``epochs=E-1`` on the same batch. Every epoch's clip is against the
     stored step-start values, so verl's epochs 2..E are exactly that call (its last iteration steps the LR
     scheduler, once per batch as verl does); ``tests/algos/test_critic_stream_engine_on_cpu.py`` checks it.
4. dp_size: as every streamed chunk, the loss is a sum times dp_size (FSDP2 averages over ranks, so the
   reduced gradient is the sum over all ranks' rows); the driver pads a chunk to a multiple of dp_size with
   rows whose coefficients are all zero (``chunk_layout.build_token_chunk``).
5. Safety metric: a chunk carries the stored values (``ts_old_values``); the loss reports
   max |V(theta) - V_old| over scored tokens (``stream/critic_value_drift_max``). At the step start it is
   rounding; a value above ``critic.cliprange_value`` would mean verl's clip is active and the stream is not
   verl's step (e.g. values computed at other weights).
Driver flow: planner.begin_batch(ids) -> planner.arrive(CriticRow) ... -> client.run(planner.next_chunks())
-> client.finalize(planner.finalize()).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingConfigError, StreamingStateError
from thundersync_verl.core.errors import fail
from thundersync_verl.core.sao_stream import critic_token_coefficients
from thundersync_verl.step.chunk_layout import TOKEN_COEF_KEY, build_token_chunk

OLD_VALUES_KEY = "ts_old_values"  # [B, R] the stored values the coefficients were built from (point 5)
LATER_EPOCHS_KEY = "critic_later_epochs"  # batch meta: epochs the caller runs with train_mini_batch afterwards
DRIFT_METRIC = "stream/critic_value_drift_max"
SCORED_METRIC = "stream/scored_tokens"
SUPPORTED_MODES = ("token-mean",)
VERIFIED_STRATEGIES = ("fsdp", "fsdp2")  # engine keys (critic.strategy) checked against verl's critic update



# ----- driver side --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CriticRow:
    """One trajectory for the critic: its agent mask, the critic's values at the step start and its returns."""

    traj_id: Hashable
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    agent_mask: tuple[int, ...]
    values: tuple[float, ...]
    returns: tuple[float, ...]

    def __post_init__(self):
        for name in ("prompt", "response", "agent_mask", "values", "returns"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        n = len(self.response)
        if not n or not self.prompt or any(len(getattr(self, k)) != n for k in ("agent_mask", "values", "returns")):
            fail(f"critic row {self.traj_id!r}: a non-empty prompt and response, and agent_mask, values and "
                  f"returns with one entry per response token ({n})", "the critic's coefficients are per token",
                  "pass the unpadded per-token lists of the response")
        if not all(math.isfinite(float(x)) for x in self.values + self.returns):
            fail(f"critic row {self.traj_id!r}: values and returns must be finite", "one NaN poisons the critic's "
                  "gradient", "check the critic's forward and the rewards")

    @classmethod
    def of(cls, traj, returns: Sequence[float]) -> "CriticRow":
        """From a trajectory with ``traj_id, prompt, response, agent_mask, values`` (e.g. ``SAOTrajectory``)."""
        return cls(traj.traj_id, traj.prompt, traj.response, traj.agent_mask, traj.values, tuple(returns))

    @property
    def num_tokens(self) -> int:
        return sum(1 for m in self.agent_mask if m)


def critic_chunk(rows: Sequence[CriticRow], *, dp_size: int, pad_token_id: int, temperature: float = 1.0):
    """The per-token chunk of ``rows`` for ``StreamingCriticWorker.stream_token_backward``: c_t = V_t - G_t on
    agent tokens (``core.sao_stream.critic_token_coefficients``), the stored values, padded to dp_size rows."""
    rows = list(rows)
    coefs = [critic_token_coefficients(r.values, r.returns, r.agent_mask) for r in rows]
    chunk = build_token_chunk([r.prompt for r in rows], [r.response for r in rows], coefs, dp_size=dp_size,
                              pad_token_id=pad_token_id, temperature=temperature)
    width = int(chunk[TOKEN_COEF_KEY].shape[1])
    old = torch.zeros(int(chunk.batch_size[0]), width, dtype=torch.float32)  # [B, R], padding rows 0
    for b, r in enumerate(rows):
        old[b, : len(r.values)] = torch.tensor(r.values, dtype=torch.float32)
    chunk[OLD_VALUES_KEY] = old
    return chunk


class CriticStreamPlanner:
    """Arrivals -> critic rows in chunks; the token-mean normaliser 1/N at the barrier (point 1)."""

    def __init__(self, *, loss_agg_mode: str = "token-mean", max_chunk_size: int = 4):
        if loss_agg_mode not in SUPPORTED_MODES:
            fail(f"critic.loss_agg_mode={loss_agg_mode!r} cannot stream", "only the token-mean normaliser is "
                  "deferred here", f"set critic.loss_agg_mode to one of {list(SUPPORTED_MODES)}", StreamingConfigError)
        if int(max_chunk_size) < 1:
            fail(f"max_chunk_size must be >= 1 (got {max_chunk_size})", "a chunk holds at least one trajectory",
                  "use e.g. 4", StreamingConfigError)
        self.max_chunk_size = int(max_chunk_size)
        self._ids: set | None = None

    def begin_batch(self, traj_ids: Iterable[Hashable]) -> None:
        ids = list(traj_ids)
        if not ids or len(set(ids)) != len(ids):
            fail("a critic batch needs distinct trajectory ids, at least one", "each trajectory is counted once in "
                  "the normaliser", "pass each id once")
        self._ids, self._seen, self._ready, self.num_tokens = set(ids), set(), [], 0

    def arrive(self, row: CriticRow) -> None:
        """The trajectory's values and returns exist: its coefficients are final."""
        if self._ids is None:
            fail("no critic batch open", "rows belong to one batch", "call begin_batch first", StreamingStateError)
        if row.traj_id not in self._ids or row.traj_id in self._seen:
            fail(f"critic row {row.traj_id!r} is not in this batch or arrived twice", "each trajectory of the batch "
                  "is counted once", "list it in begin_batch and send it once")
        self._seen.add(row.traj_id)
        self._ready.append(row)
        self.num_tokens += row.num_tokens

    def next_chunks(self, max_chunk_size: int | None = None) -> list[tuple[CriticRow, ...]]:
        size = int(max_chunk_size or self.max_chunk_size)
        ready, self._ready = self._ready, []
        return [tuple(ready[i : i + size]) for i in range(0, len(ready), size)]

    def finalize(self) -> float:
        """The barrier scale 1/N (N: agent tokens of the batch)."""
        if self._ids is None or self._seen != self._ids or self._ready:
            fail(f"critic finalize refused: {len(self._seen) if self._ids else 0} of {len(self._ids or ())} "
                  "trajectories arrived and were sent", "the normaliser counts every agent token of the batch",
                  "arrive every trajectory and run next_chunks() first", StreamingStateError)
        if self.num_tokens == 0:
            fail("critic finalize refused: the batch has no agent tokens", "the normaliser divides by them",
                  "drop the batch", StreamingStateError)
        self._ids = None
        return 1.0 / self.num_tokens


def critic_stream_meta(config) -> dict:
    """The batch meta for ``stream_begin_batch`` from verl's trainer config (``data``, ``critic``)."""
    epochs = int(config.critic.ppo_epochs)
    return {"train_batch_size": int(config.data.train_batch_size), LATER_EPOCHS_KEY: max(epochs - 1, 0)}


class CriticStreamClient:
    """Sends critic chunks and the barrier to a worker group of ``StreamingCriticWorker``, one blocking call each."""

    def __init__(self, worker_group, *, pad_token_id: int, temperature: float = 1.0, dp_size: int | None = None):
        self.wg, self.pad_token_id, self.temperature = worker_group, int(pad_token_id), float(temperature)
        self.dp_size = int(dp_size or va.train_dp_size(worker_group))
        self._pending: list = []

    def begin_batch(self, meta: dict) -> None:
        self._pending = []
        self.wg.stream_begin_batch(meta)

    def chunk(self, rows: Sequence[CriticRow]):
        return critic_chunk(rows, dp_size=self.dp_size, pad_token_id=self.pad_token_id, temperature=self.temperature)

    def run(self, chunks: Sequence[Sequence[CriticRow]], *, wait: bool = True) -> list:
        """One backward per chunk; ``wait=False`` sends them without waiting (``finalize`` waits for them)."""
        if wait:
            return [self.wg.stream_token_backward(self.chunk(rows)) for rows in chunks]
        futures = [self.wg.stream_token_backward_nowait(self.chunk(rows)) for rows in chunks]
        self._pending += futures
        return futures

    def wait(self) -> list:
        """The results of the backwards sent with ``wait=False``, once all have run."""
        done, self._pending = [f.get() for f in self._pending], []
        return done

    def finalize(self, scale: float) -> dict:
        self.wait()
        return self.wg.finalize_step(scale)[0]
