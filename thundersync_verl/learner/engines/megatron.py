"""The streaming learner on verl's Megatron engine (TP / PP / DP, with or without the distributed optimizer).

Why:
1. Megatron accumulates every backward into its DDP grad buffer and reduces it in
   ``finalize_model_grads``, which verl runs at the end of EVERY ``forward_backward_batch``. A
   streamed call runs with that switched off (``grads.no_finalize``); the barrier scales the
   buffer by the deferred normaliser, finalises ONCE, then runs verl's engine step (Megatron's
   optimizer: grad-norm clipping over the scaled, reduced gradient, then the update) and LR step.
2. The streamed loss ignores verl's per-call ``batch_num_tokens`` and is multiplied by
   ``dp_size`` (``stream_loss.py``); Megatron averages over data-parallel ranks and verl's
   engine undoes the schedule's division by the micro-batch count, so each call adds exactly
   ``sum_i coef_i * grad(sum_t w_{i,t} log pi)`` over all ranks' rows, as on FSDP2. That round
   trip (verl's loss x n, the schedule's / n, Megatron's loss scale 1 in fp32) seeds the backward
   with fl(fl(1/n) * n): exactly 1 for every n <= 40 micro-batches (a streamed chunk of at most the
   micro-batch size is n = 1), 1 - 2^-24 for 38 of the n <= 256, as in verl's own step.
3. Buckets: a copy of the flat grad buffers (P / (TP x PP) values), or, with the distributed
   optimizer, the reduce-scattered region this rank keeps (P / (TP x PP x DP)); see ``grads.py``.
   A bucket backward sets the direct gradient aside (one copy, skipped while it is still zero).
4. Settings that would make a streamed step differ are refused before anything runs, with the rule, why and
   the fix (the rows of ``learner/engine_rules.py``, which ``thundersync recipes check`` runs on every recipe
   too): virtual pipeline stages (not verified exact here), parameter offload (verl releases the grad buffer
   between calls), overlapped grad reduce (Megatron expects a fixed number of calls per step), Megatron-FSDP,
   dynamic context parallel (its scheduler re-deals each call's rows over the DP x CP plane; not verified
   here), and losses the schedule scales per call (MoE router aux / z loss, MTP): a streamed call would give
   them the deferred normaliser instead.
5. verl's KL loss and entropy bonus (``actor.use_kl_loss``, ``actor.entropy_coeff``) need nothing
   Megatron-specific: the chunk's loss reads the engine's own log-probs and ``calculate_entropy``
   output (verl's vocab-parallel entropy, on the last pipeline stage), the reference log-probs ride
   in the chunk, and a bucket chunk's KL/entropy part is a second streamed call outside
   ``isolated()`` (``stream_loss.py`` point 6): one more backward into the same buffer, under the
   same deferred normaliser and single finalize. Checked against verl's Megatron ``update_actor``
   (``tests/megatron/test_megatron_kl_entropy_on_cpu.py``, ``benchmarks/equivalence.py --kl``).
6. Megatron's per-token-loss regime (``calculate_per_token_loss``, which Megatron-Bridge turns on at context
   parallel > 1 and dynamic CP): verl's loss then returns ``(loss * R / dp, local tokens)`` with R the CALL's
   routed tokens (all-reduced over DP), the schedule neither divides by the micro-batch count nor multiplies by
   CP, the DDP sums over DP x CP (scaling factor 1) and ``finalize_model_grads`` divides by the call's total
   tokens T (= R at CP 1; at static CP each micro-batch reports ``R_m // cp`` per CP rank, so verl's own
   gradient is R / T times the exact one, R / T - 1 <= (cp - 1) x micro-batches / T; the stream gives the
   exact one). Streamed: each call's loss gradient is divided by exactly the seed
   verl's ``* R / dp`` gives (``va.megatron_unit_seed_losses``), so the buffer holds what the loss says, as
   outside the regime; the barrier finalises with no token count (no division) and applies scale / dp once.
   Checked against verl's Megatron update in the regime (``tests/megatron/test_megatron_per_token_loss_on_cpu.py``,
   ``benchmarks/equivalence.py --engine megatron --per-token-loss``); CP > 1 itself is not runnable on the CPU
   (Megatron's local attention refuses it: TransformerEngine only).
7. verl's token-budgeted micro-batches (``use_dynamic_bsz``, ``ppo_max_token_len_per_gpu``) need nothing here: verl's
   engine cuts each streamed call by the budget as it cuts its own update (``prepare_micro_batches``, the count
   all-reduced over DP), and point 2's round trip (verl's loss x n, the schedule's / n) holds for whatever n the
   budget gives, as do point 6's per-call seeds. Checked against verl's Megatron update under the same budget
   (``tests/megatron/test_megatron_dynamic_bsz_on_cpu.py``,
   ``benchmarks/equivalence.py --engine megatron --dynamic-bsz``).
8. ``applied_gradient`` (equivalence checks, as ``engines/fsdp.py`` point 5): Megatron's optimizer clips the main
   gradients, then its inner torch optimizer steps; a pre-step hook there reads each local main parameter's
   gradient, in ``flat_params``'s layout. With the distributed optimizer the inner optimizer steps this rank's
   shards of the main parameters: the hook reads those, and every rank's shards in rank order hold each
   parameter's gradient once (another order than ``flat_params``; runs of the same layout compare).
"""

from __future__ import annotations

import contextlib

import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.backends.megatron import grads as mg
from thundersync_verl.core import GradLayout
from thundersync_verl.core.buffers import axpy_, copy_into_
from thundersync_verl.learner import engine_rules
from thundersync_verl.learner.engines.base import StreamLearner

class MegatronLearner(StreamLearner):
    name = "megatron"

    def __init__(self, worker):
        super().__init__(worker)
        self._stash: list[torch.Tensor] | None = None
        self._isolating = False
        self._direct_nonzero = False  # no copy is needed to set aside a gradient that is still zero
        self._recorded_optimizer = None  # applied_gradient
        self._applied: torch.Tensor | None = None

    def _engine(self):
        return va.actor_engine(self.worker)

    def _chunks(self) -> list:
        return va.megatron_chunks(self._engine())

    def _sharded(self) -> bool:
        return bool(mg.ddp_config(self._chunks()).use_distributed_optimizer)

    def check(self) -> None:
        """Raise ``StreamingConfigError`` for a setting a streamed step cannot honour (identical on every rank):
        the streaming learner's rows of ``learner/engine_rules.py``, the table ``thundersync recipes check`` runs
        on every recipe (its verl rows verl's engine raises itself, at the first micro-batch)."""
        chunks = self._chunks()
        facts = dict(va.megatron_streaming_blockers(self._engine()), strategy=va.actor_strategy(self.worker),
                     model_chunks=len(chunks), overlap_grad_reduce=bool(mg.ddp_config(chunks).overlap_grad_reduce))
        engine_rules.raise_first(facts, engine=self.name, owners=(engine_rules.STREAM,))

    def timed_module(self):
        """The model chunk, without pipeline stages (with them forwards and backwards interleave)."""
        from megatron.core import parallel_state

        chunks = self._chunks()
        return chunks[0] if len(chunks) == 1 and parallel_state.get_pipeline_model_parallel_world_size() == 1 else None

    def begin_batch(self) -> None:
        self.check()
        self._engine().optimizer_zero_grad()
        self._stash, self._isolating, self._direct_nonzero = None, False, False

    def bucket_layout(self) -> GradLayout:
        chunks = self._chunks()
        tensors = mg.own_regions(chunks) if self._sharded() else mg.grad_buffers(chunks)
        return GradLayout.from_tensors(tensors)

    def _per_token(self) -> bool:
        return va.megatron_per_token_loss(self._engine())

    def _per_token_call(self):
        """Point 6: in the per-token regime every streamed loss reaches its backward with seed 1."""
        return va.megatron_unit_seed_losses(self._engine()) if self._per_token() else contextlib.nullcontext()

    def forward_backward(self, run):
        with mg.no_finalize(self._chunks()), self._per_token_call():
            output = run()
        if not self._isolating:
            self._direct_nonzero = True
        return output

    @contextlib.contextmanager
    def isolated(self):
        buffers = mg.grad_buffers(self._chunks())
        self._stash = [b.clone() for b in buffers] if self._direct_nonzero else None
        for b in buffers:
            b.zero_()
        self._isolating = True
        try:
            yield
        finally:
            self._isolating = False
            if self._stash is None:
                for b in buffers:
                    b.zero_()
            else:
                copy_into_(buffers, self._stash)
            self._stash = None

    def bucket_gradient(self):
        chunks = self._chunks()
        if self._sharded():
            return mg.reduce_scatter_shards(chunks)  # this rank's region, summed over data-parallel ranks
        return mg.grad_buffers(chunks)

    def fold(self, bucket, coef: float) -> None:
        chunks = self._chunks()
        axpy_(mg.own_regions(chunks) if self._sharded() else mg.grad_buffers(chunks), bucket, coef)
        self._direct_nonzero = True

    def finalize(self, scale: float, lr_step: bool = True) -> dict:
        engine, chunks = self._engine(), self._chunks()
        dp = va.megatron_dp_size(engine) if self._per_token() else 1  # point 6: Megatron sums, not averages
        for b in mg.grad_buffers(chunks):
            b.mul_(scale)
            if dp > 1:
                b.mul_(1.0 / dp)  # what the DDP's gradient_scaling_factor does outside the regime
        mg.finalize(chunks)  # once: DP reduce(-scatter), sequence-parallel norms, tied embeddings
        with engine.train_mode(zero_grad_on_exit=True):
            grad_norm = engine.optimizer_step()  # Megatron's optimizer clips the reduced gradient, then steps
        lr = engine.lr_scheduler_step() if lr_step else float("nan")  # mini-batch steps before the last: no LR step
        self._direct_nonzero = False
        return {"grad_norm": float(grad_norm), "lr": float(lr)}

    def flat_params(self) -> torch.Tensor:
        """All ranks' local parameters, concatenated in rank order (replicas appear once per replica); with 16-bit
        parameters their fp32 main parameters, what the optimizer steps (``grads.master_parameters``)."""
        with torch.no_grad():
            local = torch.cat([p.detach().reshape(-1).to("cpu", torch.float64) for p in mg.master_parameters(self._chunks())])
        return torch.cat(_every_rank(local))

    def applied_gradient(self) -> torch.Tensor | None:
        """Each local (main) parameter's gradient as Megatron's inner optimizer steps it, after the clip (a pre-step
        hook on it), in ``flat_params``'s layout; with the distributed optimizer, every rank's shards (point 8)."""
        optimizer = self._engine().optimizer
        inner = [getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
        if not inner or inner[0] is None:
            return None
        if self._recorded_optimizer is not inner[0]:  # armed once per optimizer (reset_actor builds a new one)
            inner[0].register_step_pre_hook(self._record_step)
            self._recorded_optimizer, self._applied = inner[0], None
        return self._applied

    def _record_step(self, optimizer, *_) -> None:
        """Every rank steps at once; the gather is a collective every rank reaches, with or without a gradient."""
        with torch.no_grad():
            if self._sharded():  # the inner optimizer's parameters are this rank's shards of the main parameters
                params = [p for group in optimizer.param_groups for p in group["params"]]
            else:
                params = mg.master_parameters(self._chunks())
            local = None if any(p.grad is None for p in params) else torch.cat(
                [p.grad.detach().reshape(-1).to("cpu", torch.float64) for p in params])
        parts = _every_rank(local)
        self._applied = None if any(x is None for x in parts) else torch.cat(parts)


def _every_rank(local):
    """Every rank's ``local`` object in rank order (a collective; just ``[local]`` without a process group)."""
    if not torch.distributed.is_initialized():
        return [local]
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, local)
    return parts
