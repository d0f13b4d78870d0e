"""The streamed critic inside verl's critic actor: the chunk loss, the config check and ``StreamingCriticWorker``
(the driver side, and why it is exact: ``critic_stream.py``)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from thundersync_verl.algos.sao.critic_stream import (
    DRIFT_METRIC, LATER_EPOCHS_KEY, OLD_VALUES_KEY, SCORED_METRIC, SUPPORTED_MODES, VERIFIED_STRATEGIES,
)
from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingConfigError, StreamingStateError
from thundersync_verl.core.errors import fail
from thundersync_verl.learner.engines import StreamLearner, make_learner
from thundersync_verl.learner.stream_checks import check_scale, check_token_chunk
from thundersync_verl.step.chunk_layout import COEF_KEY, TOKEN_COEF_KEY, exact_micro_batch_size


def critic_token_loss(model_output, data, dp_group=None):
    """dp_size * sum_{i,t} ts_coef_i * ts_token_coef_{i,t} * V_{i,t}(theta) for one micro-batch (verl signature)."""
    values = va.unpad_response(model_output["values"], data)  # [B, T], aligned as verl's value_loss reads them
    has_old = OLD_VALUES_KEY in data.keys()
    fields = va.padded_fields(data, COEF_KEY, TOKEN_COEF_KEY, *([OLD_VALUES_KEY] if has_old else []))
    token_coef = fields[TOKEN_COEF_KEY].to(device=values.device, dtype=values.dtype)  # [B, T]
    if token_coef.shape != values.shape:
        fail(f"{TOKEN_COEF_KEY} has shape {tuple(token_coef.shape)} but the critic's values have {tuple(values.shape)}",
              "each coefficient multiplies the value of the response token at the same position",
              "build the chunk with critic_stream.critic_chunk")
    coef = token_coef * fields[COEF_KEY].to(device=values.device, dtype=values.dtype).unsqueeze(-1)  # [B, T]
    scored = token_coef != 0  # [B, T]
    metrics = {SCORED_METRIC: int(scored.sum())}
    if has_old:
        old = fields[OLD_VALUES_KEY].to(device=values.device, dtype=values.dtype)  # [B, T]
        metrics[DRIFT_METRIC] = float(((values.detach() - old).abs() * scored).max()) if bool(scored.any()) else 0.0
    dp_size = int(data["dp_size"]) if "dp_size" in data.keys() else 1
    return (coef * values).sum() * dp_size, metrics


def critic_settings(critic_cfg: Any, meta: dict) -> int:
    """The worker's check of the critic config for streaming (point 3); returns the later epochs (0 or E - 1)."""
    if critic_cfg is None:
        fail("the critic worker has no value loss bound to a CriticConfig",
              "streaming reads critic.loss_agg_mode, ppo_epochs and ppo_mini_batch_size from the config verl's "
              "value loss uses", "call set_loss_fn(partial(value_loss, config=critic_cfg)) first, as verl's trainer "
              "does (verl_adapter.critic_worker_group)", StreamingConfigError)
    read = critic_cfg.get if hasattr(critic_cfg, "get") else (lambda k, d=None: getattr(critic_cfg, k, d))
    mode, epochs, mini = read("loss_agg_mode", "token-mean"), int(read("ppo_epochs", 1)), int(read("ppo_mini_batch_size"))
    if mode not in SUPPORTED_MODES:
        fail(f"critic.loss_agg_mode={mode!r} cannot stream", "the streamed critic defers the token-mean normaliser "
              "1/N only; other modes are not verified against verl's value loss",
              f"set critic.loss_agg_mode to one of {list(SUPPORTED_MODES)}, or update the critic with verl's "
              "_update_critic at the barrier", StreamingConfigError)
    if "train_batch_size" not in meta or int(meta["train_batch_size"]) != mini:
        fail(f"streaming the critic needs one mini-batch per batch: critic.ppo_mini_batch_size={mini}, "
              f"data.train_batch_size={meta.get('train_batch_size')!r}", "a later mini-batch's coefficients need "
              "values at weights that exist only after an earlier critic step",
              "set critic.ppo_mini_batch_size = data.train_batch_size and pass train_batch_size in the batch meta",
              StreamingConfigError)
    later = int(meta.get(LATER_EPOCHS_KEY, 0))
    if later != epochs - 1:
        fail(f"critic.ppo_epochs={epochs}: the stream is the first epoch only (batch meta "
              f"{LATER_EPOCHS_KEY}={later}, expected {epochs - 1})",
              "epochs 2.. run at weights that exist only after the first step; their clip is against the stored "
              "step-start values, so verl's train_mini_batch with epochs=ppo_epochs-1 on the same batch runs them",
              f"pass {{{LATER_EPOCHS_KEY!r}: {epochs - 1}}} and, after finalize_step, call train_mini_batch "
              f"(epochs={epochs - 1}) on the batch; or set critic.ppo_epochs=1", StreamingConfigError)
    return later


class _CriticBatch:
    def __init__(self, later_epochs: int):
        self.later_epochs, self.failed = later_epochs, None
        self.chunks = self.rows = self.tokens = 0
        self.drift = 0.0


_Base = va.critic_worker_base()
register, Dispatch, _ = va.worker_register_api()
TRAIN_MESH = va.train_mesh_dispatch()


class StreamingCriticWorker(_Base):
    """verl's critic ``TrainingWorker`` with the streaming methods of the module docstring (point 2)."""

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self._cs: _CriticBatch | None = None
        self._cs_lock = threading.Lock()
        self._cs_learner: StreamLearner | None = None

    def _learner(self) -> StreamLearner:
        if self._cs_learner is None:
            self._cs_learner = make_learner(va.engine_owner_view(self))
        return self._cs_learner

    def _state(self, call: str) -> _CriticBatch:
        if self._cs is None:
            fail(f"{call} called with no streaming critic batch open", "streamed critic gradients belong to one "
                  "batch valued at one set of weights", "call stream_begin_batch(meta) first (again after every "
                  "finalize_step)", StreamingStateError)
        if self._cs.failed is not None:
            fail(f"{call} refused: an earlier call of this batch failed ({self._cs.failed})",
                  "the batch's critic gradient is incomplete", "drop the batch: call stream_begin_batch(meta) and "
                  "stream it again", StreamingStateError)
        return self._cs

    @contextlib.contextmanager
    def _exclusive(self, call: str):
        if not self._cs_lock.acquire(blocking=False):
            fail(f"{call} called while another streaming critic call is running", "backward and step of one batch "
                  "must run in order", "wait for each call's result before sending the next", StreamingStateError)
        try:
            yield
        finally:
            self._cs_lock.release()

    def _agree(self, ok: bool) -> bool:
        """True on every rank iff ``ok`` holds on every data-parallel rank (one all-reduce)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        group = va.dp_group_of(self.engine)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        return bool(flag.item())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stream_begin_batch(self, meta: dict) -> None:
        """Start a batch: check the critic config (point 3), zero the gradient. ``meta``: ``train_batch_size``
        (data.train_batch_size) and, with critic.ppo_epochs = E > 1, ``critic_later_epochs`` = E - 1."""
        strategy = va.actor_strategy(va.engine_owner_view(self))
        if strategy not in VERIFIED_STRATEGIES:
            fail(f"critic.strategy={strategy!r}: the streamed critic is verified on {list(VERIFIED_STRATEGIES)} only",
                  "the chunk loss reads the engine's value output and the learner its gradient; this engine's were not "
                  "checked against verl's critic update", "set critic.strategy=fsdp2, or update the critic with "
                  "verl's _update_critic at the barrier", StreamingConfigError)
        later = critic_settings(va.bound_critic_config(self.loss_fn), dict(meta or {}))
        with self._exclusive("stream_begin_batch"):
            self._learner().begin_batch()
            self._cs = _CriticBatch(later)

    @register(dispatch_mode=TRAIN_MESH)
    def stream_token_backward(self, chunk):
        """Backward of one critic chunk (``critic_chunk``) into the gradient; one result row per rank."""
        return self._backward(chunk, "stream_token_backward")

    @register(dispatch_mode=TRAIN_MESH, blocking=False)
    def stream_token_backward_nowait(self, chunk):
        """``stream_token_backward`` returning at once (verl's future). Chunks add into one gradient, so their
        order does not matter; the caller waits for every one (``.get()``) before ``finalize_step``."""
        return self._backward(chunk, "stream_token_backward_nowait")

    def _backward(self, chunk, call: str):
        from tensordict import TensorDict

        with self._exclusive(call):
            state = self._state(call)
            check_token_chunk(chunk)
            if not self._agree(bool(torch.isfinite(chunk[TOKEN_COEF_KEY]).all())):
                fail(f"every {TOKEN_COEF_KEY} of a critic chunk must be finite", "one NaN poisons the critic's "
                      "batch gradient", "check the critic's values and the returns before building the chunk")
            dynamic, configured = bool(self.engine_config.use_dynamic_bsz), self.engine_config.micro_batch_size_per_gpu
            if not dynamic and "micro_batch_size_per_gpu" not in chunk.keys():
                va.assign_non_tensor(chunk, micro_batch_size_per_gpu=exact_micro_batch_size(chunk.batch_size[0],
                                                                                             configured))
            previous = self.loss_fn
            self.loss_fn = critic_token_loss
            try:
                output = self._learner().forward_backward(lambda: self.forward_backward(chunk))
            except Exception as exc:
                state.failed = f"{call}: {type(exc).__name__}: {exc}"
                raise
            finally:
                self.loss_fn = previous
            metrics = (va.non_tensor(output, "metrics", {}) or {}) if output is not None else {}
            drift = max(_flat(metrics.get(DRIFT_METRIC, [0.0])))
            tokens = int(sum(_flat(metrics.get(SCORED_METRIC, [0]))))
            state.chunks, state.rows, state.tokens = state.chunks + 1, state.rows + int(chunk.batch_size[0]), \
                state.tokens + tokens
            state.drift = max(state.drift, drift)
            out = {"ts_loss": float(metrics.get("loss", float("nan"))), "ts_value_drift_max": drift,
                   "ts_scored": float(tokens)}
            return TensorDict({k: torch.tensor([v], dtype=torch.float64) for k, v in out.items()}, batch_size=[1])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def finalize_step(self, scale: float) -> dict:
        """The barrier: grad *= scale, verl's clip, optimizer step, LR step (not when later epochs follow), zero."""
        with self._exclusive("finalize_step"):
            state = self._state("finalize_step")
            scale = check_scale(scale)
            try:
                step = self._learner().finalize(scale, lr_step=state.later_epochs == 0)
            except Exception as exc:
                state.failed = f"finalize_step: {type(exc).__name__}: {exc}"
                raise
            self._cs = None
            return {**step, "stream/chunks": state.chunks, "stream/rows": state.rows,
                    "stream/scored_tokens": state.tokens, DRIFT_METRIC: state.drift,
                    "stream/later_epochs": state.later_epochs}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def gather_flat_params(self) -> torch.Tensor:
        """All critic parameters, all-gathered and flattened to one float64 CPU vector (a collective)."""
        return self._learner().flat_params()


def _flat(values) -> list[float]:
    if isinstance(values, (list, tuple)):
        return [x for v in values for x in _flat(v)]
    return [float(values)]
