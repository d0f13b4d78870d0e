"""One SWE-smith task instance, read from any of the shapes it is published in.

Why:
1. The converter (``data/swe_smith.py``), the synthetic generator, the agent loop and the verifier all
   read the same fields; one reader means one set of checks and one place that names what is missing.
2. SWE-smith rows carry ``instance_id, repo, patch, FAIL_TO_PASS, PASS_TO_PASS, image_name,
   problem_statement``; ``base_commit`` is optional (the published dataset has none: the repository
   state lives in the image). Test lists come as lists, numpy arrays (parquet via pandas) or, in
   SWE-bench-family files, JSON-encoded strings; all become tuples of pytest node ids.
3. What ``patch`` means is SWE-smith's, checked in its own documentation and code (SWE-bench/SWE-smith,
   ``docs/guides/harnesses.md``: the gathered instance's ``patch`` is "the diff that, when applied,
   creates the bug"; ``swesmith/harness/utils.py`` ``_apply_patch`` evaluates gold predictions with
   ``git apply --reverse`` because "gold patches = bug patches, so fix = revert"; ``harness/gather.py``
   commits the applied bug on a branch named after the instance and stores that commit as
   ``base_commit``). So the agent's starting state is the clean repository with ``patch`` applied (or
   ``base_commit`` checked out when given, where the bug is already committed), and the gold fix is
   ``patch`` reversed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

REQUIRED_FIELDS = ("instance_id", "repo", "patch", "FAIL_TO_PASS", "PASS_TO_PASS", "image_name", "problem_statement")
OPTIONAL_FIELDS = ("base_commit",)
TEST_LIST_FIELDS = ("FAIL_TO_PASS", "PASS_TO_PASS")


class InstanceError(ValueError):
    """A row that is not a usable SWE-smith instance; the message names the fields."""


@dataclass(frozen=True)
class SWEInstance:
    instance_id: str
    repo: str
    patch: str  # the diff that introduces the bug into the clean repository (point 3)
    FAIL_TO_PASS: tuple[str, ...]
    PASS_TO_PASS: tuple[str, ...]
    image_name: str
    problem_statement: str
    base_commit: str | None = None  # the commit with the bug applied, when the row carries one

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "SWEInstance":
        """The instance of a row; raises :class:`InstanceError` naming every missing or malformed field."""
        if not isinstance(row, Mapping):
            raise InstanceError(f"an instance is a mapping of fields, got {type(row).__name__}")
        missing = [f for f in REQUIRED_FIELDS if _absent(row.get(f)) and not _blank(row.get(f))]
        empty = [f for f in REQUIRED_FIELDS if _blank(row.get(f))]
        if missing or empty:
            raise InstanceError("; ".join(([f"missing field(s) {', '.join(missing)}"] if missing else []) +
                                          ([f"empty field(s) {', '.join(empty)}"] if empty else [])))
        values = {f: row[f] for f in REQUIRED_FIELDS}
        bad = [f for f in REQUIRED_FIELDS if f not in TEST_LIST_FIELDS and not isinstance(values[f], str)]
        if bad:
            raise InstanceError(f"field(s) {', '.join(bad)} must be strings")
        for name in TEST_LIST_FIELDS:
            values[name] = test_ids(row[name], name)
        if not values["FAIL_TO_PASS"]:
            raise InstanceError("FAIL_TO_PASS is empty: without a failing test, doing nothing would score 1")
        base = row.get("base_commit")
        if not _absent(base) and not isinstance(base, str):
            raise InstanceError(f"base_commit must be a string or absent, got {type(base).__name__}")
        return cls(**values, base_commit=None if _absent(base) else base)

    def to_row(self) -> dict[str, Any]:
        """SWE-smith's row: lists for the test ids, ``base_commit`` only when there is one."""
        row = asdict(self)
        row["FAIL_TO_PASS"], row["PASS_TO_PASS"] = list(self.FAIL_TO_PASS), list(self.PASS_TO_PASS)
        if self.base_commit is None:
            row.pop("base_commit")
        return row

    def test_files(self) -> list[str]:
        """The test files the node ids name (``path::name`` -> ``path``), in first-seen order."""
        seen: dict[str, None] = {}
        for node in (*self.FAIL_TO_PASS, *self.PASS_TO_PASS):
            seen.setdefault(node.split("::", 1)[0], None)
        return list(seen)


def _absent(value: Any) -> bool:
    """No usable value: absent, null, NaN (pandas fills missing cells with NaN) or a blank string."""
    if value is None:
        return True
    if isinstance(value, float) and value != value:
        return True
    return _blank(value)


def _blank(value: Any) -> bool:
    """An empty (or whitespace-only) string: present but empty, which messages say in words."""
    return isinstance(value, str) and not value.strip()


def test_ids(value: Any, name: str) -> tuple[str, ...]:
    """A test-id list from a list, tuple, numpy array or JSON-encoded string; refuses anything else."""
    if _blank(value):
        raise InstanceError(f"{name} is empty (expected a list of pytest node ids)")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise InstanceError(f"{name} is a string that is not a JSON list (expected a list of pytest node ids, "
                                f"or one JSON-encoded as SWE-bench stores it): {value[:60]!r}") from None
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()  # numpy arrays from parquet
    if not isinstance(value, (list, tuple)):
        raise InstanceError(f"{name} must be a list of pytest node ids (strings), got {type(value).__name__}")
    for number, item in enumerate(value, 1):  # counted as a reader counts them
        if not isinstance(item, str):
            raise InstanceError(f"{name} must be a list of pytest node ids (strings): item {number} is a "
                                f"{type(item).__name__}")
        if not item.strip():
            raise InstanceError(f"{name} must be a list of pytest node ids: item {number} is empty")
    return tuple(value)


def instance_from_extra_info(extra_info: Any) -> SWEInstance:
    """The instance a dataset row carries in ``extra_info["instance"]`` (a mapping or a JSON string)."""
    if not isinstance(extra_info, Mapping) or "instance" not in extra_info:
        raise InstanceError("the row's extra_info has no 'instance': build the data with "
                            "python -m thundersync_verl.data.swe_smith (or swe_synthetic)")
    raw = extra_info["instance"]
    if isinstance(raw, str):
        raw = json.loads(raw)
    return SWEInstance.from_row(raw)

