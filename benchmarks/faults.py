"""Faults on the real CPU stack, and checkpoint/resume in thundersync mode: ``python benchmarks/faults.py --quick``.

Why:
1. Every fault is injected by configuration or ``$THUNDERSYNC_FAULTS`` only (``thundersync_verl/run/faults.py``)
   into verl's real ``main_ppo`` with the ThunderSync trainer: real Ray actors, the real learner, the
   sandboxed tools and verifier. A fault is SURVIVED when the run recovers (the step completes with
   every trajectory) or stops with a clear error and a resume from the last checkpoint completes the
   run; anything else is counted as tried but not survived.
2. The resume chain replays one recording (``replay`` backend, the synthesised ``paper`` workload,
   nothing slept), so every attempt sees the same trajectories: ``disk_full`` at step 2's save, then a
   resume whose learner is killed between two chunks of step 3, then a resume whose verifier hangs
   until ``thundersync.trajectory_timeout_s`` fails step 3, then a resume whose rollout replica dies
   mid-batch (its process killed at a generate call of step 3), then a clean resume to the end.
3. Exactness of resume: each resumed run pushes the weights it restored (version k) and the replay
   server keeps every push (``$THUNDERSYNC_REPLAY_WEIGHTS_DIR``); ``resume_restore_bitwise`` compares
   them with the weights the interrupted run pushed after step k, bit for bit. The final weights are
   compared with an uninterrupted run's. A streamed step sums in arrival order unless
   ``thundersync.deterministic=true`` (batch order, whole chunks: ``trajectory_source.py`` point 4), which
   the chain and both uninterrupted runs set: then two uninterrupted runs must agree bit for bit
   (``run_to_run_bitwise``) and so must the resumed run (``resume_bitwise``); their gap stays reported
   (``resume_gap_over_floor``, 0 when bitwise). Sync is verl's own trainer, run as it comes: a run resumed
   after step 1 against the uninterrupted one (``resume_bitwise_sync``; verl orders its batch by
   TransferQueue arrival, so this is reported, not required).
4. The recoverable faults run on the live ``hf_cpu`` rollout (a killed tool changes what the model
   sees next, which a recording cannot replay): sandboxes killed, verifier crashes, one NaN gradient,
   the first weight push cut half-way; and an OPD run whose teacher leaves every 10th request
   unanswered (the attempt timeout must retry each: ``thundersync/opd/teacher_retries``). The NaN step
   must take no optimizer step: its checkpoint's
   parameters equal the previous step's. The cut push must be refused by the rollout and repeated
   whole: what the rollout received as version 1 equals the learner's step-1 checkpoint bit for bit.
6. Node loss, on a local 3-node Ray cluster (``thundersync_verl/run/cluster.py``: a head and two one-slot nodes
   as separate raylets; runs reach it through ``RAY_ADDRESS``): the raylet of the node running the learner is
   killed between two chunks of step 2, that node is restarted and the run resumed; the raylet of the node
   running the rollout server is then killed mid-batch (at a generate call of step 2); after that node's restart
   a clean resume runs to the end. An agent loop on a lost node dies with it and reports nothing: the driver's
   node watch (``streamed_step.py`` point 6) stops such a step once Ray's head declares the node dead, well
   before ``thundersync.trajectory_timeout_s``; an agent loop elsewhere reports its failed call at once. Each stop must name the lost node (its ``thundersync_<name>``
   resource; which node ran which role is read from Ray's actor table), push no weights of the stopped step,
   and the next resume must restore the last checkpoint bit for bit; the final weights must equal the
   uninterrupted one-node run's bit for bit (``node_resume_bitwise``; ``resume_bitwise`` with ``--only``).
7. ``half_steps``: steps whose optimizer update ran on part of a batch (a step recorded with fewer
   trajectories than the batch, or a failed step whose weights were pushed); ``trajectories_lost``:
   trajectories expected by the completed steps minus those they learned from.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts: emulated_rollout, modes

import emulated_rollout as er  # noqa: E402
import modes  # noqa: E402
from thundersync_verl.run.faults import ENV, LOG_ENV, read_log  # noqa: E402
from thundersync_verl.run.results import add_results_dir_argument, write_result  # noqa: E402

STEPS = 3
PER_STEP = modes.BATCH_PROMPTS * 4  # prompts x rollout.n
WEIGHTS_ENV = "THUNDERSYNC_REPLAY_WEIGHTS_DIR"
FLOOR_FACTOR = 3.0  # a resumed run's final gap may be this many times the run-to-run floor
DETERMINISTIC = ["thundersync.deterministic=true"]  # the resume comparison's ThunderSync runs (point 3)
RESUME_COMPARED = {"uninterrupted", "uninterrupted_again", "disk_full", "learner_kill", "verifier_hang", "rollout_kill",
                   "resumed", "learner_node_kill", "rollout_node_kill", "node_resumed"}
TEACHER_HANG_EVERY = 10  # teacher requests of one agent-loop worker process
ROLLOUT_KILL_CALL = 12  # a step of the paper workload makes ~100 generate calls: the replica dies mid-batch


def setup(work: Path) -> tuple[dict, Path]:
    """The tiny policy, the task's data and the replayed recording (built once, cached under ``work``)."""
    from thundersync_harness.engine_setup import build_tiny_model
    from thundersync_verl.demo import prepare_inputs

    model = work / "tiny_random_lm"
    if not (model / "config.json").is_file():
        build_tiny_model(model)
    inputs = prepare_inputs(work, model=str(model))
    return inputs, er.make_recording("paper", STEPS + 2, inputs, work)


def replay_run(name: str, ctx: dict, *, faults: str = "", extra: list[str] | None = None, ckpt: Path | None = None,
               expect_fail: bool = False, mode: str = "thundersync") -> dict:
    """One ``main_ppo`` (ThunderSync unless ``mode``) on the recording; returns its steps, log, weights folder, outcome."""
    wdir = ctx["work"] / "weights" / name
    if name in ctx.get("reuse", ()):
        return dict(from_log(ctx["work"] / f"{mode}_{name}", STEPS), name=name, weights=wdir)
    shutil.rmtree(wdir, ignore_errors=True)
    wdir.mkdir(parents=True)
    env = {WEIGHTS_ENV: str(wdir), ENV: faults, LOG_ENV: str(ctx["work"] / f"faults_{name}.jsonl")}
    cluster_args: list[str] = []
    if ctx.get("cluster") is not None:  # point 6: the run goes to the running cluster, its env with it
        from thundersync_harness.cluster_runs import on_cluster

        logs = {"VERL_FILE_LOGGER_PATH": str(ctx["work"] / f"{mode}_{name}" / "metrics.jsonl")}
        cluster_args, env = on_cluster(ctx["cluster"], {**env, **logs})
    ckpt_args = ([f"trainer.default_local_dir={ckpt}", "trainer.save_freq=1", "trainer.resume_mode=auto"] if ckpt
                 else ["trainer.resume_mode=disable"])
    ordered = DETERMINISTIC if mode == "thundersync" and name in RESUME_COMPARED else []
    try:
        run = er.run_replay(mode, STEPS, ctx["inputs"], ctx["work"], "paper", ctx["rec"], 0.0, tag="_" + name,
                            extra=ckpt_args + ordered + cluster_args + list(extra or []), env=env)
        ok, error = True, ""
    except RuntimeError:
        run = from_log(ctx["work"] / f"{mode}_{name}", STEPS)
        ok, error = run["ok"], run["error"]
    run.update(name=name, ok=ok, error=error, weights=wdir, expected_ok=not expect_fail)
    print(f"[faults] {name}: {'completed' if ok else 'stopped'} ({'as expected' if ok != expect_fail else 'UNEXPECTED'})",
          flush=True)
    return run


def from_log(run_dir: Path, steps: int) -> dict:
    """A finished run's outcome read back from its log: the steps it logged, completed or not, the log text."""
    from thundersync_verl.demo import parse_step_line

    text = (run_dir / "verl.log").read_text(errors="replace") if (run_dir / "verl.log").is_file() else ""
    per_step = dict(p for p in map(parse_step_line, text.splitlines()) if p)
    ok = max(per_step, default=0) == steps and "Traceback" not in text
    return {"per_step": per_step, "run_dir": run_dir, "ok": ok, "error": "" if ok else text}


def weights(run: dict, version: int) -> dict | None:
    import torch

    path = run["weights"] / f"weights_v{version}.pt"
    return torch.load(path) if path.is_file() else None


def same_bits(a: dict | None, b: dict | None) -> bool:
    import torch

    return a is not None and b is not None and sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def rel_gap(a: dict, b: dict, start: dict) -> float:
    """||a - b|| / ||b - start|| over every parameter (float64)."""
    from thundersync_harness.main_ppo_runs import distance

    moved = distance(b, start)
    return distance(a, b) / moved if moved > 0 else float("inf")


def learned_per_step(run_dir: Path, algo: str = "grpo") -> dict[int, int]:
    """Trajectories each completed step learned from (the step recorder's trace)."""
    trace = Path(run_dir) / f"{algo}_thundersync.jsonl"
    counts: dict[int, int] = {}
    for line in (trace.read_text().splitlines() if trace.is_file() else []):
        rec = json.loads(line)
        if rec.get("kind") == "trajectory":
            counts[rec["step"]] = counts.get(rec["step"], 0) + 1
    return counts


def resume_chain(ctx: dict) -> dict:
    """Point 2: disk full, learner killed, verifier hang with the trajectory timeout, then a clean resume."""
    ckpt = ctx["work"] / "ckpt_chain"
    shutil.rmtree(ckpt, ignore_errors=True)
    hang = ["thundersync.trajectory_timeout_s=20", "reward.custom_reward_function.reward_kwargs.verifier_timeout_s=600"]
    runs = [replay_run("disk_full", ctx, faults="disk_full@step=2", ckpt=ckpt, expect_fail=True),
            replay_run("learner_kill", ctx, faults="learner_kill@batch=2,chunk=2", ckpt=ckpt, expect_fail=True),
            replay_run("verifier_hang", ctx, faults="verifier_hang@after=0", ckpt=ckpt, extra=hang, expect_fail=True),
            replay_run("rollout_kill", ctx, faults=f"rollout_kill@call={ROLLOUT_KILL_CALL}", ckpt=ckpt,
                       extra=["thundersync.trajectory_timeout_s=60"], expect_fail=True),
            replay_run("resumed", ctx, ckpt=ckpt)]
    checks = {
        "disk_full": "could not be written" in runs[0]["error"] and "No space left" in runs[0]["error"],
        "learner_kill": "learner worker died during step 3" in runs[1]["error"] and weights(runs[1], 3) is None,
        "verifier_hang": "did not arrive within" in runs[2]["error"] and weights(runs[2], 3) is None,
        "rollout_kill": any(p in runs[3]["error"] for p in CLEAR_ERRORS) and weights(runs[3], 3) is None,
    }
    # each resume restored the last complete checkpoint bit for bit: what it pushed first is what the
    # interrupted run pushed after that step
    restores = {"learner_kill": same_bits(weights(runs[1], 1), weights(runs[0], 1)),
                "verifier_hang": same_bits(weights(runs[2], 2), weights(runs[1], 2)),
                "rollout_kill": same_bits(weights(runs[3], 2), weights(runs[1], 2)),
                "resumed": same_bits(weights(runs[4], 2), weights(runs[1], 2))}
    survived = {"disk_full": checks["disk_full"] and restores["learner_kill"],
                "learner_kill": checks["learner_kill"] and restores["verifier_hang"],
                "verifier_hang": checks["verifier_hang"] and restores["rollout_kill"],
                "rollout_kill": checks["rollout_kill"] and restores["resumed"] and runs[4]["ok"]}
    return {"runs": runs, "checks": checks, "restores": restores, "survived": survived}


NODE_LOST = "left the cluster"  # the stop's rule line when a Ray node is lost (run/resume.py point 4)


def node_loss(ctx: dict) -> dict:
    """Point 6: the learner node's raylet killed in step 2, then (resumed) the rollout node's, then a clean resume."""
    from thundersync_harness.cluster_runs import cluster_env, placement
    from thundersync_verl.run.cluster import LocalCluster, layout

    ckpt = ctx["work"] / "ckpt_nodes"
    shutil.rmtree(ckpt, ignore_errors=True)
    cluster = LocalCluster(layout("split"), cluster_env(ctx["work"]))
    lost: dict[str, str] = {}  # fault -> the node that hosted its role (Ray chose it: read from the actor table)
    try:
        cluster.start()
        ctx = {**ctx, "cluster": cluster, "reuse": set()}  # a chain on a fresh cluster: nothing read back
        runs = [replay_run("learner_node_kill", ctx, faults="learner_node_kill@batch=2,chunk=2", ckpt=ckpt,
                           expect_fail=True)]
        lost["learner_node_kill"] = (placement(cluster)["learner"] or ["?"])[0]
        cluster.restart_node(lost["learner_node_kill"])
        runs.append(replay_run("rollout_node_kill", ctx, faults=f"rollout_node_kill@call={ROLLOUT_KILL_CALL}",
                               ckpt=ckpt, extra=["thundersync.trajectory_timeout_s=60"], expect_fail=True))
        lost["rollout_node_kill"] = (placement(cluster)["rollout_server"] or ["?"])[0]
        cluster.restart_node(lost["rollout_node_kill"])
        runs.append(replay_run("node_resumed", ctx, ckpt=ckpt))
    finally:
        left = cluster.stop()
    checks = {name: NODE_LOST in run["error"] and f"thundersync_{lost[name]}" in run["error"] and weights(run, 2) is None
              for name, run in zip(("learner_node_kill", "rollout_node_kill"), runs)}
    restores = {"rollout_node_kill": same_bits(weights(runs[1], 1), weights(runs[0], 1)),
                "node_resumed": same_bits(weights(runs[2], 1), weights(runs[0], 1))}
    survived = {"learner_node_kill": checks["learner_node_kill"] and restores["rollout_node_kill"],
                "rollout_node_kill": checks["rollout_node_kill"] and restores["node_resumed"] and runs[2]["ok"]}
    return {"runs": runs, "checks": checks, "restores": restores, "survived": survived, "lost_nodes": lost,
            "leftover_processes": left}


def sync_resume(ctx: dict) -> dict:
    """Point 3 in Sync mode, whose batch sums in a fixed order: resumed after step 1 vs uninterrupted, bit for bit."""
    ckpt_a, ckpt_b = ctx["work"] / "ckpt_sync_a", ctx["work"] / "ckpt_sync_b"
    for folder in (ckpt_a, ckpt_b):
        shutil.rmtree(folder, ignore_errors=True)
    whole = replay_run("sync_uninterrupted", ctx, ckpt=ckpt_a, mode="sync")
    if (ckpt_a / "global_step_1").is_dir():
        shutil.copytree(ckpt_a / "global_step_1", ckpt_b / "global_step_1")
        (ckpt_b / "latest_checkpointed_iteration.txt").write_text("1")
    resumed = replay_run("sync_resumed", ctx, ckpt=ckpt_b, mode="sync")
    return {"bitwise": whole["ok"] and resumed["ok"] and same_bits(weights(resumed, STEPS), weights(whole, STEPS)),
            "restore_bitwise": same_bits(weights(resumed, 1), weights(whole, 1)),
            "steps_resumed": sorted(resumed["per_step"])}


def live_run(ctx: dict, name: str, algo: str, extra: list[str], env: dict) -> dict:
    """A 2-step ThunderSync ``main_ppo`` of ``algo`` (no replay of the recording); a run that stops is read from its log."""
    try:
        run = modes.run_mode("thundersync", 2, ctx["inputs"], ctx["work"], algo=algo, latency_scale=0.0, tag="_" + name,
                             extra=extra, env_extra=env)
        return dict(run, ok=True, error="")
    except RuntimeError:
        return from_log(ctx["work"] / f"{'' if algo == 'grpo' else algo + '_'}thundersync_{name}", 2)


def recoverable(ctx: dict) -> dict:
    """Point 4: sandboxes killed, verifier crashes and one NaN gradient (step 2) on the live hf_cpu rollout."""
    import torch

    name, ckpt = "recoverable", ctx["work"] / "ckpt_recoverable"
    pushes = ctx["work"] / "weights" / name
    log = ctx["work"] / f"faults_{name}.jsonl"
    if name in ctx.get("reuse", ()):
        run = from_log(ctx["work"] / f"thundersync_{name}", 2)
    else:
        shutil.rmtree(ckpt, ignore_errors=True)
        log.unlink(missing_ok=True)
        shutil.rmtree(pushes, ignore_errors=True)
        env = {ENV: "sandbox_kill@every=3;verifier_raise@every=5;nan_grad@batch=2,chunk=1;push_fail@step=1",
               LOG_ENV: str(log), WEIGHTS_ENV: str(pushes)}
        synth = ctx["work"] / f"{name}_synthesised.jsonl"  # the scripted agent: real tool calls, whatever they return
        synth.unlink(missing_ok=True)
        extra = er.workload_overrides("paper") + [
            "actor_rollout_ref.rollout.name=replay", f"{er.REPLAY}.path={synth}", f"{er.REPLAY}.synthesize=paper",
            f"trainer.default_local_dir={ckpt}", "trainer.save_freq=1", "trainer.resume_mode=disable"]
        run = live_run(ctx, name, "grpo", extra, env)
    ok = run["ok"]
    fired = read_log(log)
    kinds = {k: sum(f["fault"] == k for f in fired) for k in ("sandbox_kill", "verifier_raise", "nan_grad", "push_fail")}
    step2 = run["per_step"].get(2, {})
    models = [ckpt / f"global_step_{s}" / "actor" / "model_world_size_1_rank_0.pt" for s in (1, 2)]
    unchanged = pushed_whole = None
    if all(p.is_file() for p in models):
        a, b = (torch.load(p, weights_only=False) for p in models)
        unchanged = all(torch.equal(_local(a[k]), _local(b[k])) for k in a)
        pushed = weights({"weights": pushes}, 1)  # what the rollout received after the cut push was repeated
        pushed_whole = pushed is not None and sorted(pushed) == sorted(a) and all(
            torch.equal(pushed[k], _local(a[k]).to(pushed[k].dtype)) for k in a)
    survived = {"sandbox_kill": ok and kinds["sandbox_kill"] > 0, "verifier_raise": ok and kinds["verifier_raise"] > 0,
                "nan_grad": ok and kinds["nan_grad"] == 1 and step2.get("thundersync/steps_skipped_nonfinite") == 1
                and bool(unchanged),
                "push_fail": ok and kinds["push_fail"] == 1 and step2.get("thundersync/weight_push_retries") == 1
                and bool(pushed_whole)}
    return {"run": dict(run, name=name), "fired": kinds, "nan_step_params_unchanged": unchanged,
            "push_retried_whole": pushed_whole, "survived": survived}


def teacher_fault(ctx: dict) -> dict:
    """Point 4 for OPD: every ``TEACHER_HANG_EVERY``-th teacher request never answers; the attempt timeout retries it."""
    name = "opd_teacher_hang"
    log = ctx["work"] / f"faults_{name}.jsonl"
    if name in ctx.get("reuse", ()):
        run = from_log(ctx["work"] / f"opd_thundersync_{name}", 2)
    else:
        log.unlink(missing_ok=True)
        env = {ENV: f"teacher_hang@every={TEACHER_HANG_EVERY}", LOG_ENV: str(log)}
        extra = ["thundersync.opd.teacher_timeout_s=5", "thundersync.opd.teacher_max_attempts=3"]
        run = live_run(ctx, name, "opd", extra, env)
    hangs = sum(f["fault"] == "teacher_hang" for f in read_log(log))
    retries = sum(int(m.get("thundersync/opd/teacher_retries", 0)) for m in run["per_step"].values())
    return {"run": dict(run, name=name), "hangs": hangs, "retries": retries,
            "survived": {"teacher_hang": run["ok"] and hangs > 0 and retries >= hangs}}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


CLEAR_ERRORS = ("could not be written", "learner worker died", "did not arrive within", "its agent loop failed",
                NODE_LOST)


def first_clear_error(log: str) -> str:
    """The run's own stop message (the rule line of a rule / why / fix error), or ''."""
    for line in log.splitlines():
        if any(phrase in line for phrase in CLEAR_ERRORS):
            return line.strip()[-300:]
    return ""


def losses(runs: list[dict]) -> tuple[int, int]:
    """(trajectories lost, half steps) over every run (module docstring, point 5)."""
    lost = half = 0
    for run in runs:
        algo = "opd" if run["name"].startswith("opd_") else "grpo"
        learned = learned_per_step(run["run_dir"], algo)
        per_step = PER_STEP if run["name"] != "recoverable" else modes.BATCH_PROMPTS * 4
        lost += sum(per_step - n for n in learned.values())
        half += sum(n < per_step for n in learned.values())
        if not run["ok"] and "weights" in run:  # a failed run pushed nothing past its last completed step
            pushed = [int(p.stem[9:]) for p in Path(run["weights"]).glob("weights_v*.pt")]
            done = max([*learned, min(pushed, default=0)])  # its first push is the checkpoint it resumed from
            half += sum(v > done for v in pushed)
    return lost, half


def node_loss_only(ctx: dict, base: dict, t0: float) -> dict:
    """``--only node_loss``: the uninterrupted one-node run and the node-loss chain (point 6), nothing else."""
    nodes = node_loss(ctx)
    lost, half = losses([base, *nodes["runs"]])
    final = weights(nodes["runs"][-1], STEPS)
    return {"faults_tried": len(nodes["survived"]), "faults_survived": sum(nodes["survived"].values()),
            "trajectories_lost": lost, "half_steps": half, "resume_bitwise": same_bits(final, weights(base, STEPS)),
            "deterministic": True, "survived": nodes["survived"], "checks": nodes["checks"],
            "restores": nodes["restores"], "lost_nodes": nodes["lost_nodes"],
            "leftover_processes": nodes["leftover_processes"],
            "errors": {r["name"]: first_clear_error(r["error"]) for r in nodes["runs"]},
            "steps": STEPS, "trajectories_per_step": PER_STEP, "seconds": round(time.time() - t0, 1)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the acceptance run: 3 steps per run (the only size so far)")
    ap.add_argument("--only", choices=["all", "node_loss"], default="all",
                    help="node_loss: only the node-loss faults (point 6), written to faults_node_loss.json")
    ap.add_argument("--work-dir", default="runs/faults")
    ap.add_argument("--reuse", default="", help="runs (comma-separated names) read back from their logs in --work-dir "
                    "instead of run again, e.g. uninterrupted,uninterrupted_again,recoverable")
    add_results_dir_argument(ap)
    args = ap.parse_args(argv)
    t0 = time.time()
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    inputs, rec = setup(work)
    ctx = {"work": work, "inputs": inputs, "rec": rec, "reuse": set(filter(None, args.reuse.split(",")))}
    base = replay_run("uninterrupted", ctx)
    if args.only == "node_loss":
        result = node_loss_only(ctx, base, t0)
        write_result("faults_node_loss", result, args.results_dir)
        return result
    again = replay_run("uninterrupted_again", ctx)
    chain = resume_chain(ctx)
    nodes = node_loss(ctx)
    rec_faults = recoverable(ctx)
    teacher = teacher_fault(ctx)
    sync = sync_resume(ctx)
    start, final = weights(base, 0), weights(base, STEPS)
    resumed = weights(chain["runs"][-1], STEPS)
    floor = rel_gap(weights(again, STEPS), final, start) if base["ok"] and again["ok"] else None
    gap = rel_gap(resumed, final, start) if resumed is not None and final is not None else None
    survived = {**chain["survived"], **nodes["survived"], **rec_faults["survived"], **teacher["survived"]}
    survived["resume"] = gap is not None and floor is not None and (gap == 0.0 or gap <= FLOOR_FACTOR * floor)
    lost, half = losses([base, again, *chain["runs"], *nodes["runs"], rec_faults["run"], teacher["run"]])
    node_bitwise = same_bits(weights(nodes["runs"][-1], STEPS), final)
    result = {
        "faults_tried": len(survived), "faults_survived": sum(survived.values()),
        "trajectories_lost": lost, "half_steps": half,
        "resume_bitwise": same_bits(resumed, final) and node_bitwise, "node_resume_bitwise": node_bitwise,
        "run_to_run_bitwise": same_bits(weights(again, STEPS), final), "deterministic": True,
        "resume_bitwise_sync": sync["bitwise"], "resume_restore_bitwise_sync": sync["restore_bitwise"],
        "sync_resumed_steps": sync["steps_resumed"],
        "resume_restore_bitwise": all(chain["restores"].values()) and all(nodes["restores"].values()),
        "resume_gap": gap, "resume_floor": floor,
        "resume_gap_over_floor": None if not (gap is not None and floor) else round(gap / floor, 3),
        "survived": survived, "checks": {**chain["checks"], **nodes["checks"]},
        "restores": {**chain["restores"], **nodes["restores"]}, "cluster_leftover_processes": nodes["leftover_processes"],
        "recoverable_fired": rec_faults["fired"], "nan_step_params_unchanged": rec_faults["nan_step_params_unchanged"],
        "push_retried_whole": rec_faults["push_retried_whole"],
        "teacher_hangs": teacher["hangs"], "teacher_retries": teacher["retries"],
        "errors": {r["name"]: first_clear_error(r["error"]) for r in [*chain["runs"], *nodes["runs"]]},
        "steps": STEPS, "trajectories_per_step": PER_STEP, "seconds": round(time.time() - t0, 1),
    }
    write_result("faults", result, args.results_dir)
    return result

if __name__ == "__main__":
    main()
