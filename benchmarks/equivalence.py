"""Streamed vs batch-synchronous update on verl's real FSDP2 engine: is it the same step?

Why:
1. The claim of streaming is that it changes WHEN each backward runs, not the update. This
   benchmark checks it end to end on the real stack: verl's FSDP2 engine in a Ray worker group
   (CPU platform, gloo), the streaming worker driven by the stream planner, against verl's own
   ``update_actor`` fed with verl's own ``compute_advantage`` (GRPO, one epoch, one mini-batch).
2. Summation order differs between any two ways of computing the same gradient, so "equal"
   needs a yardstick: the NOISE FLOOR is verl's own update run twice with the rows in different
   micro-batch orders (a stride permutation: every row gets new micro-batch companions). Per step it prints the relative update gap
   ||dθ_stream - dθ_sync|| / ||dθ_sync|| next to ||dθ_sync_a - dθ_sync_b|| / ||dθ_sync_a||; the
   acceptance is gap <= 2 x floor.
3. The optimizer is SGD by default: Adam's first step is about lr * sign(g) per coordinate, so
   its dθ compares gradient SIGNS and hides the gradient gap behind coordinates whose gradient
   is near zero. SGD's dθ is the clipped gradient itself. ``--optimizer AdamW`` runs verl's default.
4. All runs start from the same weights (the worker reloads its model path and rebuilds
   the optimizer) and see the same trajectories: groups of n=4, varied lengths, binary rewards
   with ties, a random arrival order; new trajectories each step.
5. float64 would shrink the floor to ~1e-16, but verl 0.9.1's engine maps model_dtype/mixed
   precision names through ``PrecisionType.to_dtype``, which has no 64-bit entry: the run says so.
6. ``--algo opd``: replayed trajectories of 2-4 action turns separated by masked observation
   tokens; a second tiny model is the teacher. Streamed: each turn scored on its causal prefix
   (the harness's ``TurnScorer``, KV-cache sessions) and backpropagated as a prefix row (``OPDTurnPlanner`` +
   ``stream_token_backward``), turns of all trajectories in a random order. Synchronous: verl's
   OWN ``update_actor`` running verl's distillation loss (worker built with
   ``distillation_config`` as verl's trainer does; k1, use_policy_gradient, no task rewards); its
   learner side needs no teacher server, only the teacher log-probs in the batch (verl's layout).
   Both get the same per-turn scores, so the gap is the learner's; the teacher's own fp32
   prefix-vs-whole difference is printed apart (max |diff| and its effect on verl's update).
7. ``--engine megatron [--tp 2] [--pp 2] [--dp 2 [--distributed-optimizer]]``: the same GRPO
   comparison on verl's Megatron engine (``thundersync_harness.megatron_engine``; TP x PP x DP Ray
   workers over gloo). It also runs the stream with every coefficient pre-multiplied by 1/N rounded
   as verl's loss rounds it (``gap_normaliser_matched``): what is left is the streaming machinery's
   own difference plus the micro-batch-composition noise the floor measures (streamed chunks of 1-4
   rows in arrival order); the rest of the plain gap is where the deferred normaliser is rounded.
   A control runs verl's OWN update twice more, with every advantage multiplied by 16 and by 24
   (``gap_verl_rescaled_over_floor``: x24 against x16, over the floor). Once 16 x the grad norm exceeds
   verl's clip (1.0; checked and printed) both are clipped to the same step, mathematically, up to the
   clip's eps (1e-6 / 48 / grad norm, printed). x16 rounds bit for bit as verl does, times a power of
   two; x24 = x16 x 1.5 changes only the rounding of verl's per-token loss scalars A_i / N and of every product downstream of them
   in each row's backward: the term the floor (same scalars, rows regrouped) never sees, and one a
   streamed row (scalar A_i or 1, 1 / N applied at the barrier) cannot share with verl.
   A fine floor runs verl's own update once more with ONE row per micro-batch (``floor_fine_over_floor``):
   a streamed step adds its chunks of 1-4 rows to the gradient one by one, a summation in finer pieces
   than the regrouped floor's; ``gap_over_max_floor`` is the gap over the larger of the two floors.
8. ``--kl [--kl-type X] --entropy [--loss-agg-mode M]``: GRPO with verl's KL loss (a reference model in its
   own worker group, as verl's trainer builds it) and entropy bonus, streamed (each chunk's reference
   log-probs computed on arrival) against verl's ``update_actor`` with the same settings
   (``thundersync_harness.kl_entropy_steps``). With ``--engine megatron [--tp 2] [--pp 2]`` the same steps run on
   verl's Megatron engine, the reference group with the actor's layout (``thundersync_harness.megatron_kl_entropy``);
   JSON equivalence_megatron_tpT_ppP_dpD_kl_*.
9. ``--mini-batches K [--ppo-epochs E]``: K optimizer steps per batch (and E epochs), streamed
   (``MiniBatchPlanner``: mini-batch j = the j-th groups to complete; mini-batch 1 at ratio 1, later ones
   with verl's PPO ratio and clip) against verl's ``update_actor`` on the SAME partition (batch ordered by
   it, shuffle off); the floor regroups rows inside each mini-batch (``thundersync_harness.minibatch_steps``).
   With ``--kl [--kl-type X] --entropy`` every mini-batch's loss carries verl's KL and entropy terms too.
10. ``--estimator NAME``: the GRPO comparison with another of verl's advantage estimators (e.g.
   reinforce_plus_plus, opo, gpg): verl's ``compute_advantage(adv_estimator=NAME)`` before ``update_actor``
   against the stream planner with the same estimator (``thundersync_harness.estimator_steps``); the JSON
   (equivalence_estimator_NAME) lists the estimators that stream and the refused ones with the reason.
11. ``--engine megatron --float64-sum``: an experiment on the margin of point 7. The stream runs once more with
   its streamed pieces (direct calls, folds, the deferred scale) summed in float64 and rounded to fp32 once at
   the barrier (``thundersync_harness.megatron_accumulation``); each chunk's backward is unchanged. JSON
   equivalence_megatron_*_float64sum (``gap_float64_sum_over_floor``).
   ``--per-token-loss``: point 7 with Megatron's per-token-loss regime forced on at CP 1, for verl's update and
   the stream alike (``thundersync_harness.megatron_per_token``); JSON equivalence_megatron_*_per_token.
12. ``--seeds S1,S2,...`` (any engine and comparison): the whole comparison once per seed (other batches and
   arrival orders, the same model; a fresh Ray session each), each seed's table printed as with ``--seed``.
   The floor is ONE regrouping sample per step, itself noisy, so one seed's worst step can cross the 2x mark
   on the floor's noise alone. The JSON's ``gap_over_floor`` is then the MEDIAN over seeds of each seed's
   worst-step gap/floor (with an even count the higher of the two middle values, never in the stream's
   favour); ``gap``, ``floor`` and the other keys are that seed's. The worst seed is reported beside it
   (``gap_over_floor_worst``, ``gap_over_floor_per_seed``; ``per_seed`` keeps every seed's result), and the
   printed verdict names both. JSON <name>_seeds, so the single-seed results are not overwritten; a single run
   with ``--seed N`` (N != 0) writes <name>_seedN. When a seed's comparison fails, the seeds compared before it
   are written to <name>_seeds_partial (with ``failed_seed`` and ``seeds_not_run``) before the error is raised.
13. ``--remove-padding`` / ``--dynamic-bsz`` (plain GRPO on FSDP2 or Megatron; on Megatron also ``--per-token-loss``,
   packed as verl requires there): both paths packed / token-budgeted (``thundersync_harness.batching``).
14. ``--dtype bf16`` (plain GRPO, fsdp or megatron): bf16 parameters, fp32 master weights and gradients for both
   paths (``thundersync_harness.precision``, with its diagnostics of the bf16 rounding); JSON <name>_bf16, ``dtype`` key.
15. ``--engine megatron --moe [--ep 2 --dp 2]``: the plain GRPO comparison on a tiny Qwen3-MoE (4 experts, top-2,
   router aux loss off; ``thundersync_harness.moe``), experts over ``--ep`` expert-parallel ranks; JSON
   <name>_moe[_epN] with ``moe`` and ``ep`` keys. ``--estimator`` and ``--mini-batches`` run on Megatron too (``megatron_breadth``).
16. ``--lora-rank R`` (fsdp GRPO, plain or ``--kl``): a peft adapter on verl's engine, the adapter-off actor as the KL
   reference, the rollout's staleness measured on an ``hf_cpu`` server, point 7's controls and each step from one
   point (``thundersync_harness.lora``); JSON <name>_lora<R> (``lora_rank`` key).
17. ``--rollout-correction tis|token-mask|sequence-tis|sequence-mask`` (plain GRPO): verl's rollout IS weights
   against noisy rollout log-probs, verl's trainer function on its side, the learner's loss on the stream's
   (``thundersync_harness.rollout_correction``); JSON <name>_rc_<variant> (``rollout_correction`` key).
18. ``--algo opd --opd-config verl [--distill-loss-mode M]``: verl's ``distillation_loss`` as verl ships it (k3 backpropagated
   as a supervised loss, task rewards on: verl's ppo_loss with GRPO advantages of the trajectories' rewards + the
   distillation loss), or with another single-sample estimator; ``--opd-config project`` (default) is point 6's k1
   policy gradient. The worker is built from that config (verl's update runs verl's loss with it) and the stream reads
   the same config (``opd_config.opd_loss_from_verl_config``); with task rewards the stream also feeds each trajectory
   when its last turn has arrived (``algos/opd/opd_task.py``). JSON <name>_verl[_M] with a ``distillation`` key
   (``--quick --seeds 0,1,2``: equivalence_opd_verl_seeds.json; the project's setting: equivalence_opd_seeds.json).
19. The applied gradient (FSDP2 and Megatron; every comparison): each step's update is also compared before fp32 parameter
   storage rounds it, on the clipped gradient the optimizer step applied (``learner/engines/fsdp.py`` point 5);
   JSON ``gap_over_floor_applied`` (worst step; with ``--seeds`` its median, ``_per_seed`` and ``_worst``). A weight
   near 1 (a norm weight) is stored to 1.2e-7: where one such element's update lands on the other side of a
   rounding boundary in one path, the update's gap grows by 1.2e-7 / ||dθ|| (3e-6 at lr 0.05), whatever the
   gradients. Measured: the k1 tail (seed 0 step 2, 4.68) is one flip of one final-norm weight, absent on the
   gradient (3.07 / 3.24 / 3.14 over seeds 0-2, every step 2.3-3.2); the token-mask outlier (seed 1, 2.90 and
   4.98 at steps 2-3) likewise (1.69 and 2.02 there). On the gradient the regrouped floor is about 3x smaller
   (1.3e-7 against 5e-7 on the update: storage rounding is most of the update floor), and the three
   settings measured (plain GRPO, k1 + entropy, token-mask; 2026-12-06) sit at 2.3-3.5 x it: point 7's per-row
   rounding of A_i / N, which the floor never sees. ``--diagnostics`` (fsdp plain GRPO) runs point 7's controls
   as on Megatron, on the applied gradient too; JSON <name>_diagnostics.
20. Where the worst step's gap sits (``equivalence_storage.py``): the share of its squared norm in its 3 largest
   elements and their sizes in ulps of their stored values (JSON ``worst_step_top3_*``): most of the gap in 1-2
   ulps of a weight near 1 is point 19's storage flip.
The engine setup and both update paths live in ``thundersync_harness.engine_setup`` and
``engine_steps`` (``tests/harness/``; the engine tests use them too); this script runs and reports
the comparison. Run: python benchmarks/equivalence.py [--algo grpo|opd] [--engine fsdp|megatron] [--dp 1|2] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from thundersync_harness.engine_setup import (
    build_teacher,
    build_tiny_model,
    make_trajectories,
    make_turn_trajectories,
    prepare_environment,
    score_turns,
    start_workers,
    turn_arrival,
    verl_config,
)
from thundersync_harness import batching, lora, moe, precision, settings
from thundersync_harness import megatron_breadth as breadth
from thundersync_harness.engine_steps import (
    OPDSpec,
    PolicySpec,
    relative_gap,
    stream_step,
    sync_step,
    train,
)
from thundersync_harness.megatron_engine import PrescaledSpec, build_megatron_model, megatron_config
from thundersync_harness.opd_steps import with_landings
from thundersync_verl.algos.opd.opd_config import opd_loss_from_verl_config
from thundersync_harness.megatron_per_token import per_token_config, start_per_token_workers
from thundersync_verl import verl_adapter as va
from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module equivalence_seeds.py
from equivalence_seeds import aggregate_seeds, parse_seeds, report_seeds  # noqa: E402
from equivalence_storage import print_storage, storage_report  # noqa: E402


# ----- comparison ----------------------------------------------------------------------------
def transposed_order(n_rows: int, micro: int) -> list[int]:
    """Row order that gives every row new micro-batch (and rank) companions: a stride permutation.

    With 16 rows and micro-batches of 4, run a sees {0..3}, {4..7}, ... and run b sees
    {0, 4, 8, 12}, {1, 5, 9, 13}, ...: no two rows share a micro-batch in both runs, so the
    floor measures the full dependence on micro-batch composition, not part of it.
    """
    stride = max(1, n_rows // micro)
    return sorted(range(n_rows), key=lambda i: (i % stride, i))


CONTROL_POW2, CONTROL_OTHER = 16.0, 24.0  # advantage multipliers of the rescaling control (point 7)


def float64_sum_stream_step(wg, trajs, arrival: list[int], pad_id: int) -> dict:
    """``stream_step`` with the probe learner that sums the streamed pieces in float64 (point 11)."""
    wg.probe_float64_sum(True)
    try:
        return stream_step(wg, trajs, arrival, pad_id)
    finally:
        wg.probe_float64_sum(False)


def grpo_steps(wg, batches, pad_id: int, micro: int, diagnostics: bool = False, float64_sum: bool = False,
               spec: PolicySpec | None = None) -> dict:
    """``diagnostics``: also the stream with verl's rounding of 1/N (``PrescaledSpec``) and verl's
    update with the advantages x16 and x24 (the control of point 7). ``float64_sum``: also the stream
    summed in float64 (point 11). ``spec``: the GRPO spec of every path (default ``PolicySpec()``; e.g. the rollout
    correction's, point 17)."""
    spec = spec or PolicySpec()
    kinds = ["sync_a", "sync_b", "stream"] + (["stream_prescaled", "sync_pow2", "sync_other", "sync_fine"]
                                              if diagnostics else []) + (["stream_fp64sum"] if float64_sum else [])
    steps = {kind: [] for kind in kinds}
    for trajs, arrival in batches:
        in_order = list(range(len(trajs)))
        steps["sync_a"].append(partial(sync_step, wg, trajs, in_order, pad_id, spec))
        steps["sync_b"].append(partial(sync_step, wg, trajs, transposed_order(len(trajs), micro), pad_id, spec))
        steps["stream"].append(partial(stream_step, wg, trajs, arrival, pad_id, spec))
        if diagnostics:
            steps["stream_prescaled"].append(partial(stream_step, wg, trajs, arrival, pad_id, PrescaledSpec()))
            steps["sync_pow2"].append(partial(sync_step, wg, trajs, in_order, pad_id,
                                              dataclasses.replace(spec, advantage_scale=CONTROL_POW2)))
            steps["sync_other"].append(partial(sync_step, wg, trajs, in_order, pad_id,
                                               dataclasses.replace(spec, advantage_scale=CONTROL_OTHER)))
            steps["sync_fine"].append(partial(sync_step, wg, trajs, in_order, pad_id, spec, micro=1))
        if float64_sum:
            steps["stream_fp64sum"].append(partial(float64_sum_stream_step, wg, trajs, arrival, pad_id))
    return steps


def opd_steps(wg, batches, pad_id: int, micro: int, loss=None) -> dict:
    """sync_a/sync_b/stream see the same teacher log-probs (the per-turn scores): the gap is the
    learner's. sync_whole is fed whole-sequence scores: its distance to sync_a adds the teacher's.
    ``loss``: the distillation settings of verl's config (``opd_config.OPDLoss``; point 18)."""
    steps = {"sync_a": [], "sync_b": [], "stream": [], "sync_whole": []}
    for trajs, turns, rows, whole, arrival in batches:
        spec = OPDSpec(teacher_rows=rows, turns=turns, loss=loss)
        if spec.task_rewards:  # each trajectory lands (its reward) after its last turn has arrived
            arrival = with_landings(arrival, turns)
        steps["sync_a"].append(partial(sync_step, wg, trajs, list(range(len(trajs))), pad_id, spec))
        steps["sync_b"].append(partial(sync_step, wg, trajs, transposed_order(len(trajs), micro), pad_id, spec))
        steps["stream"].append(partial(stream_step, wg, trajs, arrival, pad_id, spec))
        steps["sync_whole"].append(partial(sync_step, wg, trajs, list(range(len(trajs))), pad_id,
                                           OPDSpec(teacher_rows=whole, turns=turns, loss=loss)))
    return steps


def fp64_probe() -> str:
    try:
        va.precision_dtype("fp64")
    except RuntimeError as exc:
        return f"no: verl's engine rejects model_dtype fp64 ({exc})"
    return "yes"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algo", default="grpo", choices=["grpo", "opd"])
    parser.add_argument("--engine", default="fsdp", choices=["fsdp", "megatron"], help="verl's model_engine")
    parser.add_argument("--dp", type=int, default=1, choices=[1, 2])
    parser.add_argument("--tp", type=int, default=1, choices=[1, 2], help="megatron: tensor parallel size")
    parser.add_argument("--pp", type=int, default=1, choices=[1, 2], help="megatron: pipeline parallel size")
    parser.add_argument("--distributed-optimizer", action="store_true", help="megatron: shard the optimizer over DP")
    parser.add_argument("--quick", action="store_true", help="3 steps of 4 groups x 4 (the default size)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=None, help="prompt groups per step (quick: 4, full: 8)")
    parser.add_argument("--optimizer", default="SGD", choices=["SGD", "AdamW"])
    seed = parser.add_mutually_exclusive_group()
    seed.add_argument("--seed", type=int, default=0, help="offsets every data seed (other batches, same model)")
    seed.add_argument("--seeds", type=parse_seeds, default=None, metavar="S1,S2,...",
                      help="the comparison once per seed; JSON gap_over_floor = median of the seeds' worst (point 12)")
    parser.add_argument("--kl", action="store_true", help="actor.use_kl_loss with a reference model (point 8)")
    parser.add_argument("--kl-type", default="low_var_kl", help="actor.kl_loss_type (verl's kl_penalty names)")
    parser.add_argument("--entropy", action="store_true", help="actor.entropy_coeff != 0 (point 8)")
    parser.add_argument("--loss-agg-mode", default="token-mean", help="actor.loss_agg_mode (with --kl / --entropy)")
    parser.add_argument("--mini-batches", type=int, default=1, help="K optimizer steps per batch (point 9)")
    parser.add_argument("--ppo-epochs", type=int, default=1, help="actor.ppo_epochs (point 9)")
    parser.add_argument("--estimator", default="grpo", help="algorithm.adv_estimator (point 10)")
    parser.add_argument("--per-token-loss", action="store_true", help="megatron: calculate_per_token_loss on (point 11)")
    parser.add_argument("--float64-sum", action="store_true",
                        help="megatron experiment: also the stream summed in float64 across calls (point 11)")
    parser.add_argument("--diagnostics", action="store_true",
                        help="fsdp GRPO: point 7's controls as on Megatron, on the applied gradient too (point 19)")
    settings.add_arguments(parser)  # points 13-16
    add_results_dir_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = settings.check(parser, parser.parse_args(argv))  # points 13-16
    args.results_dir = find_results_dir(args.results_dir)  # refuse before minutes of work, not after
    args.per_seed = None  # report() writes the result, or with several seeds appends (name, result) here
    if args.seeds is None or len(args.seeds) == 1:
        args.seed = args.seeds[0] if args.seeds else args.seed
        return compare(parser, args)
    t0, args.per_seed = time.time(), []
    for seed in args.seeds:
        args.seed = seed
        print(f"\n=== seed {seed} ({args.seeds.index(seed) + 1} of {len(args.seeds)}) ===", flush=True)
        try:
            compare(parser, args)
        except BaseException as exc:  # keep the seeds already compared (minutes each), then fail as before
            if args.per_seed:
                failed = {"seed": seed, "error": f"{type(exc).__name__}: {exc}"[:500]}
                report_seeds(args, time.time() - t0, failed=failed)
            raise
    return report_seeds(args, time.time() - t0)


def compare(parser: argparse.ArgumentParser, args) -> dict:
    """One comparison with ``args.seed``'s batches: build, run, report (with ``--seeds``: once per seed)."""
    groups = args.groups or (4 if args.quick else 8)
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="ts_equivalence_"))
    ray_tmp = prepare_environment()
    megatron = args.engine == "megatron"
    if megatron and (args.algo != "grpo" or args.optimizer != "SGD"):
        parser.error("--engine megatron runs --algo grpo with the Megatron harness optimizer (SGD, or Adam with "
                     "the distributed optimizer)")
    build_model = moe.build_moe_model if args.moe else build_megatron_model if megatron else build_tiny_model
    model_path, pad_id, vocab = build_model(work / "model")
    teacher = build_teacher(model_path, work / "teacher") if args.algo == "opd" else None
    micro = 4
    if megatron:
        config = (per_token_config if args.per_token_loss else megatron_config)(
            model_path, groups=groups, micro=micro, tp=args.tp, pp=args.pp, distributed_optimizer=args.distributed_optimizer,
            **batching.megatron_batching_options(args))
    else:
        config = verl_config(model_path, groups=groups, micro=micro, optimizer=args.optimizer, teacher=teacher,
                             distill_loss=args.distill_loss, **batching.batching_options(args))
    args.verl_config = config  # the distillation settings the result records (point 18)
    settings.apply(config, args)  # --dtype, --moe / --ep, --lora-rank (points 14-16)
    extra = {}
    if args.estimator != "grpo" or args.mini_batches > 1 or args.ppo_epochs > 1:
        breadth.check_breadth(parser, args)  # what --estimator / --mini-batches refuse, on either engine
    order = partial(transposed_order, micro=micro)
    if args.estimator != "grpo":  # point 10; JSON equivalence_estimator_<name>
        from thundersync_harness.estimator_steps import run_estimator

        return run_then_report(args, work, ray_tmp, t0, "estimator",
                               lambda: run_estimator(args, model_path, pad_id, vocab, groups, micro, order))
    if args.mini_batches > 1 or args.ppo_epochs > 1:  # point 9; JSON equivalence_minibatch*
        from thundersync_harness.minibatch_steps import run_minibatches

        return run_then_report(args, work, ray_tmp, t0, "minibatch",
                               lambda: run_minibatches(args, model_path, pad_id, vocab, groups, micro, work))
    if args.diagnostics and (megatron or args.algo != "grpo" or args.kl or args.entropy or args.mini_batches > 1
                             or args.estimator != "grpo"):
        parser.error("--diagnostics runs the plain GRPO comparison on --engine fsdp (Megatron runs them always)")
    if args.per_token_loss and (not megatron or args.float64_sum or args.kl or args.entropy):
        parser.error("--per-token-loss runs the plain GRPO comparison on --engine megatron")
    if args.float64_sum and (not megatron or args.distributed_optimizer or args.algo != "grpo" or args.kl
                             or args.entropy):
        parser.error("--float64-sum runs the plain GRPO comparison on --engine megatron without the distributed optimizer")
    if args.kl or args.entropy:
        if args.algo != "grpo":
            parser.error("--kl / --entropy run --algo grpo")
        from thundersync_harness.kl_entropy_steps import run_kl_entropy

        return run_then_report(args, work, ray_tmp, t0, "terms",  # point 8; JSON equivalence_kl_*
                               lambda: run_kl_entropy(args, work, model_path, pad_id, vocab, groups, micro, order))
    if args.algo == "opd":
        batches = []
        for s in range(args.steps):
            seed = 2000 + 100 * args.seed + s
            trajs = make_turn_trajectories(seed, groups, vocab)
            turns, rows, whole, diff = score_turns(teacher, trajs, seed + 1000)
            batches.append((trajs, turns, rows, whole, turn_arrival(turns, seed + 2000)))
            extra["teacher_prefix_max_diff"] = max(extra.get("teacher_prefix_max_diff", 0.0), diff)
    else:
        batches = [make_trajectories(1000 + 100 * args.seed + s, groups, vocab) for s in range(args.steps)]
    import ray

    try:
        world = args.dp * (args.tp * args.pp if megatron else 1)  # Ray workers: one per rank
        if args.per_token_loss:
            wg = start_per_token_workers(config, world)
        elif args.float64_sum:
            from thundersync_harness.megatron_accumulation import start_probe_workers

            wg = start_probe_workers(config, world)
        else:
            wg = start_workers(config, world, distillation=args.algo == "opd")
        if args.algo == "opd":
            steps = opd_steps(wg, batches, pad_id, micro, loss=opd_loss_from_verl_config(config))
        else:
            steps = grpo_steps(wg, batches, pad_id, micro, diagnostics=megatron or bool(args.lora_rank) or args.diagnostics,
                               spec=args.rc_spec,
                               float64_sum=args.float64_sum)
            steps.update(batching.regrouped_floor_steps(args, wg, batches, pad_id))
            steps.update(precision.diagnostic_steps(args, wg, batches, pad_id))  # --dtype bf16 (point 14)
        runs = {kind: train(wg, fns) for kind, fns in steps.items()}
        lora.measure_rollout(args, wg, steps, batches, pad_id, config)  # --lora-rank (point 16)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return report(args, runs, time.time() - t0, extra)


def run_then_report(args, work: Path, ray_tmp: Path, t0: float, key: str, run) -> dict:
    """``run()`` -> (runs, extra) with Ray shut down and the work folders removed after; reported with ``{key: extra}``."""
    import ray

    try:
        runs, extra = run()
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return report(args, runs, time.time() - t0, {key: extra})


def _ops_text(info: dict) -> str:
    if "ops/turn_chunks" in info:
        return f"{info['turns']} turns in {info['ops/turn_chunks']} chunks"
    return f"{info['ops/direct']}/{info['ops/bucket']}/{info['ops/fold']} (peak bucket bytes {info['stream/peak_bytes']})"


def _report_opd_teacher(runs: dict, extra: dict) -> None:
    """The teacher's share: per-turn vs whole-sequence scores, and what they change in verl's update."""
    da, dw, ds = runs["sync_a"][0], runs["sync_whole"][0], runs["stream"][0]
    print(f"teacher log-probs, per-turn prefix (KV-cache sessions) vs whole sequence: max |diff| = "
          f"{extra['teacher_prefix_max_diff']:.3e}")
    print("  verl's update fed whole-sequence vs per-turn scores, relative gap per step: "
          + ", ".join(f"{relative_gap(w, a):.3e}" for w, a in zip(dw, da)))
    print("  end to end, streamed (per-turn scores) vs verl (whole-sequence scores): "
          + ", ".join(f"{relative_gap(st, w):.3e}" for st, w in zip(ds, dw)))


def _control_gaps(v: dict) -> dict[str, list[float]]:
    """Point 7's comparisons per step on one kind of per-run vectors (the updates, or the applied gradients): the
    floor (sync_b vs sync_a), the stream and the stream with verl's 1/N rounding against sync_a, verl's x24 vs x16
    update, and verl with one row per micro-batch against sync_a."""
    a = v["sync_a"]
    return {"floor": [relative_gap(b, x) for b, x in zip(v["sync_b"], a)],
            "stream": [relative_gap(st, x) for st, x in zip(v["stream"], a)],
            "matched": [relative_gap(p, x) for p, x in zip(v["stream_prescaled"], a)],
            "control": [relative_gap(o, p) for o, p in zip(v["sync_other"], v["sync_pow2"])],
            "fine": [relative_gap(f, x) for f, x in zip(v["sync_fine"], a)]}


def _report_diagnostics(runs: dict) -> dict:
    """The stream with verl's rounding of 1/N, and verl's own update with its loss scalars rounded otherwise."""
    info_a, info_pow2 = runs["sync_a"][1], runs["sync_pow2"][1]
    c = _control_gaps({k: r[0] for k, r in runs.items()})
    floors, gaps, control, fine = c["floor"], c["matched"], c["control"], c["fine"]
    clipped = all(i["grad_norm"] > 1.0 for i in info_pow2)  # verl's clip: 1.0 (optim.clip_grad / actor.grad_clip)
    eps = max(1e-6 * (1 / CONTROL_POW2 - 1 / CONTROL_OTHER) / i["grad_norm"] for i in info_a)
    print("  stream with 1/N rounded where verl rounds it (diagnostic), gap to verl per step: "
          + ", ".join(f"{g:.3e}" for g in gaps))
    print(f"  control: verl's update with advantages x{CONTROL_OTHER:g} vs x{CONTROL_POW2:g} (grad norms "
          + ", ".join(f"{i['grad_norm']:.3f}" for i in info_pow2)
          + f": {'both clipped, the same step' if clipped else 'NOT all above the clip 1.0: no control'}; "
          + f"clip eps term <= {eps:.1e}), gap (gap/floor) per step: "
          + ", ".join(f"{g:.3e} ({g / f:.2f})" for g, f in zip(control, floors)))
    print("  fine floor: verl's update with one row per micro-batch vs the regular one, per step: "
          + ", ".join(f"{g:.3e} ({g / f:.2f} x floor)" for g, f in zip(fine, floors))
          + "; stream gap over the larger of the two floors: "
          + ", ".join(f"{g / max(f, x):.2f}" for g, f, x in zip(c["stream"], floors, fine)))
    return {"gap_normaliser_matched": max(gaps), "gap_verl_rescaled_over_floor": max(g / f for g, f in zip(control, floors)),
            "floor_fine_over_floor": max(x / f for x, f in zip(fine, floors)),
            "gap_over_max_floor": max(g / max(f, x) for g, f, x in zip(c["stream"], floors, fine)),
            "control_clipped": clipped, "grad_norm_min": min(i["grad_norm"] for i in info_a),
            **_diagnostics_applied(runs)}


def _diagnostics_applied(runs: dict) -> dict:
    """Point 19 on point 7's controls: the stream with verl's rounding of 1/N and verl's x24 vs x16 update, on the
    applied gradient, over its floor; {} where a run did not record it."""
    kinds = ("sync_a", "sync_b", "stream", "stream_prescaled", "sync_pow2", "sync_other", "sync_fine")
    if not all("applied" in i for k in kinds[:-1] for i in runs[k][1]):
        return {}
    c = _control_gaps({k: [i["applied"] for i in runs[k][1]] for k in kinds})
    over = {k: [g / f for g, f in zip(c[k], c["floor"])] for k in ("matched", "control", "fine", "stream")}
    over_control = [x / y for x, y in zip(over["stream"], over["control"])]  # the stream's gap over verl's own, per step
    print("  on the applied gradient, over its floor per step: stream with verl's 1/N rounding "
          + ", ".join(f"{r:.2f}" for r in over["matched"]) + "; verl's x24 vs x16 "
          + ", ".join(f"{r:.2f}" for r in over["control"]) + "; verl one row per micro-batch "
          + ", ".join(f"{r:.2f}" for r in over["fine"])
          + "; the stream's gap over verl's x24 vs x16 " + ", ".join(f"{r:.2f}" for r in over_control))
    return {"normaliser_matched_over_floor_applied": max(over["matched"]),
            "verl_rescaled_over_floor_applied": max(over["control"]),
            "floor_fine_over_floor_applied": max(over["fine"]), "gap_over_verl_rescaled_applied": max(over_control)}


def _report_float64_sum(runs: dict) -> dict:
    """Point 11: the stream summed in float64 across calls, against verl's update, over the same floor."""
    da, db = runs["sync_a"][0], runs["sync_b"][0]
    floors = [relative_gap(b, a) for b, a in zip(db, da)]
    gaps = [relative_gap(x, a) for x, a in zip(runs["stream_fp64sum"][0], da)]
    print("  stream summed in float64 across calls (experiment), gap (gap/floor) per step: "
          + ", ".join(f"{g:.3e} ({g / f:.2f})" for g, f in zip(gaps, floors)))
    return {"gap_float64_sum": max(gaps), "gap_float64_sum_over_floor": max(g / f for g, f in zip(gaps, floors))}


def _report_applied(info_a: list, info_b: list, info_s: list) -> dict:
    """Point 19: the same comparison on the gradient each optimizer step applied, before fp32
    parameter storage rounds the update (FSDP2 and Megatron record it); {} where a run did not record it."""
    if not all("applied" in i for i in (*info_a, *info_b, *info_s)):
        return {}
    rows = [(relative_gap(s["applied"], a["applied"]), relative_gap(b["applied"], a["applied"]))
            for a, b, s in zip(info_a, info_b, info_s)]
    ratios = [g / f if f > 0 else float("inf") for g, f in rows]
    print("  on the applied gradient (before parameter storage rounding), gap (gap/floor) per step: "
          + ", ".join(f"{g:.3e} ({r:.2f})" for (g, _), r in zip(rows, ratios)))
    k = ratios.index(max(ratios))
    return {"gap_applied": rows[k][0], "floor_applied": rows[k][1], "gap_over_floor_applied": ratios[k]}


def report(args, runs: dict, seconds: float, extra: dict | None = None) -> dict:
    extra = extra or {}
    (da, info_a), (db, info_b), (ds, info_s) = runs["sync_a"], runs["sync_b"], runs["stream"]
    layout, optimizer = f"dp={args.dp}", args.optimizer
    if args.engine == "megatron":
        layout = f"engine=megatron, tp={args.tp}, pp={args.pp}, dp={args.dp}" + (", per-token loss" * args.per_token_loss)
        optimizer = "adam (eps 1, distributed)" if args.distributed_optimizer else "sgd (no momentum)"
    print(f"\nequivalence: {args.algo}, {layout}, optimizer={optimizer}, {precision.describe(args)} "
          f"(float64 possible: {fp64_probe()})")
    ops_head = "turn chunks" if args.algo == "opd" else "chunks direct/bucket/folds"
    print(f"{'step':>4} | {'gap stream/sync':>16} | {'floor sync_a/sync_b':>19} | {'gap/floor':>9} | {'||dθ||':>9} | "
          f"{'s stream/sync':>13} | {ops_head}")
    worst = None
    for s, (a, b, st, info, info_sync) in enumerate(zip(da, db, ds, info_s, info_a)):
        gap, floor = relative_gap(st, a), relative_gap(b, a)
        ratio = gap / floor if floor > 0 else float("inf")
        secs = f"{info['seconds']:.2f}/{info_sync['seconds']:.2f}"
        print(f"{s + 1:>4} | {gap:>16.3e} | {floor:>19.3e} | {ratio:>9.2f} | {float(a.norm()):>9.3e} | {secs:>13} | {_ops_text(info)}")
        if worst is None or ratio > worst[2]:
            worst = (gap, floor, ratio, s)
    verdict = "PASS" if worst[2] <= 2.0 else "FAIL"
    print(f"worst step: gap/floor = {worst[2]:.2f} -> {verdict} (acceptance: gap <= 2 x floor); {seconds:.0f} s")
    storage = storage_report(ds[worst[3]] - da[worst[3]], info_a[worst[3]].get("params"))  # point 20
    print_storage(storage)
    result = {"algo": args.algo, "engine": args.engine, "tp": args.tp, "pp": args.pp, "dp": args.dp,
              "gap": worst[0], "floor": worst[1], "gap_over_floor": worst[2], **_report_applied(info_a, info_b, info_s),
              **storage}
    name = "equivalence" if args.algo == "grpo" else "equivalence_opd"
    if "terms" in extra:  # point 8: --kl / --entropy
        terms = extra["terms"]
        result.update(terms)
        name = "equivalence" + (f"_kl_{terms['kl_loss_type'].replace('+', '_st')}" if terms["kl_loss_type"] else "") + (
            "_entropy" if terms["entropy_coeff"] else "") + (
            "" if terms["loss_agg_mode"] == "token-mean" else f"_{terms['loss_agg_mode']}")
    if "minibatch" in extra:  # point 9: --mini-batches / --ppo-epochs
        result.update(extra["minibatch"])
        name = f"equivalence_minibatch{args.mini_batches}" + (f"_epochs{args.ppo_epochs}" if args.ppo_epochs > 1 else "") + (
            f"_kl_{args.kl_type.replace('+', '_st')}" if args.kl else "") + ("_entropy" if args.entropy else "")
    if "estimator" in extra:  # point 10: --estimator (adv_estimator, estimators_streamed, estimators_refused)
        result.update(extra["estimator"])
        name = f"equivalence_estimator_{args.estimator}" + (
            "" if args.loss_agg_mode == "token-mean" else f"_{args.loss_agg_mode}")
    if args.engine == "megatron":
        if "stream_prescaled" in runs:  # the plain GRPO comparison runs the diagnostics of point 7
            result.update(_report_diagnostics(runs))
        result.update(distributed_optimizer=args.distributed_optimizer, per_token_loss=args.per_token_loss)
        name = name.replace("equivalence", f"equivalence_megatron_tp{args.tp}_pp{args.pp}_dp{args.dp}" + (
            "_distopt" if args.distributed_optimizer else "") + ("_per_token" if args.per_token_loss else ""), 1)
        if "stream_fp64sum" in runs:  # point 11: an experiment, written apart from the plain result
            result.update(_report_float64_sum(runs))
            name += "_float64sum"
    if args.algo == "opd":
        _report_opd_teacher(runs, extra)
        result["teacher_prefix_max_diff"] = extra["teacher_prefix_max_diff"]
    if (args.lora_rank or args.diagnostics) and "stream_prescaled" in runs:  # point 16: point 7's controls on the adapter
        result.update(_report_diagnostics(runs))
        name += "_diagnostics" * args.diagnostics
    name = settings.result_name(args, result, name, runs)  # points 13-16
    name = name if args.dp == 1 or args.engine == "megatron" else f"{name}_dp{args.dp}"
    if getattr(args, "per_seed", None) is not None:  # --seeds: main writes the aggregate (point 12)
        args.per_seed.append((name, {"seed": args.seed, "seconds": round(seconds, 1), **result}))
    else:  # another seed's batches get their own file: the seed-0 figures are not overwritten
        write_result(name + (f"_seed{args.seed}" if args.seed else ""), result, args.results_dir)
    return result


if __name__ == "__main__":
    main()
