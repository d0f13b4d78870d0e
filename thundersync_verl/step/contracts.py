"""What the streamed step asks of a planner and of an algorithm, and the trainer of its algorithm: every member, stated once.

Why:
1. ``StreamedStep`` (``streamed_step.py``) drives every algorithm through two objects: a planner (which rows
   share a backward, where each goes, the barrier) and an algorithm (what "landed" means and how it reaches the
   planner). Each protocol below lists every member the step uses, so the step never probes with ``hasattr``
   and a new algorithm sees what it must provide.
2. ``PlannerDefaults`` and ``AlgorithmDefaults`` give the members most implementations leave at a neutral value
   (no verl estimator settings, no companion buckets, no free-slot planning, no metrics); an implementation
   inherits them and overrides what it does differently. ``tests/step/test_contracts_on_cpu.py`` checks that
   every planner and algorithm the trainer builds has every member.
3. One level up, ``TrainerAlgorithm`` is everything the trainer (``thundersync_trainer.py``) asks of the run's
   algorithm: its config rules, planner, per-step arrivals, worker and client setup, warm-up and after-step work.
   ``step/algorithm.py`` ``choose_algorithm`` picks the implementation once per run (GRPO, OPD or SAO), so the
   trainer never branches on the algorithm; ``TrainerAlgorithmDefaults`` holds GRPO's neutral hooks, which the
   others override. ``tests/step/test_algorithm_choice_on_cpu.py`` checks each has every member.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable


@runtime_checkable
class Planner(Protocol):
    """Turns arrivals into learner ops: ``StreamPlanner``, ``MiniBatchPlanner``, ``OPDTurnPlanner``, ``SAOStepPlanner``."""

    loss_agg_mode: str
    max_chunk_size: int
    verl_settings: dict  # verl estimator settings the learner re-checks against its own config ({}: none)
    independent_buckets: bool  # bucketed rows keep their KL/entropy part in a companion bucket (mini-batches)
    fills_free_slots: bool  # coalescing: next_ops(max_backwards=k) plans at most k backward calls (the free slots)
    eager_full_chunks: bool  # coalescing: a full chunk of ready rows is planned at once (else just in time only)
    held_count: int  # ready rows the last plan held back (the memory budget); read when fills_free_slots
    queued_folds: int  # folds planned but not sent; read when fills_free_slots

    @property
    def ready_count(self) -> int: ...  # arrivals whose backward is not planned yet

    def next_ops(self) -> list: ...

    def finalize(self) -> Any: ...  # the barrier: a FinalizeOp with the deferred normaliser

    def memory(self) -> dict: ...

    def metrics(self) -> dict: ...  # the planner's per-step figures ({}: none)


class PlannerDefaults:
    """The neutral value of each optional planner member."""

    verl_settings: dict = {}
    independent_buckets = False
    fills_free_slots = False
    eager_full_chunks = True
    held_count = 0
    queued_folds = 0

    def metrics(self) -> dict:
        return {}


@runtime_checkable
class Algorithm(Protocol):
    """One algorithm in the step: ``GRPOArrivals``, ``OPDArrivals``, ``SAOArrivals``."""

    planner: Planner

    def begin(self, ctx) -> Any: ...  # opens the batch; returns its turn source, or None (whole trajectories)

    def admit_turn(self, turn, tag, state, t_seen: float) -> None: ...

    def admit_trajectory(self, key: str, row: dict, state, t_seen: float) -> None: ...

    def admitted(self) -> None: ...  # after a poll's trajectories are admitted (SAO: the critic's backwards)

    def describe_op(self, op, state, t0: float) -> tuple[str, tuple, int]: ...

    def check_complete(self, state) -> None: ...

    def metrics(self, state, ctx) -> dict: ...

    def close(self) -> None: ...


class AlgorithmDefaults:
    """The neutral value of each optional algorithm member."""

    def admitted(self) -> None:
        return None

    def check_complete(self, state) -> None:
        return None

    def close(self) -> None:
        return None


@runtime_checkable
class TrainerAlgorithm(Protocol):
    """The run's algorithm as the trainer sees it (point 3): ``GRPOAlgorithm``, ``OPDAlgorithm``, ``SAOAlgorithm``."""

    name: str  # "grpo", "opd", "sao"
    record_algo: str  # the step records' ``algo`` field (and file name ``<record_algo>_thundersync.jsonl``)

    def validate_settings(self, config, ts) -> None: ...  # loss/estimator rules, before the rollout-pool rules

    def validate(self, config, ts) -> None: ...  # the algorithm's own streaming rules, after them

    def setup_workers(self, role_worker_mapping: dict) -> None: ...  # worker classes beyond the streaming actor

    def llm_client(self, client, trainer) -> Any: ...  # the client the agent loops generate (and score) with

    def planner(self, config, ts, bucket_bytes: Callable[[], int]) -> Planner: ...  # one for the run

    def arrivals(self, trainer) -> Algorithm: ...  # one per step: what "landed" means (``StreamedStep``)

    def values(self, trainer) -> Callable | None: ...  # the critic forward for arrivals (``StepContext.values``)

    def is_warmup_step(self, trainer) -> bool: ...  # this step replaces the streamed one with ``warmup_step``

    def warmup_step(self, trainer, metrics: dict, timing_raw: dict) -> Any: ...  # returns the batch

    def after_step(self, trainer, batch, metrics: dict, timing_raw: dict) -> Any: ...  # after verl's advantages


class TrainerAlgorithmDefaults:
    """The neutral value of each optional trainer-algorithm member: nothing to add to verl's setup or step."""

    def validate(self, config, ts) -> None:
        return None

    def setup_workers(self, role_worker_mapping: dict) -> None:
        return None

    def llm_client(self, client, trainer):
        return client

    def values(self, trainer) -> None:
        return None

    def is_warmup_step(self, trainer) -> bool:
        return False

    def warmup_step(self, trainer, metrics: dict, timing_raw: dict):
        raise TypeError(f"{type(self).__name__} has no warm-up step (is_warmup_step is always False)")

    def after_step(self, trainer, batch, metrics: dict, timing_raw: dict):
        return batch
