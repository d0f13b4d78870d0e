"""OPD beyond the project's k1 policy gradient: verl's shipped distillation settings, streamed and compared.

Why:
1. verl's ``distillation.yaml`` ships ``loss_mode: k3``, ``use_policy_gradient: false``, ``use_task_rewards: true``
   (``shipped_distill_loss`` reads it from verl's installed package, not from a copy). With task rewards the
   streamed step has two inputs (``algos/opd/opd_task.py``): scored turns (the distillation term, straight into
   the batch gradient) and landed trajectories with their rewards (the GRPO term, direct or bucketed and folded).
   ``with_landings`` adds a landing ``(tid, None)`` to a turn arrival order, right after the trajectory's last
   turn to arrive (its agent loop publishes its turns before it returns).
2. One engine compares several distillation settings: ``DistillationProbeWorker.set_distillation`` rebuilds the
   worker's verl loss function (``distillation_ppo_loss`` with a new ``DistillationConfig``) exactly as verl's
   ``init_model`` builds it, so ``update_actor`` runs verl's own loss with those settings, and ``opd_loss`` parses
   the same settings with the project's reader: both sides see one dict.
"""

from __future__ import annotations

from pathlib import Path

from thundersync_harness.engine_setup import GROUP_SIZE
from thundersync_harness.engine_steps import Feed, StreamingLearnerClient


def shipped_distill_loss() -> dict:
    """verl's shipped ``distillation.distillation_loss`` defaults (its yaml, without the ``_target_``)."""
    import verl
    from omegaconf import OmegaConf

    path = Path(verl.__file__).parent / "trainer" / "config" / "distillation" / "distillation.yaml"
    loss = OmegaConf.to_container(OmegaConf.load(path).distillation_loss)
    loss.pop("_target_", None)
    return loss


def opd_loss(distill_loss: dict):
    """The project's reading (``opd_config.OPDLoss``) of ``distillation.distillation_loss`` = ``distill_loss``."""
    from omegaconf import OmegaConf

    from thundersync_verl.algos.opd.opd_config import opd_loss_from_verl_config

    config = {"distillation": {"enabled": True, "distillation_loss": distill_loss}}
    return opd_loss_from_verl_config(OmegaConf.create(config))


def with_landings(arrival: list[tuple[int, int]], turns: dict) -> list[tuple[int, int | None]]:
    """``arrival`` with ``(tid, None)`` right after the last of trajectory ``tid``'s turns to arrive."""
    seen, out = {tid: 0 for tid in turns}, []
    for tid, j in arrival:
        out.append((tid, j))
        seen[tid] += 1
        if seen[tid] == len(turns[tid]):
            out.append((tid, None))
    return out


def task_feed(spec, wg, trajs, pad_token_id: int, max_chunk: int) -> "TaskTurnFeed":
    from thundersync_verl.algos.opd.opd_stream import OPDStreamClient, OPDTurnPlanner
    from thundersync_verl.algos.opd.opd_task import OPDTaskPlanner
    from thundersync_verl.step.stream_plan import StreamPlanner

    planner = OPDTaskPlanner(OPDTurnPlanner(loss_agg_mode="token-mean", max_chunk_size=max_chunk, loss=spec.loss),
                             StreamPlanner(adv_estimator="grpo", loss_agg_mode="token-mean", max_chunk_size=max_chunk))
    planner.begin_batch([t.tid for t in trajs], {g: GROUP_SIZE for g in sorted({t.tid // GROUP_SIZE for t in trajs})})
    turn_client = OPDStreamClient(wg, pad_token_id=pad_token_id)
    turn_client.begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": len(trajs) // GROUP_SIZE,
                             "adv_estimator": "grpo"})
    return TaskTurnFeed(planner, turn_client, StreamingLearnerClient(wg, pad_token_id=pad_token_id), trajs, spec.turns)


class TaskTurnFeed(Feed):
    """Scored turns ``(tid, j)`` and landed trajectories ``(tid, None)``; ops sent in order, each to its method."""

    kinds = ("turn_chunks", "direct", "bucket", "fold")

    def __init__(self, planner, turn_client, task_client, trajs, turns: dict):
        super().__init__(planner, turn_client)
        self.task_client, self.turns, self.count = task_client, turns, 0
        self.trajs = {t.tid: t for t in trajs}
        self.table = {(t.tid // GROUP_SIZE, t.tid): (t.prompt, t.response, list(t.mask)) for t in trajs}

    def arrive(self, item) -> None:
        tid, j = item
        if j is None:
            t = self.trajs[tid]
            self.planner.arrive(tid // GROUP_SIZE, tid, t.reward, sum(t.mask))
            return
        self.planner.add_turn(self.turns[tid][j])
        if j == len(self.turns[tid]) - 1:
            self.planner.end_trajectory(tid, len(self.turns[tid]))
        self.count += 1

    def send(self, ops) -> None:
        from thundersync_verl.algos.opd.opd_stream import TurnBackwardOp

        for op in ops:  # in order: a fold after its bucket's backwards
            if isinstance(op, TurnBackwardOp):
                self.client.run([op])
            else:
                self.task_client.run([op], self.table)

    def figures(self, final) -> dict:
        return {"turns": self.count, "barrier_scale": final.scale}


def probe_worker_class():
    """The streaming worker plus ``set_distillation(distill_loss)`` (point 2)."""
    from thundersync_verl.learner.streaming_worker import Dispatch, StreamingActorWorker, register

    class DistillationProbeWorker(StreamingActorWorker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def set_distillation(self, distill_loss: dict) -> None:
            """verl's loss function with ``distillation.distillation_loss`` replaced by ``distill_loss``."""
            from functools import partial

            from omegaconf import OmegaConf
            from verl.trainer.distillation import distillation_ppo_loss
            from verl.utils.config import omega_conf_to_dataclass

            dist = omega_conf_to_dataclass(self.distillation_config)  # as verl's init_model builds it
            loss = omega_conf_to_dataclass(OmegaConf.create({"_target_": "verl.workers.config.DistillationLossConfig",
                                                             **distill_loss}))
            object.__setattr__(dist, "distillation_loss", loss)  # a frozen field of verl's config: only the loss
            self.loss_fn = partial(distillation_ppo_loss, config=self.loss_fn.keywords["config"],
                                   distillation_config=dist)
            self.actor.set_loss_fn(self.loss_fn)

    return DistillationProbeWorker


# ----- the comparison's flags (benchmarks/equivalence.py --algo opd) --------------------------------------------
OPD_CONFIGS = ("project", "verl")  # the project's k1 policy gradient; verl's distillation.yaml as shipped


def add_distillation_arguments(parser) -> None:
    from thundersync_verl.algos.opd.opd_config import ESTIMATORS

    parser.add_argument("--opd-config", default="project", choices=OPD_CONFIGS,
                        help="--algo opd: the project's k1 policy gradient, or verl's shipped distillation_loss "
                             "(k3, supervised, task rewards)")
    parser.add_argument("--distill-loss-mode", default=None, choices=ESTIMATORS,
                        help="--algo opd: distillation_loss.loss_mode on top of --opd-config")


def check_distillation(parser, args):
    """``args.distill_loss``: the ``distillation_loss`` overrides verl's config gets (None: the project's OPD)."""
    if args.algo != "opd":
        if args.opd_config != "project" or args.distill_loss_mode is not None:
            parser.error("--opd-config / --distill-loss-mode run --algo opd")
        args.distill_loss = None
        return args
    from thundersync_harness.engine_setup import PROJECT_DISTILL_LOSS

    base = dict(PROJECT_DISTILL_LOSS) if args.opd_config == "project" else {}
    if args.distill_loss_mode is not None:
        base["loss_mode"] = args.distill_loss_mode
    args.distill_loss = None if args.opd_config == "project" and args.distill_loss_mode is None else base
    return args


def distillation_result(args, result: dict, name: str, config) -> str:
    """The distillation settings verl's config carried (``distillation`` key); the name with ``_verl`` / ``_<mode>``."""
    if args.algo != "opd":
        return name
    from thundersync_verl.algos.opd.opd_config import opd_loss_from_verl_config

    result["distillation"] = {"opd_config": args.opd_config, **opd_loss_from_verl_config(config).describe()}
    return name + ("_verl" if args.opd_config == "verl" else "") + (
        f"_{args.distill_loss_mode}" if args.distill_loss_mode else "")
