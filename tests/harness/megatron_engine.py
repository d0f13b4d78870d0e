"""verl's Megatron engine on the CPU, for the equivalence benchmark and ``tests/megatron``: model and config.

Why:
1. The streamed-vs-synchronous comparison on Megatron is the FSDP2 one (``engine_setup`` and
   ``engine_steps``: same trajectories, same ``sync_step`` / ``stream_step`` / ``train``) with
   another engine: ``model_engine=megatron`` and a layout (TP x PP x DP Ray workers, gloo).
   Only the model and the config differ, and they live here.
2. The tiny Qwen2 is ``engine_setup``'s with the vocabulary padded to a multiple of 128: Megatron
   splits the embedding over tensor-parallel ranks and needs the vocabulary to divide evenly
   (the extra rows are never a target; verl and Megatron see the same model).
3. fp32 end to end on the CPU (``megatron.dtype=float32``, allowed on the CPU platform by
   ``backends/megatron/cpu_patches``), SGD without momentum (Adam with a large eps for the
   distributed optimizer), no weight decay: dθ follows the clipped gradient, as for FSDP2.
4. ``PrescaledSpec`` streams GRPO with verl's rounding of 1/N in every coefficient (a diagnostic).
   ``budgeted_stream_step`` is ``engine_steps.stream_step`` with a memory budget on both sides (the
   planner's reservations and the learner's ``memory_budget_bytes``), counting the trajectories the
   planner held back and keeping every rank's step metrics (``benchmarks/accumulator_memory.py``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import torch

from thundersync_harness.engine_setup import GROUP_SIZE, build_tiny_model
from thundersync_harness.engine_steps import (PolicySpec, StreamingLearnerClient, TrajFeed, count_key, row_table,
                                             traj_name)
from thundersync_verl import verl_adapter as va
from thundersync_verl.step.stream_plan import FoldOp

VOCAB_MULTIPLE = 128


def build_megatron_model(folder: Path, seed: int = 0) -> tuple[Path, int, int]:
    """``engine_setup.build_tiny_model`` with the vocabulary padded for tensor parallelism: (path, pad id, vocab)."""
    from transformers import AutoConfig, Qwen2ForCausalLM

    path, pad_id, vocab = build_tiny_model(folder, seed=seed)
    config = AutoConfig.from_pretrained(path)
    config.vocab_size = -(-config.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path, pad_id, vocab


def megatron_config(model_path: Path, *, groups: int, micro: int, tp: int = 1, pp: int = 1,
                    distributed_optimizer: bool = False, optimizer: str | None = None, lr: float = 0.05,
                    loss_agg_mode: str = "token-mean", dtype: str | None = None, remove_padding: bool = False,
                    max_token_len: int | None = None):
    """verl's ppo_trainer.yaml with ``model_engine=megatron``, the CPU settings and one mini-batch per step.

    ``optimizer``: ``sgd`` (no momentum) by default; Megatron's distributed optimizer takes only Adam,
    so it gets ``adam`` with ``adam_eps=1``: with eps far above every |g|, Adam's first step is
    lr * g / (|g| + eps), close to linear in g, so dθ still compares gradients rather than their signs.
    ``dtype``: ``engine_setup.platform_dtype()``, from the harness platform (not CUDA visibility): ``float32`` on
    the CPU platform (its patch allows it), ``bfloat16`` on a GPU platform, since verl's config accepts only
    bf16/fp16 there. ``max_token_len``: ``use_dynamic_bsz=true`` with that ``ppo_max_token_len_per_gpu`` (and the
    same budget for log-prob calls), as ``engine_setup.verl_config`` sets it for FSDP2.
    """
    from thundersync_harness.engine_setup import dynamic_bsz_overrides, platform_dtype

    dtype = dtype or platform_dtype()
    optimizer = optimizer or ("adam" if distributed_optimizer else "sgd")
    actor, mega = "actor_rollout_ref.actor", "actor_rollout_ref.actor.megatron"
    opt_override = "sgd_momentum=0.0" if optimizer == "sgd" else "adam_eps=1.0"
    overrides = [
        "model_engine=megatron",
        f"actor_rollout_ref.model.path={model_path}",
        # padded (BSHD) by default; packed (THD) runs the CPU spec's block-diagonal attention (cpu_spec.py point 4)
        f"actor_rollout_ref.model.use_remove_padding={str(remove_padding).lower()}",
        f"{mega}.tensor_model_parallel_size={tp}", f"{mega}.pipeline_model_parallel_size={pp}",
        f"{mega}.use_distributed_optimizer={str(distributed_optimizer).lower()}",
        f"{mega}.vanilla_mbridge=true",  # megatron-bridge needs Python >= 3.12; mbridge 0.15 is the path here
        f"{mega}.dtype={dtype}", f"{mega}.sequence_parallel={str(tp > 1).lower()}",
        f"{actor}.ppo_mini_batch_size={groups}", f"{actor}.ppo_epochs=1",
        f"{actor}.ppo_micro_batch_size_per_gpu={micro}", f"{actor}.loss_agg_mode={loss_agg_mode}",
        f"{actor}.optim.optimizer={optimizer}", f"{actor}.optim.lr={lr}", f"{actor}.optim.weight_decay=0.0",
        f"+{actor}.optim.override_optimizer_config.{opt_override}",
        f"{actor}.optim.total_training_steps=1000",  # Megatron's LR scheduler needs a horizon (constant LR)
        f"actor_rollout_ref.rollout.n={GROUP_SIZE}", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"data.train_batch_size={groups}", "algorithm.adv_estimator=grpo",
    ]
    return va.compose_ppo_config(overrides + dynamic_bsz_overrides(max_token_len))


def _times_fp32(a: float, b: float) -> float:
    """a * b rounded as verl's fp32 loss rounds a per-row gradient scalar."""
    return float(torch.tensor(a, dtype=torch.float32) * torch.tensor(b, dtype=torch.float32))


class PrescaledFeed(TrajFeed):
    """The GRPO stream with the batch normaliser applied where verl applies it.

    A diagnostic, possible here only because the benchmark knows every trajectory in advance: every
    direct and fold coefficient c becomes fp32(c * fp32(1 / N)), the per-row gradient scalar verl's
    token-mean loss rounds, and the barrier scale is 1. Buckets, folds, isolation, reduction and the
    single finalize all run as in the real stream, so the distance to verl's update is the streaming
    machinery's own plus micro-batch-composition noise; the rest of the plain gap is where 1 / N is rounded.
    """

    def __init__(self, planner, client, trajs, meta: dict):
        self.inv_n = float(1.0 / torch.tensor(float(sum(len(t.response) for t in trajs)), dtype=torch.float32))
        super().__init__(planner, client, trajs, meta)

    def send(self, ops) -> None:
        super().send([self._prescaled(op) for op in ops])

    def _prescaled(self, op):
        if isinstance(op, FoldOp):
            return dataclasses.replace(op, folds={key: _times_fp32(c, self.inv_n) for key, c in op.folds.items()})
        if op.dest == "direct":
            return dataclasses.replace(op, coefs=tuple(_times_fp32(c, self.inv_n) for c in op.coefs))
        return op

    def barrier(self):
        closing, final = super().barrier()  # the planner's own checks: every group closed, every bucket folded
        return closing, dataclasses.replace(final, scale=1.0)  # the normaliser is already in the coefficients


class PrescaledSpec(PolicySpec):
    """GRPO streamed through ``PrescaledFeed`` (``engine_steps.stream_step(..., PrescaledSpec())``)."""

    feed_class = PrescaledFeed


def budgeted_stream_step(wg, trajs, arrival: list[int], pad_token_id: int, *, grad_numel: int,
                         bucket_bytes: int, budget_buckets: int | None, every: int = 2, max_chunk: int = 4,
                         extra_meta: dict | None = None) -> dict:
    """One streamed step under a budget of ``budget_buckets`` open buckets (None: unbudgeted).

    The planner accounts ``grad_numel`` float32 values per buffer and, as the core does, one buffer
    for the batch gradient itself: its budget is ``(1 + budget_buckets)`` buffers, and binary rewards
    make a group need at most 2 buckets (``max_distinct_rewards=2``). The learner is given
    ``budget_buckets * bucket_bytes`` (its pool counts buckets only) and would refuse a bucket beyond it.
    Returns ``ranks`` (every rank's ``finalize_step`` metrics), ``waits`` (trajectories held back at
    least once because a new group did not fit), ``wait_rounds`` and the op counts.
    """
    from thundersync_verl.step.stream_plan import StreamPlanner

    sizing = {} if budget_buckets is None else {
        "grad_numel": grad_numel, "budget_bytes": (1 + budget_buckets) * 4 * grad_numel, "max_distinct_rewards": 2}
    planner = StreamPlanner(adv_estimator="grpo", loss_agg_mode="token-mean", max_chunk_size=max_chunk, **sizing)
    client = StreamingLearnerClient(wg, pad_token_id=pad_token_id)
    groups = sorted({t.gid for t in trajs})
    planner.begin_batch({g: GROUP_SIZE for g in groups})
    meta = {"loss_agg_mode": "token-mean", "train_batch_size": len(groups), "adv_estimator": "grpo", **(extra_meta or {})}
    client.begin_batch(meta | ({} if budget_buckets is None else {"memory_budget_bytes": budget_buckets * bucket_bytes}))
    table = row_table(trajs)
    held, rounds, kinds = set(), 0, Counter({"direct": 0, "bucket": 0, "fold": 0})

    def send() -> int:
        nonlocal rounds
        ops = planner.next_ops()
        kinds.update(count_key(op) for op in ops)
        client.run(ops, table)
        held.update(planner.ready)  # ready, but not admitted: the budget holds no room for its group
        rounds += bool(planner.ready)
        return len(ops)

    for k, i in enumerate(arrival):
        t = trajs[i]
        planner.arrive(t.gid, traj_name(t), t.reward, len(t.response))
        if (k + 1) % every == 0:
            send()
    while send():  # every group is closed now: what waited runs direct
        pass
    if planner.ready_count:
        raise RuntimeError(f"{planner.ready_count} trajectories can never run under this budget")
    ranks = wg.finalize_step(planner.finalize().scale)
    return {"ranks": ranks, "grad_norm": ranks[0]["grad_norm"], "waits": len(held), "wait_rounds": rounds,
            **{f"ops/{k}": v for k, v in kinds.items()}}


# ----- a worker with one switch for negative tests --------------------------------------------
def _probe_worker_class():
    from thundersync_verl.learner.engines.megatron import MegatronLearner
    from thundersync_verl.learner.streaming_worker import Dispatch, StreamingActorWorker, register

    class EveryCallFinalizeLearner(MegatronLearner):
        """What streaming on verl's engine does without the learner: every call finalises (DP reduce,
        sequence-parallel norms, tied embeddings), then the barrier finalises once more."""

        def forward_backward(self, run):
            output = run()
            if not self._isolating:
                self._direct_nonzero = True
            return output

    class FinalizeProbeWorker(StreamingActorWorker):
        """``StreamingActorWorker`` plus ``probe_finalize_every_call(on)``: with it on, streamed calls keep
        verl's per-call ``finalize_model_grads``. Off (the default) it is the streaming worker unchanged."""

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def probe_finalize_every_call(self, on: bool) -> None:
            self._ts_learner = EveryCallFinalizeLearner(self) if on else None

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def probe_grad_buffer(self) -> dict:
            """This rank's Megatron grad buffer as Megatron built it, independent of the learner's buckets."""
            from thundersync_verl.backends.megatron import grads as mg

            engine = va.actor_engine(self)
            chunks = va.megatron_chunks(engine)
            buffers = mg.grad_buffers(chunks)
            return {"buffer_numel": sum(b.numel() for b in buffers), "element_size": buffers[0].element_size(),
                    "param_numel": sum(p.numel() for p in mg.local_parameters(chunks) if p.requires_grad),
                    "dp": torch.distributed.get_world_size(va.dp_group_of(engine)),
                    "distributed_optimizer": bool(mg.ddp_config(chunks).use_distributed_optimizer)}

    return FinalizeProbeWorker


def start_megatron_workers(config, world: int, *, probe: bool = False):
    """ray.init with ``world`` logical device slots (one per TP x PP x DP rank), then the worker group.

    ``probe``: the ``FinalizeProbeWorker`` (the streaming worker plus the negative-test switch).
    """
    from thundersync_harness.engine_setup import start_group
    from thundersync_verl.learner.streaming_worker import StreamingActorWorker

    return start_group(_probe_worker_class() if probe else StreamingActorWorker, config.actor_rollout_ref, world)
