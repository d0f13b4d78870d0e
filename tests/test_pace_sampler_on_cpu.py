"""PACE's replay buffer on verl's real ReplayBufferAsync logic, with an in-process TransferQueue stand-in.

What runs is verl's own ``ReplayBufferAsync`` code (metadata sync, eviction, selection, materialised
``KVBatchMeta``) with PACE's subclass on top; only the TransferQueue module verl's buffer calls
(``replay_buffer.tq``: kv_list, kv_clear, kv_batch_get) is replaced by a dictionary, since a real
TransferQueue needs a Ray cluster. Scores are hand-computed from core/pace.py's formulas.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import json

import pytest

from thundersync_verl.core.errors import StreamingConfigError
from thundersync_verl.pace import PaceReplayBufferAsync


class _TQ:
    """The TransferQueue calls verl's replay buffer makes, over plain dicts."""

    def __init__(self):
        self.tags: dict[str, dict] = {}
        self.values: dict[str, dict] = {}
        self.cleared: list[str] = []

    def kv_list(self, partition_id=None):
        return {"train": {k: dict(t) for k, t in self.tags.items()}}

    def kv_clear(self, keys, partition_id):
        for key in keys:
            self.tags.pop(key, None)
            self.values.pop(key, None)
        self.cleared += list(keys)

    def kv_batch_get(self, keys, partition_id, select_fields):
        return {f: [self.values[k][f] for k in keys] for f in select_fields}

    def add_group(self, uid: str, dispatch: int, turns: list[tuple[int, int]], n: int = 2, *, per_turn: bool = True):
        """A finished group of ``n`` trajectories, each with ``turns`` = [(generated tokens, version)]."""
        self.tags[uid] = {"is_prompt": True, "status": "finished", "global_steps": dispatch}
        versions = [v for _, v in turns]
        for i in range(n):
            key = f"{uid}_{i}_0"
            self.tags[key] = {"status": "success", "global_steps": dispatch, "min_global_steps": min(versions),
                              "max_global_steps": max(versions), "response_len": sum(t for t, _ in turns)}
            records = [{"gen_tokens": t, "min_version": v, "max_version": v} for t, v in turns]
            self.values[key] = {"extra_fields": {"thundersync_events": {"turns": records}} if per_turn else {}}


@pytest.fixture
def tq(monkeypatch):
    from verl.trainer.ppo.v1 import replay_buffer

    fake = _TQ()
    monkeypatch.setattr(replay_buffer, "tq", fake)
    return fake


def _buffer(refills: list, threshold=None, **pace):
    return PaceReplayBufferAsync(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=threshold,
                                 max_off_policy_strategy="drop", sampler_kwargs={"poll_interval": 0.001, "pace": pace},
                                 refill_fn=refills.append)


def _pool(tq: _TQ) -> None:
    """Six groups; first seen at learner version 5 (global_steps 6), their generation staleness G is:"""
    tq.add_group("g0", 6, [(10, 5)])  # 0
    tq.add_group("g1", 5, [(10, 4)])  # lag 1 -> 1
    tq.add_group("g2", 4, [(10, 3)])  # 2
    tq.add_group("g3", 1, [(10, 1)])  # 4
    tq.add_group("g4", 3, [(10, 2), (10, 5)])  # e = 3, max(0, 0.5 * 3) -> (30 + 15) / 20 = 2.25
    tq.add_group("g5", 2, [(10, 5)])  # 0: dispatched early, generated on fresh weights


def test_pace_rejects_the_worst_within_the_excess_and_refills_them(tq, tmp_path):
    _pool(tq)
    refills: list = []
    log = tmp_path / "pace.jsonl"
    buf = _buffer(refills, target_pool=1, gain=1.0, log_path=str(log))
    batch, metrics = buf.sample(global_steps=6, partition_id="train", batch_size=2)
    # pool 6, needed 2, target 1: excess 3, budget 3 -> g3 (4), g4 (2.25), g2 (2) rejected
    assert refills == [3]
    assert {"g3", "g4", "g2"} <= set(tq.cleared)
    assert not any(k.split("_")[0] in {"g2", "g3", "g4"} for k in tq.tags)  # evicted with their trajectories
    # verl then selects the oldest dispatched survivors: g5 (step 2), g1 (step 5)
    assert sorted({k.split("_")[0] for k in batch.keys}) == ["g1", "g5"]
    assert (metrics["pace/rejected"], metrics["pace/budget"], metrics["pace/pool"]) == (3, 3, 6)
    assert metrics["pace/rejected_share"] == pytest.approx(3 / 5)
    assert metrics["pace/per_turn_share"] == 1.0
    # selected trajectories' staleness (version 5 - max version): g5 -> 0, 0; g1 -> 1, 1
    assert [metrics[f"pace/staleness_hist/{k}"] for k in ("0", "1", "2", "3", "4plus")] == [2, 2, 0, 0, 0]
    line = json.loads(log.read_text().splitlines()[0])
    assert line["rejected"] == pytest.approx({"g3": 4.0, "g4": 2.25, "g2": 2.0})
    assert list(line["rejected"]) == ["g3", "g4", "g2"]


@pytest.mark.parametrize("every, second", [("step", 0), ("sample", 1)])
def test_the_budget_is_spent_once_per_step_unless_asked_per_sample(tq, every, second):
    _pool(tq)
    refills: list = []
    buf = _buffer(refills, target_pool=1, gain=1.0, decide_every=every)
    batch, first = buf.sample(global_steps=6, partition_id="train", batch_size=2)  # rejects g3, g4, g2 (above)
    tq.kv_clear(keys=batch.keys, partition_id="train")
    tq.add_group("g7", 6, [(10, 3)])  # S = 2, and the pool g0, g7 + 2 new ones exceeds 2 + 1 by 1
    tq.add_group("g8", 6, [(10, 5)])
    tq.add_group("g9", 6, [(10, 5)])
    _, again = buf.sample(global_steps=6, partition_id="train", batch_size=2)  # the same training step
    assert first["pace/rejected"] == 3 and again["pace/rejected"] == second
    assert refills == [3] + ([1] if second else [])


def test_gain_zero_observes_only_and_leaves_verls_selection(tq):
    _pool(tq)
    refills: list = []
    batch, metrics = _buffer(refills, gain=0.0).sample(global_steps=6, partition_id="train", batch_size=2)
    assert refills == [] and metrics["pace/rejected"] == 0 and metrics["pace/budget"] == 0
    assert sorted({k.split("_")[0] for k in batch.keys}) == ["g3", "g5"]  # verl: oldest dispatch first


def test_waiting_staleness_grows_while_a_group_sits_in_the_pool(tq, tmp_path):
    _pool(tq)
    refills: list = []
    log = tmp_path / "pace.jsonl"
    buf = _buffer(refills, gain=0.0, log_path=str(log))
    batch, _ = buf.sample(global_steps=6, partition_id="train", batch_size=2)  # takes g3, g5; the rest landed at v5
    tq.kv_clear(keys=batch.keys, partition_id="train")  # the trainer clears what it trained
    tq.add_group("g6", 7, [(10, 7)])  # fresh, first seen at learner version 7
    buf.pace = type(buf.pace)(gain=10.0)  # now reject every stale group (budget = pool - needed)
    batch, metrics = buf.sample(global_steps=8, partition_id="train", batch_size=1)
    # at v7 the old groups (landed at v5) waited W = 2 on top of G accrued by v5 (as in the first sample):
    # g0 0 + 2, g1 1 + 2, g2 2 + 2, g4 2.25 + 2; g6 landed at v7 on v7 weights: 0 (never rejected)
    line = json.loads(log.read_text().splitlines()[-1])
    assert line["rejected"] == pytest.approx({"g4": 4.25, "g2": 4.0, "g1": 3.0, "g0": 2.0})
    assert list(line["rejected"]) == ["g4", "g2", "g1", "g0"]
    assert {k.split("_")[0] for k in batch.keys} == {"g6"} and refills == [4]
    assert metrics["pace/rejected_total"] == 4 and metrics["pace/sampled_total"] == 3


def test_without_per_turn_versions_the_span_halves_are_used(tq, tmp_path):
    tq.add_group("a", 1, [(5, 1), (5, 5)], per_turn=False)  # tags say min 1, max 5, 10 tokens
    tq.add_group("b", 5, [(10, 5)], per_turn=False)
    log = tmp_path / "pace.jsonl"
    refills: list = []
    _, metrics = _buffer(refills, gain=0.0, log_path=str(log)).sample(global_steps=6, partition_id="train", batch_size=2)
    # a: halves 5 @ v1, 5 @ v5 -> e = 4, max(0, 2) -> (20 + 10) / 10 = 3
    assert json.loads(log.read_text())["selected"] == pytest.approx({"a": 3.0, "b": 0.0})
    assert metrics["pace/per_turn_share"] == 0.0


def test_verls_drop_threshold_still_evicts_first(tq):
    _pool(tq)
    refills: list = []
    # span = 6 - dispatch + 1 > 3 drops g3 (6), g5 (5), g4 (4), g2 (3 kept)
    batch, metrics = _buffer(refills, threshold=3, gain=0.0).sample(global_steps=6, partition_id="train", batch_size=2)
    assert metrics["training/off_policy/evicted_samples"] == 3 and refills == [3]
    assert metrics["pace/pool"] == 3  # PACE saw only what verl kept
    assert sorted({k.split("_")[0] for k in batch.keys}) == ["g1", "g2"]


def test_config_errors_name_the_rule(tq):
    with pytest.raises(StreamingConfigError, match="unknown PACE option"):
        _buffer([], gian=1.0)
    with pytest.raises(StreamingConfigError, match="decide_every"):
        _buffer([], decide_every="batch")
    with pytest.raises(StreamingConfigError, match="regenerated"):
        PaceReplayBufferAsync(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=None,
                              max_off_policy_strategy="drop", sampler_kwargs={"pace": {"gain": 1.0}}, refill_fn=None)


def test_verl_loads_the_sampler_from_its_config_keys():
    from verl.utils.import_utils import load_extern_type

    assert load_extern_type("pkg://thundersync_verl.pace", "PaceReplayBufferAsync") is PaceReplayBufferAsync


@pytest.mark.parametrize("policy", ["fully_async", "fully_async_drop", "pace"])
def test_the_benchmark_overrides_build_the_pace_buffer_through_verls_keys(policy, tmp_path):
    """benchmarks/pace.py's overrides on the cpu_tiny recipe select this buffer with the settings asked for."""
    import importlib.util
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from verl.utils.import_utils import load_extern_type

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("pace_bench", root / "benchmarks" / "pace.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    mode, extra = bench.policy_overrides(policy, tmp_path / "decisions.jsonl")
    launcher = ["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z", f"mode={mode}"]
    with initialize_config_dir(config_dir=str(root / "recipes" / "cpu_tiny"), version_base=None):
        cfg = compose(config_name="grpo", overrides=launcher + bench.modes.workload(0.2, mode) + extra)
    sampler = cfg.trainer.v1.sampler
    cls = load_extern_type(sampler.custom_sampler.path, sampler.custom_sampler.name)
    assert cls is PaceReplayBufferAsync and cfg.trainer.v1.trainer_mode == "separate_async"
    buf = cls(trainer_mode="separate_async", trainer_config=cfg.trainer.v1.separate_async,
              max_off_policy_threshold=sampler.max_off_policy_threshold,
              max_off_policy_strategy=sampler.max_off_policy_strategy, sampler_kwargs=sampler.sampler_kwargs,
              refill_fn=[].append)
    assert buf.max_off_policy_threshold == (bench.DROP_THRESHOLD if policy == "fully_async_drop" else None)
    assert buf.pace.gain == (bench.PACE_OPTIONS["gain"] if policy == "pace" else 0.0)
    assert buf.log_path == str(tmp_path / "decisions.jsonl") and buf.decide_every == "step"
    assert cfg.trainer.v1.separate_async.num_warmup_batches == 2
