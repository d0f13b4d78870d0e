"""The parquet dataset has verl's RL format, round-trips through pandas and loads in verl. CPU only."""

from __future__ import annotations

import pandas as pd

from thundersync_verl.envs import protocol
from thundersync_verl.envs.dataset import write_dataset

COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info", "agent_name"]


def test_round_trip_with_pandas(tmp_path):
    path = write_dataset(tmp_path / "train.parquet", 40, seed=0, split="train")
    frame = pd.read_parquet(path)
    assert list(frame.columns) == COLUMNS and len(frame) == 40
    row = frame.iloc[7]
    assert row["data_source"] == protocol.DATA_SOURCE and row["agent_name"] == "thundersync_tool_agent"
    prompt = list(row["prompt"])
    assert [m["role"] for m in prompt] == ["system", "user"]
    assert row["reward_model"]["style"] == "rule"
    expression = row["extra_info"]["expression"]
    assert prompt[1]["content"] == f"Compute `{expression}`."
    assert row["reward_model"]["ground_truth"] == str(eval(expression))  # noqa: S307 - our own text
    assert list(frame["extra_info"].map(lambda e: e["index"])) == list(range(40))


def test_deterministic_and_splits_differ(tmp_path):
    a = pd.read_parquet(write_dataset(tmp_path / "a.parquet", 30, seed=1, split="train"))
    b = pd.read_parquet(write_dataset(tmp_path / "b.parquet", 30, seed=1, split="train"))
    c = pd.read_parquet(write_dataset(tmp_path / "c.parquet", 30, seed=1, split="test"))
    expressions = lambda f: [e["expression"] for e in f["extra_info"]]  # noqa: E731
    assert expressions(a) == expressions(b)
    assert expressions(a) != expressions(c)
    assert not list(tmp_path.glob(".*.tmp"))


def test_latency_config_is_stored_in_every_row(tmp_path):
    latency = {"kind": "constant", "median_s": 0.2}
    frame = pd.read_parquet(write_dataset(tmp_path / "t.parquet", 5, seed=0, split="test", verifier_latency=latency))
    for extra in frame["extra_info"]:
        assert extra["verifier_latency"]["kind"] == "constant" and extra["verifier_latency"]["median_s"] == 0.2


def test_verl_rl_dataset_reads_it(tmp_path):
    """verl's own RLHFDataset loads the file with our tokenizer and keeps our fields."""
    from omegaconf import OmegaConf

    from thundersync_verl.models.factory import build_tokenizer
    from thundersync_verl.models.variants import get_spec
    from verl.utils.dataset.rl_dataset import RLHFDataset

    path = write_dataset(tmp_path / "train.parquet", 12, seed=0, split="train")
    tokenizer = build_tokenizer(get_spec("student").scaled(n_transcripts=300), seed=0)
    config = OmegaConf.create({"cache_dir": str(tmp_path / "cache"), "max_prompt_length": 64, "filter_overlong_prompts": True})
    dataset = RLHFDataset(str(path), tokenizer, config)
    assert len(dataset) == 12  # no prompt was filtered as too long
    item = dataset[3]
    assert item["agent_name"] == "thundersync_tool_agent" and item["index"] == 3
    assert item["raw_prompt"][1]["content"].startswith("Compute `")
    assert item["reward_model"]["ground_truth"] == item["extra_info"]["answer"]
