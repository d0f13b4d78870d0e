"""Read back what verl's loggers wrote: tensorboard event files and wandb's offline run file.

Why:
1. A logger test must prove the metrics and images are IN the run files a user opens, not that a
   logging call returned. Tensorboard's own ``EventAccumulator`` reads the event files.
2. wandb 0.31 writes an offline run as one ``run-<id>.wandb`` file (a leveldb-style log of
   protobuf ``Record`` messages) and no summary file; it ships no Python reader, so
   ``wandb_history`` decodes the log framing here and the records with wandb's own protobufs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

WANDB_HEADER = 7  # b":W&B" + 2-byte magic + 1-byte version
BLOCK = 32 * 1024  # leveldb log block; a record header never straddles one
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_run(log_dir: str | Path) -> dict:
    """``{"scalars": {tag: [(step, value)]}, "images": {tag: [(step, width, height)]}}`` of every event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    run.Reload()
    tags = run.Tags()
    return {
        "scalars": {t: [(e.step, e.value) for e in run.Scalars(t)] for t in tags["scalars"]},
        "images": {t: [(e.step, e.width, e.height) for e in run.Images(t)] for t in tags["images"]},
    }


def _wandb_payloads(data: bytes):
    pos, pending = WANDB_HEADER, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # block trailer: padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield pending + payload


def _wandb_records(path: Path, wait_s: float) -> list:
    """The run file's records once its ``exit`` record is written: ``wandb.finish`` can return before
    wandb's service process has written the last records."""
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + wait_s
    while True:
        records = [pb.Record.FromString(payload) for payload in _wandb_payloads(path.read_bytes())]
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def wandb_history(wandb_dir: str | Path, wait_s: float = 60.0) -> list[dict]:
    """Every history row of the offline run(s) under ``wandb_dir``: ``{"_step": n, key: value, ...}``."""
    rows = []
    for path in sorted(Path(wandb_dir).rglob("offline-run-*/run-*.wandb")):
        for record in _wandb_records(path, wait_s):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows
