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
import torch

from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError
from thundersync_verl.algos.pace.pace_sampler import PaceReplayBufferAsync


class _TQ:
    """The TransferQueue calls verl's replay buffer makes, over plain dicts."""

    def __init__(self):
        self.tags: dict[str, dict] = {}
        self.values: dict[str, dict] = {}
        self.cleared: list[str] = []
        self.reads: list[tuple[list[str], list[str]]] = []  # (keys, select_fields) of every kv_batch_get

    def kv_list(self, partition_id=None):
        return {"train": {k: dict(t) for k, t in self.tags.items()}}

    def kv_clear(self, keys, partition_id):
        for key in keys:
            self.tags.pop(key, None)
            self.values.pop(key, None)
        self.cleared += list(keys)

    def kv_batch_get(self, keys, partition_id, select_fields):
        if list(select_fields) == ["responses"]:  # the CPU platform's batch-order read (patches point 10), not PACE's
            return {"responses": [torch.tensor([int(k.rsplit("_", 2)[1])]) for k in keys]}
        self.reads.append((list(keys), list(select_fields)))
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


def test_measured_drift_is_refused_when_the_rollout_samples_at_another_temperature(tq):
    """The servers score at temperature 1: at another rollout temperature the drift would compare other distributions."""
    from types import SimpleNamespace

    class Trainer:  # what verl hands the sampler as refill_fn: the trainer's bound method
        def __init__(self, temperature):
            self.config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(temperature=temperature)))

        def _add_prompts_to_generate(self, n):
            return None

    def build(temperature, scorer):
        return PaceReplayBufferAsync(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=None,
                                     max_off_policy_strategy="drop", sampler_kwargs={"pace": {"scorer": scorer}},
                                     refill_fn=Trainer(temperature)._add_prompts_to_generate)

    with pytest.raises(StreamingConfigError, match="temperature=0.7"):
        build(0.7, "rollout_server")
    assert build(1.0, "rollout_server").scorer_kind == "rollout_server"
    assert build(0.7, "none").scorer_kind == "none"  # the count proxy reads no log-probs


def test_verl_loads_the_sampler_from_its_config_keys():
    from verl.utils.import_utils import load_extern_type

    assert load_extern_type("pkg://thundersync_verl.algos.pace.pace_sampler", "PaceReplayBufferAsync") is PaceReplayBufferAsync


@pytest.mark.parametrize("policy", ["fully_async", "fully_async_drop", "pace", "pace_measured", "pace_rescored"])
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
    assert buf.pace.gain == (bench.PACE_OPTIONS["gain"] if policy.startswith("pace") else 0.0)
    assert buf.scorer_kind == ("rollout_server" if policy in ("pace_measured", "pace_rescored") else "none")
    assert buf.rescore == ("decision" if policy == "pace_rescored" else "landing")
    assert buf.log_path == str(tmp_path / "decisions.jsonl") and buf.decide_every == "step"
    assert cfg.trainer.v1.separate_async.num_warmup_batches == 2


# -- measured drift: trajectories of the real tiny model, re-scored by the real hf_cpu server -----------------
@pytest.fixture(scope="module")
def server():
    """The project's hf_cpu rollout server (in this process) on the tiny student model, base weights at version 0."""
    from types import SimpleNamespace

    from thundersync_verl.backends.cpu.rollout import HFCpuServer
    from thundersync_verl.models import ensure_tiny_models

    path = ensure_tiny_models(variants=("student",), progress=False)["student"]
    config = SimpleNamespace(dtype="float32", max_model_len=256, prompt_length=48, response_length=64, engine_kwargs={})
    srv = HFCpuServer(config, SimpleNamespace(local_path=str(path)), None, 0)
    srv.base = {n: p.detach().clone() for n, p in srv.engine.model.named_parameters()}
    return srv


def _load(server, version: int, noise: float = 0.0, seed: int = 0) -> None:
    """Install the base weights plus ``noise`` x N(0, 1) as ``version`` (the checkpoint engine's call)."""
    import asyncio

    import torch

    gen = torch.Generator().manual_seed(seed)
    named = [(n, t + noise * torch.randn(t.shape, generator=gen)) for n, t in server.base.items()]
    asyncio.run(server.update_weights(named, global_steps=version))


def _prompt(server) -> list[int]:
    return server.engine.tokenizer.encode("<|im_start|>user\nCompute `12*3-5`.<|im_end|>\n<|im_start|>assistant\n")


def _generate(server, n: int, seed: int) -> list:
    import asyncio

    async def run():
        params = {"max_tokens": 10, "temperature": 1.0, "ignore_eos": True}
        return await asyncio.gather(*[server.generate(_prompt(server), {**params, "seed": seed + i}, request_id=f"r{seed}{i}")
                                      for i in range(n)])

    return asyncio.run(run())


def _scorer(server):
    from thundersync_verl.algos.pace.pace_scorer import InProcessServerEndpoint, RolloutServerScorer

    return RolloutServerScorer([InProcessServerEndpoint(server)])


def test_the_scorer_returns_the_servers_log_probs_of_each_response_token(server):
    import torch

    _load(server, 0)
    outs = _generate(server, 2, seed=11)
    prompt = _prompt(server)
    current, version = _scorer(server).score([(prompt, o.token_ids) for o in outs])
    assert version == 0
    for out, lp in zip(outs, current):
        # the same weights that generated them: the rollout's own log-probs back, token by token
        assert lp.shape == (len(out.token_ids),)
        assert (lp - torch.tensor(out.log_probs, dtype=torch.float64)).abs().max() < 1e-4
        # and an independent causal forward agrees (no off-by-one between prompt rows and response tokens)
        ids = torch.tensor([prompt + out.token_ids])  # [1, P + R]
        with torch.no_grad():
            logits = server.engine.model(input_ids=ids).logits[0, len(prompt) - 1:-1]  # [R, V]
        direct = torch.log_softmax(logits.double(), -1).gather(-1, ids[0, len(prompt):, None])[:, 0]  # [R]
        assert (lp - direct).abs().max() < 1e-4
    _load(server, 1, noise=0.05)  # the policy moved: the same tokens now score differently
    moved, version = _scorer(server).score([(prompt, o.token_ids) for o in outs])
    assert version == 1
    gaps = [(m - torch.tensor(o.log_probs, dtype=torch.float64)).abs().mean().item() for m, o in zip(moved, outs)]
    assert min(gaps) > 1e-2


def test_a_parked_server_is_left_out_and_the_newest_answering_one_scores(server):
    """A hybrid replica lent back to the learner parks requests (verl aborts it with reject_request)."""
    from types import SimpleNamespace

    from thundersync_verl.backends.cpu.rollout import HFCpuServer
    from thundersync_verl.algos.pace.pace_scorer import InProcessServerEndpoint, RolloutServerScorer

    config = SimpleNamespace(dtype="float32", max_model_len=256, prompt_length=48, response_length=64, engine_kwargs={})
    hybrid = HFCpuServer(config, SimpleNamespace(local_path=server.engine.model.name_or_path), None, 1)  # version 0
    _load(server, 7)
    rows = [(_prompt(server), [5, 6, 7])]
    endpoints = [InProcessServerEndpoint(hybrid, "hybrid"), InProcessServerEndpoint(server, "standalone")]
    scorer = RolloutServerScorer(endpoints, probe_timeout_s=0.5)
    assert scorer.score(rows)[1] == 7 and scorer.parked == set()  # both answer: the newer one scores
    hybrid.engine.abort_all()  # parked until resumed
    scorer = RolloutServerScorer(endpoints, probe_timeout_s=0.5)
    assert scorer.score(rows)[1] == 7 and scorer.parked == {"hybrid"}
    assert scorer.score(rows)[1] == 7  # and it is not probed again
    server.engine.abort_all()
    with pytest.raises(StreamingInputError, match="no rollout server answered"):
        RolloutServerScorer(endpoints, probe_timeout_s=0.5).score(rows)
    server.engine.resume()


def _add_generated_group(tq: _TQ, uid: str, dispatch: int, outs, prompt: list[int], version: int, tool_tokens: int = 0):
    """A finished group from real generations, stored with the fields verl's agent loop writes."""
    import torch

    tq.tags[uid] = {"is_prompt": True, "status": "finished", "global_steps": dispatch}
    for i, out in enumerate(outs):
        key = f"{uid}_{i}_0"
        n = len(out.token_ids)
        obs = list(range(5, 5 + tool_tokens))  # a tool observation after the turn: not generated by the policy
        tq.tags[key] = {"status": "success", "global_steps": dispatch, "min_global_steps": version,
                        "max_global_steps": version, "response_len": n + tool_tokens}
        tq.values[key] = {
            "extra_fields": {"thundersync_events": {"turns": [{"gen_tokens": n, "min_version": version,
                                                              "max_version": version}]}},
            "prompts": torch.tensor(prompt), "responses": torch.tensor(out.token_ids + obs),
            "response_mask": torch.tensor([1] * n + [0] * tool_tokens),
            "rollout_log_probs": torch.tensor(list(out.log_probs) + [0.0] * tool_tokens),
        }


def _measured_pool(tq: _TQ, server) -> None:
    """At learner version 5: "near" made 3 versions ago by weights close to today's, "far" 1 version ago by
    distant ones, "fresh" by today's (with tool tokens, whose re-scored log-probs must not count)."""
    prompt = _prompt(server)
    _load(server, 2, noise=0.002, seed=1)
    _add_generated_group(tq, "near", 2, _generate(server, 2, seed=21), prompt, 2)
    _load(server, 4, noise=0.08, seed=2)
    _add_generated_group(tq, "far", 4, _generate(server, 2, seed=31), prompt, 4)
    _load(server, 5)
    _add_generated_group(tq, "fresh", 5, _generate(server, 2, seed=41), prompt, 5, tool_tokens=3)
    _add_generated_group(tq, "other", 6, _generate(server, 2, seed=51), prompt, 5)  # pool 4, batch 2, target 1: budget 1


def test_measured_drift_ranks_by_how_far_the_policy_moved_not_by_version_count(tq, server, tmp_path):
    _measured_pool(tq, server)
    proxy_log, measured_log = tmp_path / "proxy.jsonl", tmp_path / "measured.jsonl"
    _, proxy_metrics = _buffer([], target_pool=1, gain=1.0, log_path=str(proxy_log)).sample(6, "train", 2)
    proxy = json.loads(proxy_log.read_text())
    # proxy: near (lag 3) is the worst and goes
    assert list(proxy["rejected"]) == ["near"] and "pace/scored" not in proxy_metrics

    tq.tags, tq.values, tq.cleared, tq.reads = {}, {}, [], []
    _measured_pool(tq, server)
    refills: list = []
    buf = _buffer(refills, target_pool=1, gain=1.0, log_path=str(measured_log), scorer="rollout_server")
    buf.scorer = _scorer(server)  # the servers of a Ray job are found by name; here the one in this process
    _, metrics = buf.sample(6, "train", 2)
    line = json.loads(measured_log.read_text())
    # measured: far's tokens moved most under today's weights, so far goes, although only 1 version old
    assert list(line["rejected"]) == ["far"] and refills == [1]
    scores = {**line["rejected"], **line["selected"]}
    assert scores["far"] > 1.0  # above the mean nats-per-version of the measured lagged tokens
    assert scores.get("fresh", 0.0) < 1e-3  # today's weights and its tool tokens left out: ~0
    assert metrics["pace/scored"] == 8 and metrics["pace/scored_version"] == 5
    assert metrics["pace/nats_per_version"] > 0 and metrics["pace/scorer_s"] > 0
    # each newly landed trajectory is read from the TransferQueue once: per-turn versions and scored tensors together
    assert len(tq.reads) == 1
    keys, fields = tq.reads[0]
    assert sorted(keys) == sorted(f"{g}_{i}_0" for g in ("near", "far", "fresh", "other") for i in range(2))
    assert fields == ["extra_fields", "prompts", "responses", "response_mask", "rollout_log_probs"]


def test_an_unknown_scorer_is_refused(tq):
    with pytest.raises(StreamingConfigError, match="pace.scorer"):
        _buffer([], scorer="learner")


def test_stored_fields_are_read_back_per_trajectory_from_jagged_regular_and_non_tensor_columns(monkeypatch):
    """verl's agent loop stores variable-length fields; TransferQueue returns them jagged (or stacked when equal),
    and ``extra_fields`` as a stack of non-tensor values: all of them come back per trajectory from one read."""
    import torch
    from tensordict import NonTensorData, NonTensorStack
    from verl.trainer.ppo.v1 import replay_buffer

    from thundersync_verl.algos.pace.pace_sampler import _read_stored

    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    columns = {"prompts": torch.nested.as_nested_tensor(prompts, layout=torch.jagged),
               "response_mask": torch.tensor([[1, 0], [1, 1]]),
               "extra_fields": NonTensorStack(NonTensorData({"turns": [1]}), NonTensorData({}))}
    calls = []

    def kv_batch_get(keys, partition_id, select_fields):
        calls.append(list(select_fields))
        return {f: columns[f] for f in select_fields}

    monkeypatch.setattr(replay_buffer, "tq", type("TQ", (), {"kv_batch_get": staticmethod(kv_batch_get)}))
    rows = _read_stored(["a_0_0", "b_0_0"], "train", ["extra_fields"], ["prompts", "response_mask"])
    assert calls == [["extra_fields", "prompts", "response_mask"]]
    assert [r["extra_fields"] for r in rows] == [{"turns": [1]}, {}]
    assert [r["prompts"].tolist() for r in rows] == [[1, 2, 3], [4, 5]]
    assert [r["response_mask"].tolist() for r in rows] == [[1, 0], [1, 1]]


def test_rescore_at_each_decision_measures_the_drift_while_waiting(tq, server, tmp_path):
    _measured_pool(tq, server)
    log = tmp_path / "decisions.jsonl"
    buf = _buffer([], gain=0.0, waiting_weight=0.0, log_path=str(log), scorer="rollout_server", rescore="decision")
    buf.scorer = _scorer(server)
    batch, first = buf.sample(6, "train", 1)  # learner version 5 = the server's: fresh scores 0
    tq.kv_clear(keys=batch.keys, partition_id="train")
    _load(server, 6, noise=0.05, seed=9)  # the next version moved the policy
    _, second = buf.sample(7, "train", 1)
    # verl took the oldest group (near) first; the 6 trajectories of far, fresh, other are re-scored at version 6
    assert first["pace/scored"] == 8 and second["pace/scored"] == 6 and second["pace/scored_version"] == 6
    # one read per decision: the landing one with the per-turn versions, the re-scoring one with the tensors only
    assert [(len(keys), fields[0]) for keys, fields in tq.reads] == [(8, "extra_fields"), (6, "prompts")]
    fresh = [buf._segments[f"fresh_{i}_0"][0] for i in range(2)]
    assert all(seg.drift > 1e-3 for segs in fresh for seg in segs)  # generated at 5, waited one version: drifted
    with pytest.raises(StreamingConfigError, match="pace.rescore"):
        _buffer([], rescore="always")


def test_the_benchmark_measures_the_landing_latency_from_the_pool_the_sampler_counted(tmp_path):
    """benchmarks/pace.py's ``pool_landing_s``: groups enter the pool h after their last trajectory ends; the
    counts logged at each sample (less the groups already taken) give h back, and the trace then carries it."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("pace_bench", root / "benchmarks" / "pace.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    h, ends = 0.4, {"a": 1.0, "b": 1.5, "c": 2.0, "d": 3.0}
    traj = tmp_path / "trajectories.jsonl"
    traj.write_text("".join(json.dumps({"uid": u, "t_done": t - 0.1 * i}) + "\n" for u, t in ends.items() for i in range(2)))
    samples = [(1.39, []), (1.41, ["a"]), (1.89, []), (1.91, ["b"]), (3.5, ["c", "d"])]  # pin h within 0.01 s
    decisions, taken = [], set()
    for t, selected in samples:
        pool = sum(1 for u, e in ends.items() if e + h <= t and u not in taken)
        decisions.append({"t": t, "pool": pool, "selected": dict.fromkeys(selected, 0.0), "rejected": {}})
        taken |= set(selected)
    assert bench.pool_landing_s({"traj_path": traj, "decisions": decisions}) == pytest.approx(h, abs=0.011)
    assert bench.pool_landing_s({"traj_path": traj, "decisions": []}) is None
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"kind": "trajectory", "t_done": 5.0, "t_reward": 5.0}) + "\n"
                     + json.dumps({"kind": "step", "t_end": 6.0}) + "\n")
    bench.set_trace_landing(trace, 0.65)
    rows = [json.loads(x) for x in trace.read_text().splitlines()]
    assert rows[0]["t_reward"] == pytest.approx(5.65) and rows[1] == {"kind": "step", "t_end": 6.0}
