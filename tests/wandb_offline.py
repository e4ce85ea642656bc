"""The records of a W&B offline run, read from its transaction log (``offline-run-*/run-<id>.wandb``) with
wandb's own protobuf messages, without ``wandb sync`` and without a network.

The log is LevelDB's log format behind a 7-byte W&B header: 32 KiB blocks of records, each with a 7-byte
header (checksum, length, type: whole, first, middle or last part); a block's last bytes, when fewer than a
header, are padding. A record cut short by a kill ends the reading."""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK, _HEADER = 32768, 7
_WHOLE, _FIRST, _LAST = 1, 2, 4


def records(path: Path) -> list:
    """The ``wandb_internal_pb2.Record`` messages of one transaction log, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    found, index, parts = [], _HEADER, b""
    while True:
        if _BLOCK - index % _BLOCK < _HEADER:  # padding to the next block
            index += _BLOCK - index % _BLOCK
        if index + _HEADER > len(data):
            return found
        _, length, kind = struct.unpack("<IHB", data[index : index + _HEADER])
        body = data[index + _HEADER : index + _HEADER + length]
        if len(body) < length:
            return found  # cut short
        index += _HEADER + length
        parts = body if kind in (_WHOLE, _FIRST) else parts + body
        if kind in (_WHOLE, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            found.append(record)


def offline_runs(folder: Path) -> list[Path]:
    """The transaction logs of the offline runs under ``folder`` (its ``wandb/``), oldest first."""
    return sorted((Path(folder) / "wandb").glob("offline-run-*/run-*.wandb"))


def run_of(path: Path) -> dict:
    """What one offline run holds: its id, config, history rows (logged values, W&B's ``_step`` left out),
    whether it was marked preempting, and its exit code (None: it did not finish)."""
    run: dict = {"id": None, "config": {}, "rows": [], "preempting": False, "exit_code": None}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"] = record.run.run_id
            run["config"].update(_items(record.run.config.update))
        elif kind == "config":
            run["config"].update(_items(record.config.update))
        elif kind == "history":
            row = _items(record.history.item)
            run["rows"].append({key: value for key, value in row.items() if not key.startswith("_")})
        elif kind == "preempting":
            run["preempting"] = True
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def _items(items) -> dict:
    """Config or history items as a dict (a key is ``key``, or ``nested_key`` joined with dots)."""
    return {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items}
