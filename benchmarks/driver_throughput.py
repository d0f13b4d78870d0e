"""Driver throughput: the real streamed step against a learner that returns at once, 1k to 16k trajectories a step.

Why:
1. At fleet scale every trajectory of a step passes through the driver: a TransferQueue listing sees it land, one
   read fetches its row, the planner ranks and chunks it, a chunk carries it to the learner through verl's
   dispatch. At 4,096 GPUs the simulator's batch is 16,384 trajectories a step, so a cost that grows faster than
   the batch (a scan of every ready row per plan, a listing that re-reads the whole partition) decides whether one
   driver keeps up. This measures the driver alone: the learner returns at once, so every second and CPU-second
   here is the driver's planning, fetching and dispatching.
2. Everything on the path is the real code: ``StreamedStep`` with ``StreamPlanner`` and ``GRPOArrivals``, the
   ``TrajectorySource`` listings, ``fetch_rows`` reads from verl's TransferQueue (controller and two storage units,
   as ``main_ppo`` starts it), ``build_stream_chunk`` (verl's no-padding layout) and ``OpPipeline`` queueing the
   calls on a verl ``RayWorkerGroup`` through the streaming worker's own dispatch (``actor_mesh_dispatch``). The
   learner (``InstantLearner``) registers the streaming worker's methods with the same dispatch modes and
   answers each call with the result row the real worker returns, without computing.
3. Rows are synthetic and small (prompt 32-96, response 64-256 tokens, binary rewards), shaped as verl's agent loop
   writes them (``prompts``, ``responses``, ``response_mask``, ``rm_scores``, ``rollout_log_probs``, ``extra_fields``),
   so the per-row costs dominate. They are written before the step with status ``running``; during the step a
   rollout actor marks them ``success`` (a tag-only put, the agent loop's last write) in waves of 32 in a long-tailed
   order, as fast as it can: arrivals outpace the driver, which is the regime where super-linear costs show.
4. Reported per batch size: ``trajectories_per_s`` (trajectories over the step's wall seconds, the driver being the
   bottleneck), ``cpu_ms_per_trajectory`` (the driver process's CPU, its Ray threads included, over the step),
   learner calls and listings, and what one listing costs with the batch landed (``listing_ms``: a listing
   returns the whole partition, so the step waits at least ``listing_pause_s`` between listings, which keeps them
   to ``LISTING_SHARE`` of its wait when arrivals are spread over a long step); ``growth_16k_over_1k`` is CPU per
   trajectory at 16k over 1k (a linear driver gives 1), and ``driver_cpu_share_of_sim_step`` the driver's CPU for
   a 16k step over the simulator's ThunderSync step time at 4,096 GPUs, 30B, log-normal turns
   (``sim/presets.scale_setting``).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time

SIZES = (1024, 4096, 16384)
GROUP = 8  # trajectories per prompt (the simulator's group size)
WAVE = 32  # trajectories marked landed per put (verifiers returning together)
PARTITION = "train"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----- the learner that returns at once (point 2) -------------------------------------------------
def instant_learner_class():
    """A verl worker with the streaming worker's methods and dispatch modes; each call returns its result row at once."""
    import torch
    from tensordict import TensorDict

    from thundersync_verl import verl_adapter as va
    from thundersync_verl.step.chunk_layout import COEF_KEY, SEQ_KEY

    register, Dispatch, actor_mesh = va.worker_register_api()

    class InstantLearner(va.verl_worker_base()):
        def __init__(self, config=None, role: str = "actor", tp: int = 1):
            super().__init__()
            self.tp = int(tp)
            self._register_dispatch_collect_info("actor", dp_rank=self.rank // self.tp, is_collect=self.rank % self.tp == 0)
            self.calls = {"begin": 0, "backward": 0, "fold": 0, "step": 0, "rows": 0}

        def _row(self, rows: int):
            now = torch.tensor([time.time()], dtype=torch.float64)
            nan = torch.tensor([float("nan")], dtype=torch.float64)
            return TensorDict({"ts_loss": nan, "ts_lp_diff_max": nan, "ts_forward_s": nan, "ts_rows": torch.tensor([rows]),
                               "ts_t_start": now, "ts_t_end": now}, batch_size=[1])

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def stream_begin_batch(self, meta: dict) -> None:
            self.calls["begin"] += 1

        @register(dispatch_mode=actor_mesh, blocking=False)
        async def stream_backward_queued(self, chunk):
            va.non_tensor(chunk, SEQ_KEY)  # what the real worker reads first: its ticket
            self.calls["backward"] += 1
            if self.rank % self.tp == 0:  # tensor-parallel peers receive the same part: count it once
                self.calls["rows"] += int(chunk[COEF_KEY].shape[0])
            return self._row(int(chunk[COEF_KEY].shape[0]))

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def stream_fold_queued(self, folds: dict, seq: int):
            self.calls["fold"] += 1
            return self._row(0)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def finalize_step(self, scale: float, lr_step: bool = True) -> dict:
            self.calls["step"] += 1
            return {"grad_norm": 0.0, "lr": 0.0}

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def learner_calls(self) -> dict:
            return dict(self.calls)

    return InstantLearner


# ----- the rollout side: rows written, then landed in waves (point 3) -------------------------------
def synthetic_rows(uids: list[str], n: int, seed: int):
    """``(keys, rows)``: one dict per trajectory, as verl's agent loop writes it."""
    import torch

    rng = random.Random(seed)
    keys, rows = [], []
    for uid in uids:
        for s in range(n):
            p_len, r_len = rng.randint(32, 96), rng.randint(64, 256)
            reward = float(rng.random() < 0.5)
            scores = torch.zeros(r_len)
            scores[-1] = reward
            keys.append(f"{uid}_{s}_0")
            rows.append({"prompts": torch.randint(3, 1000, (p_len,)), "responses": torch.randint(3, 1000, (r_len,)),
                         "response_mask": torch.ones(r_len, dtype=torch.int64), "rm_scores": scores,
                         "rollout_log_probs": -torch.rand(r_len), "extra_fields": {"min_global_steps": 0}})
    return keys, rows


def landing_order(keys: list[str], seed: int) -> list[str]:
    """Log-normal completion times with a shared per-group factor (members of a group tend to finish together)."""
    rng = random.Random(seed)
    factor = {}
    times = []
    for key in keys:
        gid = key.split("_")[0]
        factor.setdefault(gid, rng.gauss(0.0, 0.8))
        times.append(math.exp(factor[gid] + rng.gauss(0.0, 0.5)))
    return [k for _, k in sorted(zip(times, keys))]


def rollout_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class Rollouts:
        """Marks written rows landed (status ``success``), a wave per put, as fast as it can."""

        def __init__(self):
            import transfer_queue as tq

            tq.init()
            self.tq = tq

        def land(self, order: list[str]) -> float:
            t0 = time.time()
            for i in range(0, len(order), WAVE):
                wave = order[i:i + WAVE]
                self.tq.kv_batch_put(keys=wave, partition_id=PARTITION, tags=[{"status": "success"}] * len(wave))
            return time.time() - t0

    return Rollouts


# ----- one measured step ------------------------------------------------------------------------------
def run_step(tq, wg, rollouts, size: int, seed: int, chunk_size: int) -> dict:
    import ray

    from thundersync_verl.core.call_cost import CallCost
    from thundersync_verl.run.step_record import StepRecorder
    from thundersync_verl.step.stream_exec import OpPipeline
    from thundersync_verl.step.stream_plan import StreamPlanner
    from thundersync_verl.step.streamed_step import GRPOArrivals, StepContext, StreamedStep
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    uids = [f"p{seed:03d}x{i:06d}" for i in range(size // GROUP)]
    keys, rows = synthetic_rows(uids, GROUP, seed)
    for i in range(0, len(keys), 1024):  # written before the step (untimed), not yet landed
        part = keys[i:i + 1024]
        tq.kv_batch_put(keys=part, partition_id=PARTITION, fields=list_of_dict_to_tensordict(rows[i:i + 1024]),
                        tags=[{"status": "running"}] * len(part))
    order = landing_order(keys, seed)
    planner = StreamPlanner(adv_estimator="grpo", loss_agg_mode="token-mean", max_chunk_size=chunk_size)
    recorder = StepRecorder(None, mode="thundersync")
    recorder.begin_step(seed)
    cost = CallCost()
    ctx = StepContext(
        worker_group=wg, tq=tq, recorder=recorder,
        make_pipeline=lambda on_done: OpPipeline(wg, pad_token_id=0, temperature=1.0, on_done=on_done, depth=2, cost=cost),
        forward_at_theta_k=lambda k, t: {}, uids=uids, n=GROUP, timeout_s=600.0, poll_s=0.01, coalesce=True,
        fused_forward=True)
    before = _calls(wg)
    step = StreamedStep(ctx, GRPOArrivals(planner))
    landing = rollouts.land.remote(order)
    c0, t0 = time.process_time(), time.time()
    _, state = step.run()
    wall, cpu = time.time() - t0, time.process_time() - c0
    land_s = ray.get(landing)
    listing_s = listing_cost(tq, uids)
    after = _calls(wg)
    tq.kv_clear(keys=keys, partition_id=PARTITION)  # the trainer clears a finished batch
    calls = {k: after[k] - before[k] for k in after}
    if calls["rows"] < size or calls["step"] != 1:
        raise RuntimeError(f"the step did not reach the learner whole: {calls} for {size} trajectories")
    return {"trajectories": size, "wall_s": wall, "cpu_s": cpu, "land_s": land_s, "listings": state.listings,
            "listing_s": listing_s,
            "backward_calls": calls["backward"], "fold_calls": calls["fold"]}


def listing_cost(tq, uids: list[str], repeats: int = 3) -> float:
    """Median wall seconds of one ``TrajectorySource`` poll with the whole batch landed (the listing RPC, reading it)."""
    from thundersync_verl.step.trajectory_source import TrajectorySource

    source = TrajectorySource(tq.kv_list, uids, GROUP)
    source.poll()  # every key seen once, as in a step's later listings
    times = []
    for _ in range(repeats):
        source.poll()
        times.append(source.last_listing_s)
    return statistics.median(times)


def _calls(wg) -> dict:
    """Rank 0's call counts; rows summed over the data-parallel parts."""
    ranks = wg.learner_calls()
    return {**ranks[0], "rows": sum(r["rows"] for r in ranks)}


def simulated_step_s() -> float:
    """The simulator's ThunderSync step time at 4,096 GPUs, 30B, log-normal turns (as ``simulate_scale.py`` runs it)."""
    from thundersync_verl.sim.presets import scale_setting
    from thundersync_verl.sim.sim_engine import simulate
    from thundersync_verl.sim.workload import SyntheticSource

    setting = scale_setting(4096, "30B", "lognormal")
    source = SyntheticSource(setting.workload, setting.rollout, seed=0)
    return float(simulate(setting.sim_config("thundersync", "grpo", 8), source, setting.costs).step_time_s)


def measure(sizes, repeats: dict, chunk_size: int, dp: int = 1, tp: int = 1) -> dict:
    """Start Ray, the TransferQueue and the learner; run each size ``repeats[size]`` times (after a warm-up step)."""
    import ray
    import transfer_queue as tq

    from thundersync_harness import engine_setup
    from thundersync_verl import verl_adapter as va

    import logging

    logging.getLogger("transfer_queue").setLevel(logging.ERROR)  # one warning per client about the core count
    with engine_setup.ray_session():
        world = dp * tp
        ray.init(num_cpus=world + 4, num_gpus=world, include_dashboard=False, log_to_driver=False,
                 _temp_dir=os.environ["RAY_TMPDIR"])
        tq.init()
        try:
            wg = va.ray_worker_group_with(instant_learner_class(), config=None, role="actor", n_workers=world, tp=tp)
            rollouts = rollout_actor_class().remote()
            run_step(tq, wg, rollouts, min(sizes), 0, chunk_size)  # warm-up: Ray, the controller, the dispatch
            per_size = {}
            for size in sizes:
                runs = []
                for r in range(repeats[size]):
                    runs.append(run_step(tq, wg, rollouts, size, 1 + r, chunk_size))
                    log(f"  {size}: wall {runs[-1]['wall_s']:.2f}s cpu {runs[-1]['cpu_s']:.2f}s "
                        f"listings {runs[-1]['listings']} calls {runs[-1]['backward_calls']}+{runs[-1]['fold_calls']}")
                per_size[size] = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            return per_size
        finally:
            tq.close()


def shortest_pause(listing_s: float, poll_s: float = 0.01) -> float:
    """The shortest pause the streamed step keeps between two listings that each take ``listing_s``
    (``StreamedStep._wait``: ``poll_s`` after an arrival, at least the listing over ``LISTING_SHARE`` once that
    exceeds ``POLL_CAP_S``)."""
    from thundersync_verl.step.streamed_step import LISTING_SHARE, POLL_CAP_S

    floor = listing_s / LISTING_SHARE
    return max(poll_s, floor) if floor > POLL_CAP_S else poll_s


def summary(per_size: dict, step_s: float | None) -> dict:
    first, last = min(per_size), max(per_size)
    label = {s: f"{s // 1024}k" if s % 1024 == 0 else str(s) for s in per_size}
    cpu_ms = {s: 1000.0 * m["cpu_s"] / s for s, m in per_size.items()}
    out = {
        "trajectories_per_s": {label[s]: round(s / m["wall_s"], 1) for s, m in per_size.items()},
        "cpu_ms_per_trajectory": {label[s]: round(cpu_ms[s], 4) for s in per_size},
        "growth_16k_over_1k": round(cpu_ms[last] / cpu_ms[first], 3),
        "driver_cpu_s_per_step": {label[s]: round(m["cpu_s"], 3) for s, m in per_size.items()},
        "learner_calls_per_trajectory": {label[s]: round((m["backward_calls"] + m["fold_calls"]) / s, 3)
                                         for s, m in per_size.items()},
        "listings": {label[s]: int(m["listings"]) for s, m in per_size.items()},
        "listing_ms": {label[s]: round(1000.0 * m["listing_s"], 2) for s, m in per_size.items()},
        "listing_pause_s": {label[s]: round(shortest_pause(m["listing_s"]), 3) for s, m in per_size.items()},
        "landing_s": {label[s]: round(m["land_s"], 2) for s, m in per_size.items()},  # all landed: well before the step's end
        "wall_s": {label[s]: round(m["wall_s"], 2) for s, m in per_size.items()},
    }
    if step_s is not None:
        out["sim_step_s_4096gpu_30b"] = round(step_s, 1)
        out["driver_cpu_share_of_sim_step"] = round(per_size[last]["cpu_s"] / step_s, 5)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one measured step at the sizes above 4k (default: the median of three at every size)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="trajectories per step, comma-separated")
    parser.add_argument("--chunk-size", type=int, default=8, help="thundersync.chunk_size")
    parser.add_argument("--dp", type=int, default=1, help="learner data-parallel ranks")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel peers per data-parallel rank")
    parser.add_argument("--profile", default=None, metavar="FILE", help="write a cProfile of the driver to FILE")
    from thundersync_verl.run.results import add_results_dir_argument, write_result

    add_results_dir_argument(parser)
    args = parser.parse_args()
    sizes = tuple(sorted(int(s) for s in args.sizes.split(",")))
    repeats = {size: 1 if args.quick and size > 4096 else 3 for size in sizes}
    log(f"driver throughput: sizes {sizes}, steps {repeats}, chunk size {args.chunk_size}, dp {args.dp} tp {args.tp}")
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    per_size = measure(sizes, repeats, args.chunk_size, dp=args.dp, tp=args.tp)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    step_s = simulated_step_s()
    result = summary(per_size, step_s)
    suffix = "" if (args.dp, args.tp) == (1, 1) else f"_dp{args.dp}_tp{args.tp}"
    write_result("driver_throughput" + suffix, result, args.results_dir)


if __name__ == "__main__":
    main()
