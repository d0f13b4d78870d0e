"""Stock ``main_ppo`` runs on a local multi-node Ray cluster (``thundersync_verl.run.cluster``), and where their actors ran.

Why:
1. A user runs the recipe on a running cluster by pointing the launcher at it (``RAY_ADDRESS``): verl's
   ``ray.init`` then connects and must not declare slots, so ``num_cpus`` / ``num_gpus`` are nulled and every
   node declares its own. The same ``main_ppo_runs.launch`` as the one-node runs does the launch.
2. Per-run environment (the replay server's weight folder, the fault plan) reaches worker processes on other
   nodes only through the job's ``runtime_env`` (the raylets were started before the run), so it is forwarded
   there as well as set for the driver.
3. Where each process ran is read from Ray's actor table (the GCS keeps finished actors), by node id, and named
   by the node's ``thundersync_<name>`` resource: the placement a test asserts is Ray's, not the config's.
"""

from __future__ import annotations

from pathlib import Path

from thundersync_harness import main_ppo_runs as runs
from thundersync_verl.run.cluster import LocalCluster

# the per-run variables a worker on another node must see (point 2)
FORWARDED = ("THUNDERSYNC_REPLAY_WEIGHTS_DIR", "THUNDERSYNC_FAULTS", "THUNDERSYNC_FAULTS_LOG", "VERL_FILE_LOGGER_PATH")
NO_LOCAL_SLOTS = ["ray_kwargs.ray_init.num_cpus=null", "ray_kwargs.ray_init.num_gpus=null"]
# which role an actor plays, by its Ray actor name and class (verl names worker-group actors by their prefix)
# "rollout": the standalone pool's slots; "rollout_server": every replica's server (a hybrid replica's, colocated with
# the learner, too: Sync generates there, Async parks it)
ROLES = {"rollout": ("rollout_standalone",), "rollout_server": ("replay_server_", "hf_cpu_server_"),
         "learner": ("WorkerDict",),
         "agent_loop": ("agent_loop_worker",), "driver": ("TaskRunner",), "transfer_queue": ("TransferQueue",)}


def cluster_env(work: Path) -> dict[str, str]:
    """The environment every node's raylet (and so every worker process) starts with: the CPU platform's."""
    from thundersync_verl.demo import run_env

    env = run_env(work, work / "cluster_metrics.jsonl")
    env.pop("VERL_FILE_LOGGER_PATH", None)  # the driver's, per run
    return env


def on_cluster(cluster: LocalCluster, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(overrides, driver env) that send a ``main_ppo`` launch to ``cluster`` with ``env`` forwarded (points 1-2)."""
    # quoted: a fault plan holds '=', ',' and ';', which Hydra's override grammar would parse
    forward = [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{v}'" for k, v in env.items() if k in FORWARDED]
    if any("'" in str(v) for k, v in env.items() if k in FORWARDED):
        raise ValueError(f"a forwarded variable ({', '.join(FORWARDED)}) may not hold a single quote")
    return [*NO_LOCAL_SLOTS, *forward], {**env, "RAY_ADDRESS": cluster.address}


def replayed(cluster: LocalCluster | None, work: Path, model: Path, recording: Path, name: str, mode: str,
             extra: list[str], *, steps: int = 1, env_extra: dict | None = None) -> tuple[list[dict], Path]:
    """``main_ppo_runs.replayed`` on ``cluster`` (None: on one node, Ray started by the run itself)."""
    env = {runs.WEIGHTS_ENV: str(work / f"weights_{name}"), **(env_extra or {})}
    if cluster is None:
        return runs.replayed(work, model, recording, name, mode, extra, steps=steps, env_extra=env)
    # the file logger runs in verl's TaskRunner actor, on whichever node Ray chose
    overrides, env = on_cluster(cluster, {**env, "VERL_FILE_LOGGER_PATH": str(work / name / "metrics.jsonl")})
    return runs.replayed(work, model, recording, name, mode, [*overrides, *extra], steps=steps, env_extra=env)


def actor_table(cluster: LocalCluster) -> list[dict]:
    """Every actor the cluster has run (alive or finished): name, class, state, node id."""
    return cluster.query("[{'name': a.get('Name', ''), 'class': a.get('ActorClassName', ''), 'state': a.get('State'), "
                         "'node': (a.get('Address') or {}).get('NodeID'), 'pid': a.get('Pid'), 'job': a.get('JobID')} "
                         "for a in state.actors().values()]", "the actor table", imports="; from ray._private import state")


def placement(cluster: LocalCluster) -> dict[str, list[str]]:
    """Role -> names of the nodes its actors ran on (point 3), for the cluster's latest job (the last run)."""
    names = {row["id"]: row["name"] for row in cluster.node_table()}
    actors = actor_table(cluster)
    latest = max((a["job"] for a in actors), key=lambda j: int.from_bytes(bytes.fromhex(j), "little"), default=None)
    found: dict[str, set[str]] = {role: set() for role in [*ROLES, "other"]}
    for actor in (a for a in actors if a["job"] == latest):
        text = f"{actor['name']} {actor['class']}"
        role = next((r for r, marks in ROLES.items() if any(m in text for m in marks)), "other")
        found[role].add(names.get(actor["node"], actor["node"]))
    return {role: sorted(nodes) for role, nodes in found.items()}
