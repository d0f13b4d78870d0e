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
5. Errors name a row as its reader counts it, from 1: ``line N`` of a JSONL file (blank lines counted),
   ``row N`` of a JSON array or parquet table; an empty field is called empty, a .json that is not an array
   is refused saying so, and the command line prints each refusal as one usage-error line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable

from thundersync_verl.cli_args import Parser, positive_int
from thundersync_verl.core.errors import rule_message
from thundersync_verl.envs.swe import swe_protocol as protocol
from thundersync_verl.envs.swe.instance import REQUIRED_FIELDS, InstanceError, SWEInstance

MAX_LISTED = 5  # bad rows named in the refusal before "... and N more"


class ConversionError(ValueError):
    """Rows that cannot be converted; the message names them and their fields (one line)."""


class Rows(list):
    """The rows of an input file, and where each stands in it as a reader counts (point 5): ``line 7`` of a
    JSONL file, ``row 3`` of a JSON array or parquet table (1-based)."""

    def __init__(self, rows: Iterable[Any] = (), where: Iterable[str] | None = None) -> None:
        super().__init__(rows)
        self.where = list(where) if where is not None else [f"row {n}" for n in range(1, len(self) + 1)]

    def head(self, n: int | None) -> "Rows":
        """The first ``n`` rows (all when ``n`` is None), with their places."""
        return self if n is None else Rows(self[:n], self.where[:n])


JSON_KINDS = {dict: "an object", str: "a string", int: "a number", float: "a number", bool: "a boolean",
              type(None): "null"}


def read_rows(path: str | Path) -> Rows:
    """The rows of a .jsonl, .json (an array) or .parquet file, as plain dicts, with their places."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(_unreadable(path, "is not a file"))
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise ConversionError(_unreadable(path, f"has the suffix {suffix or '(none)'}, not .jsonl, .json or .parquet"))
    try:
        if path.stat().st_size == 0:
            raise ConversionError(_unreadable(path, "is empty (0 bytes)"))
        if suffix == ".parquet":
            return _read_parquet(path)
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConversionError(_unreadable(path, f"is not valid UTF-8 JSON ({exc})")) from None
    except OSError as exc:
        raise ConversionError(_unreadable(path, f"cannot be read ({exc.strerror or type(exc).__name__})")) from None
    return _read_jsonl(path, text) if suffix == ".jsonl" else _read_json_array(path, text)


def _read_parquet(path: Path) -> Rows:
    import pandas as pd

    try:
        return Rows(pd.read_parquet(path).to_dict(orient="records"))
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for an empty or damaged file
        raise ConversionError(_unreadable(path, f"is not a readable parquet file ({type(exc).__name__}: {exc})")) from None


def _read_jsonl(path: Path, text: str) -> Rows:
    """One instance per line; blank lines are skipped but counted, so a place is the file's line number."""
    rows, where = [], []
    for number, line in enumerate(text.split("\n"), 1):  # "\n" only: JSON strings may hold U+2028 and friends
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ConversionError(_unreadable(path, f"is not valid UTF-8 JSON: line {number} column {exc.colno}: "
                                                    f"{exc.msg}")) from None
        where.append(f"line {number}")
    return Rows(rows, where)


def _read_json_array(path: Path, text: str) -> Rows:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConversionError(_unreadable(path, f"is not valid UTF-8 JSON: line {exc.lineno} column {exc.colno}: "
                                                f"{exc.msg}")) from None
    if not isinstance(data, list):
        raise ConversionError(rule_message(
            f"--input {path} holds {JSON_KINDS.get(type(data), type(data).__name__)}, not a JSON array",
            "a .json input is an array of SWE-smith instances: [{...}, {...}]",
            "wrap the instance(s) in [ ], or write one instance per line to a .jsonl file"))
    return Rows(data)


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
    """verl rows for every input row, or :class:`ConversionError` naming every bad one by its place (point 3)."""
    rows = rows if isinstance(rows, Rows) else Rows(rows)
    out, problems = [], []
    for where, row in zip(rows.where, rows):
        try:
            out.append(verl_row(SWEInstance.from_row(row), len(out), data_source=data_source, agent_name=agent_name))
        except InstanceError as exc:
            name = row.get("instance_id") if isinstance(row, dict) else None
            problems.append(f"{where}{f' ({name})' if isinstance(name, str) and name.strip() else ''}: {exc}")
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


def _file_name(text: str) -> str:
    if not text or text in (".", "..") or "/" in text or "\\" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a file name (give a stem such as train, no folder)")
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m thundersync_verl.data.swe_smith",
                description="Convert SWE-smith instances to verl parquet for the SWE agent loop.")
    ap.add_argument("--input", required=True, help="SWE-smith instances: .jsonl, .json (an array) or .parquet")
    ap.add_argument("--out", required=True, help="output folder; writes <out>/<name>.parquet")
    ap.add_argument("--name", default="train", type=_file_name, help="parquet file stem (default: train)")
    ap.add_argument("--data-source", default=protocol.DATA_SOURCE, help="the rows' data_source")
    ap.add_argument("--agent-name", default=protocol.AGENT_NAME, help="the registered agent loop the rows select")
    ap.add_argument("--limit", type=positive_int, default=None, help="convert only the first N rows")
    return ap


def main(argv: list[str] | None = None) -> dict:
    """Convert; a bad input or output is one usage-error line and exit 2 (``cli_args.Parser``), never a traceback."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        converted = convert(read_rows(args.input).head(args.limit), data_source=args.data_source,
                            agent_name=args.agent_name)
    except ConversionError as exc:
        ap.error(" ".join(part.strip() for part in str(exc).splitlines()))  # one line, whatever a field held
    try:
        path = write_parquet(converted, Path(args.out) / f"{args.name}.parquet")
    except OSError as exc:
        ap.error(f"--out {args.out}: cannot write {args.name}.parquet there ({exc.strerror or type(exc).__name__}); "
                 "give a folder that is (or can be created) writable")
    summary = {"rows": len(converted), "out": str(path)}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
