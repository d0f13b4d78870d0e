"""``python -m thundersync_verl.data.swe_smith --input <jsonl/json/parquet> --out <dir>``: SWE-smith to verl parquet.

Why:
1. verl's ``RLHFDataset`` reads parquet rows with ``data_source``, ``prompt`` (chat messages),
   ``ability``, ``reward_model``, ``extra_info`` and ``agent_name``; the SWE agent loop finds its task
   in ``extra_info["instance"]``: the SWE-smith row itself (``envs/swe/instance.py`` reads it).
2. No download at run time: the user points ``--input`` at their copy (the published parquet, a
   ``task_insts`` JSON array, or JSONL). Test lists may be lists or JSON-encoded strings;
   ``base_commit`` is optional (the published rows have none).
3. A file with unusable rows is refused whole, with one usage-error line naming each bad row and its
   missing or malformed fields, never a traceback and never a silently shorter dataset.
4. Every row carries the same ``extra_info`` keys (``base_commit`` is null when absent): parquet stores
   it as one struct column.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable

from thundersync_verl.core.errors import rule_message
from thundersync_verl.envs.swe import protocol
from thundersync_verl.envs.swe.instance import REQUIRED_FIELDS, InstanceError, SWEInstance

MAX_LISTED = 5  # bad rows named in the refusal before "... and N more"


class ConversionError(ValueError):
    """Rows that cannot be converted; the message names them and their fields (one line)."""


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a .jsonl, .json (an array) or .parquet file, as plain dicts."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(_unreadable(path, "is not a file"))
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pandas as pd

        try:
            return pd.read_parquet(path).to_dict(orient="records")
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for an empty or damaged file
            raise ConversionError(_unreadable(path, f"is not a readable parquet file ({type(exc).__name__}: {exc})")) from None
    try:
        text = path.read_text(encoding="utf-8")
        if suffix == ".json":
            rows = json.loads(text)
            return rows if isinstance(rows, list) else [rows]
        if suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(_unreadable(path, f"is not valid UTF-8 JSON ({exc})")) from None
    raise ConversionError(_unreadable(path, f"has the suffix {suffix or '(none)'}, not .jsonl, .json or .parquet"))


def _unreadable(path: Path, problem: str) -> str:
    return rule_message(f"--input {path} {problem}",
                        "the SWE-smith instances are read from exactly the file given; nothing is guessed",
                        "point --input at a .jsonl (one instance per line), .json (an array) or .parquet "
                        "file of SWE-smith instances")


def verl_row(instance: SWEInstance, index: int, *, data_source: str, agent_name: str) -> dict[str, Any]:
    """One verl dataset row (point 1)."""
    return {
        "data_source": data_source,
        "prompt": protocol.prompt_messages(instance.problem_statement),
        "ability": protocol.ABILITY,
        "reward_model": {"style": "rule", "ground_truth": instance.instance_id},
        "extra_info": {"index": index, "instance_id": instance.instance_id,
                       "instance": {**instance.to_row(), "base_commit": instance.base_commit}},
        "agent_name": agent_name,
    }


def convert(rows: Iterable[Any], *, data_source: str = protocol.DATA_SOURCE,
            agent_name: str = protocol.AGENT_NAME) -> list[dict[str, Any]]:
    """verl rows for every input row, or :class:`ConversionError` naming every bad one (point 3)."""
    out, problems = [], []
    for i, row in enumerate(rows):
        try:
            out.append(verl_row(SWEInstance.from_row(row), len(out), data_source=data_source, agent_name=agent_name))
        except InstanceError as exc:
            name = row.get("instance_id") if isinstance(row, dict) else None
            problems.append(f"row {i}{f' ({name})' if isinstance(name, str) and name else ''}: {exc}")
    if problems:
        listed = "; ".join(problems[:MAX_LISTED])
        more = f"; ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise ConversionError(rule_message(
            f"refused {len(problems)} of {len(out) + len(problems)} rows: {listed}{more}",
            "a dataset with rows silently dropped would train on a different set than the one given",
            "fix or remove the named rows: every row needs the fields " + ", ".join(REQUIRED_FIELDS)))
    if not out:
        raise ConversionError(rule_message(
            "the input holds no rows", "an empty dataset cannot train (verl would fail later, less clearly)",
            "point --input at a file holding at least one SWE-smith instance"))
    return out


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """``rows`` as parquet at ``path``, written to a temporary name and renamed (readers never see half a file)."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pd.DataFrame(rows).to_parquet(tmp, index=False)
    tmp.replace(path)
    return path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m thundersync_verl.data.swe_smith",
                                 description="Convert SWE-smith instances to verl parquet for the SWE agent loop.")
    ap.add_argument("--input", required=True, help="SWE-smith instances: .jsonl, .json (an array) or .parquet")
    ap.add_argument("--out", required=True, help="output folder; writes <out>/<name>.parquet")
    ap.add_argument("--name", default="train", help="parquet file stem (default: train)")
    ap.add_argument("--data-source", default=protocol.DATA_SOURCE, help="the rows' data_source")
    ap.add_argument("--agent-name", default=protocol.AGENT_NAME, help="the registered agent loop the rows select")
    ap.add_argument("--limit", type=int, default=None, help="convert only the first N rows")
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit must be >= 1, got {args.limit}")
    try:
        rows = read_rows(args.input)[: args.limit]
        converted = convert(rows, data_source=args.data_source, agent_name=args.agent_name)
    except ConversionError as exc:
        ap.error(str(exc).replace("\n", " "))
    path = write_parquet(converted, Path(args.out) / f"{args.name}.parquet")
    summary = {"rows": len(converted), "out": str(path)}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
