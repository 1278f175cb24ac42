"""Reading back the run file W&B writes offline (`offline-run-*/run-<id>.wandb`).

wandb 0.31 has no Python reader any more (its datastore moved into the Go core), so this reads the
documented format: a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then 32 KiB blocks of
LevelDB-log records (crc32c, length, type: full/first/middle/last), each a `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every protobuf Record in a .wandb file, in order."""
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    found, pending, offset = [], b"", HEADER
    while offset + HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < HEADER:  # the block's tail is padding
            offset += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + HEADER])
        if kind == 0 and length == 0:
            offset += room
            continue
        chunk = data[offset + HEADER : offset + HEADER + length]
        offset += HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
            pending = b""
    return found


@dataclass
class OfflineRun:
    """What one .wandb file holds: the run id, and each history row by step (values JSON-decoded)."""

    run_id: str
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)


def read_run(path: Path) -> OfflineRun:
    run = OfflineRun(run_id="")
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id = record.run.run_id
        elif kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            run.rows.setdefault(int(row["_step"]), {}).update(row)
    return run


def run_files(wandb_dir: Path) -> list[Path]:
    return sorted(wandb_dir.rglob("offline-run-*/run-*.wandb"))


def logged_table(run_dir: Path, row: dict[str, Any], key: str) -> dict[str, Any]:
    """The `wandb.Table` logged under `key` in `row` (flattened as `key/path`, ...), read from its file."""
    path = row.get(f"{key}/path")
    assert path is not None, f"no table {key!r} in the row: {sorted(row)}"
    return dict(json.loads((run_dir / "files" / path).read_text()))
