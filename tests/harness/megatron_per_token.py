"""verl's Megatron engine in Megatron's per-token-loss regime on the CPU: config and worker group.

Why:
1. verl 0.9.1 runs Megatron's per-token-loss regime (``calculate_per_token_loss``) where Megatron-Bridge turns it on:
   context parallel > 1 and dynamic CP. Neither runs here: Megatron's local attention refuses CP > 1
   ("Context parallelism is only supported by TEDotProductAttention!") and Megatron-Bridge needs
   TransformerEngine. The regime itself is a switch of the transformer config, so it is forced on at CP = 1
   (``override_transformer_config.calculate_per_token_loss=true``): the DDP then sums over data-parallel ranks
   (scaling factor 1), verl's loss returns ``(loss * routed_num_tokens / dp_size, local tokens)``, the schedule
   neither divides by the micro-batch count nor scales by CP, and ``finalize_model_grads`` divides by the total.
2. verl refuses the regime on the padded (BSHD) path (``use_remove_padding=False``) because it passes no padding
   mask to the MoE router, so the config packs sequences (THD, ``use_remove_padding=True``) as verl requires: the
   CPU layer spec runs THD with a block-diagonal causal mask (``backends/megatron/cpu_spec.py`` point 4).
   ``per_token_config(..., remove_padding=False)`` keeps the padded path for a comparison of the two; the dense
   model has no router, so ``probe_per_token`` then lets that one check see ``use_remove_padding=True`` during
   verl's loss post-processing (nothing else reads the flag there; the forward still takes the BSHD path).
3. ``probe_raw_per_token(on)``: a learner that streams WITHOUT the regime's compensation (each call's gradient keeps
   verl's ``routed_num_tokens / dp_size`` factor of that call): the negative control of the equivalence test.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from thundersync_harness.megatron_engine import megatron_config
from thundersync_verl import verl_adapter as va

PER_TOKEN_KEY = "actor_rollout_ref.actor.megatron.override_transformer_config.calculate_per_token_loss"


def per_token_config(model_path: Path, remove_padding: bool = True, **kwargs):
    """``megatron_config`` with Megatron's per-token-loss regime forced on (point 1), packed by default (point 2)."""
    from omegaconf import OmegaConf

    config = megatron_config(model_path, remove_padding=remove_padding, **kwargs)
    OmegaConf.update(config, PER_TOKEN_KEY, True, force_add=True)
    return config


def _worker_class():
    from thundersync_harness.megatron_engine import _probe_worker_class
    from thundersync_verl.learner.engines.megatron import MegatronLearner
    from thundersync_verl.learner.streaming_worker import Dispatch, register

    class RawPerTokenLearner(MegatronLearner):
        """Streams in the regime as if it were not there: per-call factors kept, no 1 / dp at the barrier."""

        def _per_token_call(self):
            return contextlib.nullcontext()

        def _per_token(self) -> bool:
            return False

    class PerTokenProbeWorker(_probe_worker_class()):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def probe_per_token(self) -> bool:
            """Point 2 (on the padded path only); returns whether the engine runs the per-token regime."""
            engine = va.actor_engine(self)
            if engine.engine_config.use_remove_padding:
                return va.megatron_per_token_loss(engine)
            original = engine.postprocess_micro_batch_func

            def postprocess(*args, **kwargs):
                engine.engine_config.use_remove_padding = True
                try:
                    return original(*args, **kwargs)
                finally:
                    engine.engine_config.use_remove_padding = False

            engine.postprocess_micro_batch_func = postprocess
            return va.megatron_per_token_loss(engine)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def probe_raw_per_token(self, on: bool) -> None:
            self._ts_learner = RawPerTokenLearner(self) if on else None

    return PerTokenProbeWorker


def start_per_token_workers(config, world: int):
    """ray.init with ``world`` device slots, then a group of ``PerTokenProbeWorker`` in the regime (one per rank)."""
    from thundersync_harness.engine_setup import start_group

    wg = start_group(_worker_class(), config.actor_rollout_ref, world)
    on = wg.probe_per_token()
    if not all(on):
        raise RuntimeError(f"the per-token-loss regime is not on in every rank's engine: {on}")
    return wg
