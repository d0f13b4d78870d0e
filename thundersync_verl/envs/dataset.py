"""Write the arithmetic tool task as a parquet file in verl's RL dataset format.

Why:
1. verl's ``RLHFDataset`` (``verl/utils/dataset/rl_dataset.py``) reads parquet rows with
   ``data_source``, ``prompt`` (a list of chat messages; the agent loop applies the chat
   template), ``ability``, ``reward_model`` (``{"style": "rule", "ground_truth": ...}``),
   ``extra_info`` (``index`` becomes the sample index) and, for agent-loop rollouts,
   ``agent_name``, which picks the registered agent loop for the row.
2. Splits draw from independent named random streams, so train and test never share draws,
   and a (seed, split, n) triple always yields the same file contents.
3. Every row carries the same ``extra_info`` keys: parquet stores it as one struct column and
   rows with different keys would be padded with nulls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from thundersync_verl.envs import protocol
from thundersync_verl.envs.latency import LatencyModel


def dataset_rows(n: int, seed: int, split: str, verifier_latency: Mapping[str, Any] | None = None) -> list[dict]:
    """The rows :func:`write_dataset` writes, as plain dicts."""
    if n < 0:
        raise ValueError(f"n must be >= 0 (it is the number of rows), got {n}")
    latency = LatencyModel.from_config(verifier_latency).to_config() if verifier_latency is not None else None
    rows = []
    for index, problem in enumerate(protocol.problems(n, seed, stream=split)):
        extra_info: dict[str, Any] = {
            "index": index,
            "split": split,
            "expression": problem.expression,
            "answer": problem.ground_truth,
        }
        if latency is not None:
            extra_info["verifier_latency"] = latency
        rows.append(
            {
                "data_source": protocol.DATA_SOURCE,
                "prompt": protocol.prompt_messages(problem),
                "ability": protocol.ABILITY,
                "reward_model": {"style": "rule", "ground_truth": problem.ground_truth},
                "extra_info": extra_info,
                "agent_name": protocol.AGENT_NAME,
            }
        )
    return rows


def write_dataset(
    path: str | Path,
    n: int,
    seed: int,
    split: str,
    *,
    verifier_latency: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``n`` problems of ``split`` to ``path`` (parquet) and return the path.

    ``verifier_latency`` (a :class:`LatencyModel` config) is stored in every row's
    ``extra_info`` so the reward function samples the verifier's latency from it.
    """
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(dataset_rows(n, seed, split, verifier_latency))
    tmp = path.with_name(f".{path.name}.tmp")
    frame.to_parquet(tmp, index=False)
    tmp.replace(path)  # readers never see a half-written file
    return path
