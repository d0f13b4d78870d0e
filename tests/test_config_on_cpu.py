"""``ThunderSyncConfig``: every ``thundersync.*`` key is typed and ranged, and its refusals name the key.

The lists of keys below are checked against the dataclass fields, so a new key without a bad-value
case fails here. The shipped recipes are composed through hydra's compose API, in every mode.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from thundersync_verl.config import GRANULARITIES, MODES, EnvConfig, OPDConfig, TailConfig, ThunderSyncConfig
from thundersync_verl.core import StreamingConfigError
from thundersync_verl.envs.latency import LatencyModel

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
RECIPE_MODES = sorted(p.stem for p in (RECIPES / "cpu_tiny" / "mode").glob("*.yaml"))
LATENCY_BAD = {"kind": "gamma", "median_s": -0.1, "sigma": -1.0, "alpha": 0.0, "tail_prob": 1.5, "tail_scale": -0.5,
               "max_s": -4.0, "scale": -1.0, "seed": 1.5}
BAD = {  # key -> a value it must refuse
    "mode": "sometimes", "chunk_size": 0, "learner_forward": "twice", "poll_s": 0.0, "pipeline_depth": 1.5,
    "coalesce": "yes", "call_efficiency": 1.0, "trajectory_timeout_s": -1.0, "weight_push_retries": -1, "run_dir": "", "memory_budget_bytes": -1,
    "bucket_device": "gpu", "deterministic": "always", "stop_file": "", "timeline_every": -1, "reward_in_agent_loop": "maybe",
    "env": 3, "env.max_tool_turns": -1, "env.tool_timeout_s": 0, "env.retry_prob": 1.2, "env.trace_path": 7,
    "env.tool_latency": "fast", "env.verifier_latency": None,
    **{f"env.tool_latency.{k}": v for k, v in LATENCY_BAD.items()},
    **{f"env.verifier_latency.{k}": v for k, v in LATENCY_BAD.items()},
    "opd": [1], "opd.granularity": "group", "opd.teacher_calls": "prefix", "opd.teacher_max_attempts": 0, "opd.teacher_timeout_s": 0.0,
    "opd.teacher_backoff_s": -0.5,
    "tail": "on", "tail.eta": 0.8, "tail.max_deferrals": -1, "tail.rounds": "sometimes",
}
MORE_BAD = [  # other values a key must refuse: wrong types, non-integral, non-finite
    ("chunk_size", "2.5"), ("chunk_size", True), ("chunk_size", 2.5), ("pipeline_depth", "two"), ("poll_s", "soon"),
    ("poll_s", float("inf")), ("coalesce", 1), ("call_efficiency", -0.1), ("memory_budget_bytes", 1e9 + 0.5), ("trajectory_timeout_s", None),
    ("env.retry_prob", float("nan")), ("opd.teacher_max_attempts", None), ("opd.teacher_backoff_s", None),
    ("timeline_every", 1.5), ("bucket_device", None), ("bucket_device", "cuda"),
]


def _all_keys() -> set[str]:
    keys = set(ThunderSyncConfig.key_docs())
    for name, section in (("env", EnvConfig), ("opd", OPDConfig), ("tail", TailConfig)):
        keys |= {f"{name}.{k}" for k in section.key_docs()}
    latency = {f.name for f in dataclasses.fields(LatencyModel)}
    return keys | {f"env.{which}.{k}" for which in ("tool_latency", "verifier_latency") for k in latency}


def _nested(key: str, value) -> dict:
    section: dict = {}
    node = section
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return {"thundersync": section}


def test_every_key_has_a_bad_value_case():
    assert set(BAD) == _all_keys()


@pytest.mark.parametrize("key, value", list(BAD.items()) + MORE_BAD)
def test_a_bad_value_is_refused_naming_the_key(key, value):
    with pytest.raises(StreamingConfigError) as refused:
        ThunderSyncConfig.from_verl(_nested(key, value))
    message = str(refused.value)
    assert f"thundersync.{key}" in message.splitlines()[0]
    assert "\n  why: " in message and "\n  fix: " in message


LATENCY_KEYS = {f.name for f in dataclasses.fields(LatencyModel)}


@pytest.mark.parametrize("path, known", [("", ThunderSyncConfig.key_docs()), ("env", EnvConfig.key_docs()),
                                         ("opd", OPDConfig.key_docs()), ("env.tool_latency", LATENCY_KEYS)])
def test_an_unknown_key_is_refused_listing_the_known_ones(path, known):
    key = f"{path}.chunk_sise" if path else "chunk_sise"
    with pytest.raises(StreamingConfigError, match=rf"unknown key\(s\) thundersync\.{key.replace('.', '[.]')};") as refused:
        ThunderSyncConfig.from_verl(_nested(key, 4))
    listed = str(refused.value).splitlines()[0].split(" are: ")[1].split(", ")
    assert set(listed) == set(known)


def test_integer_keys_take_what_hydra_gives():
    cfg = ThunderSyncConfig.from_verl({"thundersync": {"chunk_size": "4", "pipeline_depth": 3.0, "memory_budget_bytes": 2e9}})
    assert (cfg.chunk_size, cfg.pipeline_depth, cfg.memory_budget_bytes) == (4, 3, 2_000_000_000)
    assert all(type(v) is int for v in (cfg.chunk_size, cfg.pipeline_depth, cfg.memory_budget_bytes))
    assert ThunderSyncConfig.from_verl({"thundersync": {"poll_s": 1}}).poll_s == 1.0


def test_null_where_a_key_allows_it():
    cfg = ThunderSyncConfig.from_verl({"thundersync": {"memory_budget_bytes": None, "run_dir": None,
                                                       "opd": {"teacher_timeout_s": None}, "env": {"trace_path": None}}})
    assert cfg.memory_budget_bytes is None and cfg.opd.teacher_timeout_s is None and cfg.env.trace_path is None


def test_a_missing_or_null_section_gives_the_defaults():
    assert ThunderSyncConfig.from_verl({}) == ThunderSyncConfig()
    assert ThunderSyncConfig.from_verl(OmegaConf.create({"thundersync": None})) == ThunderSyncConfig()
    assert ThunderSyncConfig.from_verl(OmegaConf.create({"trainer": {"device": "cpu"}})) == ThunderSyncConfig()
    with pytest.raises(StreamingConfigError, match="thundersync must be a mapping"):
        ThunderSyncConfig.from_verl({"thundersync": 5})


def test_the_object_is_read_only_and_reads_like_a_mapping():
    cfg = ThunderSyncConfig.from_verl({"thundersync": {"chunk_size": 4, "env": {"retry_prob": 0}}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_size = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.env.retry_prob = 0.5
    assert cfg.get("chunk_size") == 4 and cfg["env"]["retry_prob"] == 0.0 and cfg.get("nothing", 1) == 1
    assert ThunderSyncConfig.from_verl(cfg) is cfg and ThunderSyncConfig.from_verl({"thundersync": cfg}) is cfg


def test_every_key_has_a_one_line_doc():
    for section in (ThunderSyncConfig, EnvConfig, OPDConfig):
        for key, doc in section.key_docs().items():
            assert doc and "\n" not in doc and len(doc) < 200, f"{section.PREFIX}.{key}"


def test_the_choices_are_the_ones_the_code_and_recipes_use():
    from thundersync_verl.demo import MODES as DEMO_MODES
    from thundersync_verl.algos.opd.opd_stream import GRANULARITIES as PLANNER_GRANULARITIES

    assert sorted(MODES) == RECIPE_MODES and tuple(DEMO_MODES) == MODES
    assert tuple(PLANNER_GRANULARITIES) == GRANULARITIES


# ----- the shipped recipes, composed as verl's main_ppo would --------------------------------------
def _compose(recipe: str, mode: str, *extra: str):
    from hydra import compose, initialize_config_dir

    overrides = ["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z", f"mode={mode}", *extra]
    with initialize_config_dir(config_dir=str(RECIPES / "cpu_tiny"), version_base=None):
        return compose(config_name=recipe, overrides=overrides)


@pytest.mark.parametrize("recipe", ["grpo", "opd"])
@pytest.mark.parametrize("mode", RECIPE_MODES)
def test_every_recipe_section_builds_and_the_defaults_are_what_it_sets(recipe, mode):
    cfg = _compose(recipe, mode)
    typed = ThunderSyncConfig.from_verl(cfg)
    assert typed == dataclasses.replace(ThunderSyncConfig(), mode=mode)
    raw = OmegaConf.to_container(cfg.thundersync, resolve=True)
    assert set(raw) <= set(ThunderSyncConfig.key_docs())
    if recipe == "opd":  # the OPD recipe spells the opd section out; it must equal the defaults
        assert OPDConfig.from_mapping(raw["opd"]) == OPDConfig()
    verifier = OmegaConf.to_container(cfg.reward.custom_reward_function.reward_kwargs, resolve=True)["verifier_latency"]
    assert LatencyModel.from_config(verifier) == typed.env.verifier_latency  # what reward.py gets


@pytest.mark.parametrize("override, key", [
    ("thundersync.chunk_size=0", "thundersync.chunk_size"),
    ("thundersync.poll_s=-1", "thundersync.poll_s"),
    ("thundersync.trajectory_timeout_s=0", "thundersync.trajectory_timeout_s"),
    ("thundersync.env.tool_latency.scale=-1", "thundersync.env.tool_latency.scale"),
    ("thundersync.opd.granularity=group", "thundersync.opd.granularity"),
    ("+thundersync.chunk_sise=4", "thundersync.chunk_sise"),
])
def test_a_bad_hydra_override_is_refused_naming_the_key(override, key):
    with pytest.raises(StreamingConfigError, match=key.replace(".", r"\.")):
        ThunderSyncConfig.from_verl(_compose("opd", "thundersync", override))


def test_hydra_overrides_arrive_typed():
    cfg = ThunderSyncConfig.from_verl(_compose("grpo", "thundersync", "thundersync.chunk_size=4", "thundersync.coalesce=false",
                                               "+thundersync.memory_budget_bytes=2e9", "thundersync.env.tool_latency.scale=0.2"))
    assert (cfg.chunk_size, cfg.coalesce, cfg.memory_budget_bytes) == (4, False, 2_000_000_000)
    assert cfg.env.tool_latency == LatencyModel(scale=0.2) and cfg.env.verifier_latency == LatencyModel()


# ----- the modules read the typed object ---------------------------------------------------------
def test_the_teacher_retry_policy_and_the_opd_planner_read_the_typed_keys():
    from thundersync_verl.algos.opd.turn_teacher import retry_policy_from_config
    from thundersync_verl.algos.opd.opd_stream import opd_planner_from_verl_config

    policy = retry_policy_from_config({"thundersync": {"opd": {"teacher_max_attempts": "2", "teacher_timeout_s": None}}})
    assert (policy.max_attempts, policy.timeout_s, policy.backoff_s) == (2, None, 0.5)
    with pytest.raises(StreamingConfigError, match=r"thundersync\.opd\.teacher_backoff_s"):
        retry_policy_from_config({"thundersync": {"opd": {"teacher_backoff_s": -1}}})
    config = _compose("opd", "thundersync", "thundersync.opd.granularity=trajectory")
    assert opd_planner_from_verl_config(config).granularity == "trajectory"
    assert opd_planner_from_verl_config(_compose("opd", "thundersync")).granularity == "turn"
