"""Token-budgeted micro-batches (``use_dynamic_bsz``) on verl's Megatron engine: config and a recording worker.

Why:
1. verl's Megatron engine cuts every ``forward_backward_batch`` call into micro-batches with
   ``prepare_micro_batches`` (``verl/workers/engine/utils.py``): with ``use_dynamic_bsz`` it is
   ``rearrange_micro_batches`` over the call's rows, at most ``ppo_max_token_len_per_gpu`` tokens each, the count
   all-reduced to the maximum over data-parallel ranks, balanced by sequence length. verl's update and the
   streamed calls go through the same engine call, so each streamed chunk is cut by the same budget; the learner's
   deferred normaliser makes the cut irrelevant to the sum (``engines/megatron.py`` point 2: verl's loss x n,
   the schedule's / n, whatever n the budget gives).
2. The config is ``megatron_engine.megatron_config`` (or ``megatron_per_token.per_token_config``) with
   ``max_token_len`` (``batching.DYNAMIC_MAX_TOKEN_LEN`` in the equivalence benchmark's ``--dynamic-bsz``).
3. ``probe_record_micro_batches(on)`` (``start_dynamic_workers``): while on, every ``forward_backward_batch``
   of this rank's actor engine records ``{"forward_only", "rows", "tokens"}`` per call (rows and tokens of each
   micro-batch, as the engine cut them); off returns the record. It only observes: the call runs unchanged.
"""

from __future__ import annotations

from thundersync_verl import verl_adapter as va


def _micro_batch_tokens(micro_batch) -> list[int]:
    """Tokens per row as ``rearrange_micro_batches`` counts them (nested ``input_ids``, else the attention mask)."""
    ids = micro_batch["input_ids"]
    if ids.is_nested:
        return [int(n) for n in ids.offsets().diff()]
    return [int(n) for n in micro_batch["attention_mask"].sum(dim=1)]


def _worker_class():
    from thundersync_harness.megatron_engine import _probe_worker_class
    from thundersync_verl.learner.streaming_worker import Dispatch, register

    class MicroBatchRecordingWorker(_probe_worker_class()):
        """The probe streaming worker plus ``probe_record_micro_batches`` (point 3)."""

        _ts_cut_log: list | None = None
        _ts_cut_restore = None

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def probe_record_micro_batches(self, on: bool) -> list | None:
            from verl.workers.engine.megatron import transformer_impl as impl

            if on:
                if self._ts_cut_restore is not None:
                    raise RuntimeError("the micro-batch record is already on")
                engine, log, current = va.actor_engine(self), [], {}
                prepare, call = impl.prepare_micro_batches, engine.forward_backward_batch
                own = vars(engine).get("forward_backward_batch")  # an instance override to put back, if any

                def recording_prepare(*args, **kwargs):
                    micro_batches, indices = prepare(*args, **kwargs)
                    tokens = [_micro_batch_tokens(mb) for mb in micro_batches]
                    log.append({"forward_only": current.get("forward_only"), "rows": [len(t) for t in tokens],
                                "tokens": [sum(t) for t in tokens]})
                    return micro_batches, indices

                def recording_call(data, loss_function, forward_only=False):
                    current["forward_only"] = bool(forward_only)
                    return call(data, loss_function, forward_only=forward_only)

                def restore():
                    impl.prepare_micro_batches = prepare
                    if own is None:
                        vars(engine).pop("forward_backward_batch", None)
                    else:
                        engine.forward_backward_batch = own

                impl.prepare_micro_batches, engine.forward_backward_batch = recording_prepare, recording_call
                self._ts_cut_log, self._ts_cut_restore = log, restore
                return None
            log, restore = self._ts_cut_log, self._ts_cut_restore
            self._ts_cut_log = self._ts_cut_restore = None
            if restore is not None:
                restore()
            return log

    return MicroBatchRecordingWorker


def start_dynamic_workers(config, world: int):
    """ray.init with ``world`` device slots, then a group of ``MicroBatchRecordingWorker`` (one per rank)."""
    from thundersync_harness.engine_setup import start_group

    return start_group(_worker_class(), config.actor_rollout_ref, world)
