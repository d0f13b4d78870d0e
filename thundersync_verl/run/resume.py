"""Checkpoints in thundersync mode: taken only between batches, with what verl's own checkpoint lacks.

Why:
1. A streamed step keeps state on the learner between calls (an open batch, its reward buckets,
   gradient accumulated in ``.grad``). A checkpoint taken inside a step would save half a batch's
   gradient as if it were none, or lose it, so ``check_step_boundary`` asks every learner rank
   (``stream_memory``) and refuses to save while any batch or bucket is open.
2. verl's checkpoint already holds the model, the optimizer, the LR scheduler and each rank's RNG
   state (the FSDP checkpoint manager's extra state), the dataloader position (``data.pt``) and,
   outside sync mode, the TransferQueue (prompts in flight are re-issued on resume). What it lacks
   is ThunderSync's own run state: the counters its metrics report across a restart (steps skipped
   for a non-finite gradient, steps streamed) and the proof that the save was taken at a boundary.
   They go to ``thundersync_state.json`` in the step's folder, written atomically (temp + rename).
3. A save that fails (a full disk, a read-only folder) stops the run with a rule / why / fix message
   naming the step and the checkpoint a resume will use; verl writes its "latest" tracker only after
   everything else, so a half-written folder is never resumed from.
4. On a multi-node cluster a lost node shows up first as a dead actor, a failed agent loop, or (an agent
   loop that died with it reports nothing) the driver's node watch while it waits (``streamed_step.py``
   point 6); the stop names the node that left (Ray's node table against the nodes alive when the run started), so the fix is
   "restart that node", not a hunt through worker logs.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass

from thundersync_verl.core import StreamingStateError
from thundersync_verl.core.errors import rule_message
from thundersync_verl.run.step_record import first_rank

logger = logging.getLogger(__name__)
STATE_FILE = "thundersync_state.json"


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the run stops so that it can resume from the last good one."""


@dataclass
class RunState:
    """ThunderSync's counters across restarts (point 2)."""

    steps_streamed: int = 0
    steps_skipped_nonfinite: int = 0  # finalize_step saw a non-finite gradient norm: verl skipped the update
    resumes: int = 0
    weight_push_retries: int = 0  # weight pushes repeated after a failure (thundersync.weight_push_retries)
    tail: dict | None = None  # thundersync.tail: the prompt queue (step/tail_rounds.py state_dict)

    def count_step(self, worker_out) -> bool:
        """Count one finished step; True when the learner skipped its update (non-finite gradient norm)."""
        first = first_rank(worker_out)
        self.steps_streamed += 1
        skipped = not math.isfinite(float(first.get("grad_norm", 0.0)))
        self.steps_skipped_nonfinite += int(skipped)
        return skipped

    def metrics(self) -> dict:
        return {"thundersync/steps_skipped_nonfinite": self.steps_skipped_nonfinite, "thundersync/resumes": self.resumes,
                "thundersync/weight_push_retries": self.weight_push_retries}


def check_step_boundary(worker_group, step: int) -> dict:
    """Refuse a checkpoint while any learner rank holds an open batch or bucket; returns what was checked."""
    ranks = worker_group.stream_memory()
    ranks = ranks if isinstance(ranks, list) else [ranks]
    open_batches = sum(bool(m.get("stream/batch_open")) for m in ranks)
    open_buckets = sorted({k for m in ranks for k in m.get("stream/open_buckets", [])})
    if open_batches or open_buckets:
        raise StreamingStateError(rule_message(
            f"checkpoint of step {step} refused: {open_batches} learner rank(s) hold an open streamed batch"
            + (f" with buckets {open_buckets[:4]}" if open_buckets else ""),
            "a checkpoint inside a step would save part of a batch's gradient as if the step had not begun",
            "save only after finalize_step (verl's fit() saves after the step; a custom loop must do the same)"))
    return {"ranks": len(ranks), "open_batches": 0, "open_buckets": 0}


def state_path(config, step: int) -> str:
    return os.path.join(str(config.trainer.default_local_dir), f"global_step_{int(step)}", STATE_FILE)


def loaded_state_path(config, step: int) -> str:
    """The state file of the checkpoint verl resumed from: ``trainer.resume_from_path`` with
    ``resume_mode=resume_path`` (a folder outside ``default_local_dir`` too), else the step's folder there."""
    trainer = config.trainer
    path = trainer.get("resume_from_path") if trainer.get("resume_mode") == "resume_path" else None
    return os.path.join(str(path), STATE_FILE) if path else state_path(config, step)


def save_state(path: str, state: RunState, **extra) -> None:
    """``state`` and ``extra`` as JSON at ``path``, atomically."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({**asdict(state), **extra}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_state(path: str) -> RunState | None:
    """The saved counters (None when the folder has none: a checkpoint written by another trainer mode)."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    known = RunState.__dataclass_fields__
    return RunState(**{k: v for k, v in saved.items() if k in known})


def save_failed(step: int, exc: BaseException, config) -> CheckpointSaveError:
    """The clear stop for a failed save (point 3)."""
    folder = str(config.trainer.default_local_dir)
    return CheckpointSaveError(rule_message(
        f"the checkpoint of step {step} could not be written to {folder}: {type(exc).__name__}: {exc}",
        "a run that trains on without its checkpoints cannot be resumed from this step",
        f"free space or point trainer.default_local_dir at a writable disk, then rerun with "
        f"trainer.resume_mode=auto: it resumes from the last complete checkpoint "
        f"({os.path.join(folder, 'latest_checkpointed_iteration.txt')}); step {step} is trained again"))


def learner_lost(step: int, exc: BaseException, config) -> RuntimeError:
    """The clear stop when a learner worker dies inside a streamed step."""
    return RuntimeError(rule_message(
        f"a learner worker died during step {step} ({type(exc).__name__}); the step's optimizer update was NOT taken",
        "the batch gradient lived in that worker's memory, so the partial batch cannot be finished or stepped",
        f"rerun with trainer.resume_mode=auto (trainer.save_freq>0): it resumes from the last checkpoint in "
        f"{config.trainer.default_local_dir} and trains step {step} again from its prompts"))


NODE_LOSS_WAIT_S = 40.0  # Ray's head declares a silent node dead after its health checks fail (~15-30 s)


def alive_nodes() -> dict[str, str]:
    """Node id -> a description (address, the slots and custom resources it declared) of every alive Ray node."""
    import ray

    def describe(node: dict) -> str:
        res = node.get("Resources", {})
        named = sorted(k for k in res if not k.startswith("node:") and k not in ("CPU", "memory", "object_store_memory"))
        return f"{node['NodeID'][:12]} at {node.get('NodeManagerAddress', '?')} ({', '.join(named) or 'no slots'})"

    return {n["NodeID"]: describe(n) for n in ray.nodes() if n.get("Alive")}


def lost_nodes(at_start: dict[str, str], wait_s: float = 0.0) -> list[str]:
    """Descriptions of the nodes of ``at_start`` that are no longer alive, waiting up to ``wait_s`` for the head to
    notice (a failure that looks like a lost node: a dead actor, a failed agent loop)."""
    import time

    deadline = time.time() + wait_s
    while True:
        try:
            alive = alive_nodes()
        except Exception:  # the head itself is gone: nothing more can be said here
            return []
        lost = [desc for node, desc in at_start.items() if node not in alive]
        if lost or time.time() >= deadline:
            return lost
        time.sleep(1.0)


def node_lost(step: int, lost: list[str], exc: BaseException, config) -> RuntimeError:
    """The clear stop when a node of the Ray cluster left during a streamed step (point 4)."""
    return RuntimeError(rule_message(
        f"Ray node(s) {'; '.join(lost)} left the cluster during step {step} ({type(exc).__name__}); the step's "
        "optimizer update was NOT taken",
        "the processes on that node (learner ranks, rollout replicas, agent loops) are gone with their state, so the "
        "batch cannot be finished; trajectories already learned belong to completed steps",
        f"restart the node (`ray start --address=<head>` with the same resources) or replace it, then rerun with "
        f"trainer.resume_mode=auto (trainer.save_freq>0): it resumes from the last checkpoint in "
        f"{config.trainer.default_local_dir} and trains step {step} again from its prompts"))


def push_failed(step: int, attempts: int, exc: BaseException, config) -> RuntimeError:
    """The clear stop when every attempt to push step ``step``'s weights failed."""
    return RuntimeError(rule_message(
        f"the weights of step {step} could not be pushed to the rollout in {attempts} attempt(s): "
        f"{type(exc).__name__}: {exc}",
        "the next batch must be generated by these weights (staleness 0); the rollout still holds the previous "
        "complete version, never a mix",
        f"check the rollout replicas and the checkpoint engine, raise thundersync.weight_push_retries, then rerun "
        f"with trainer.resume_mode=auto (trainer.save_freq>0) from the last checkpoint in "
        f"{config.trainer.default_local_dir}"))
