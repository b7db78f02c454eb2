"""Read back what an offline W&B run wrote: its ``run-<id>.wandb`` file, parsed with wandb's own protobufs.

The file is W&B's transaction log, the records that ``wandb sync`` uploads: a 7-byte header (``:W&B``,
magic 0xBEE1, version 0), then the records, each a serialized ``wandb_internal_pb2.Record`` framed as in
LevelDB's log format (32 KiB blocks; a chunk is a CRC-32 of its type and data, its length and its type,
FULL or FIRST/MIDDLE/LAST for a record split across blocks). wandb no longer ships a Python reader of
it (the service that writes it is in Go), so the tests read it here, checking every chunk's CRC.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = struct.Struct("<IHB")  # CRC-32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    """Every record of a ``.wandb`` file, in order (``wandb.proto.wandb_internal_pb2.Record``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a W&B transaction log"
    pos, parts = 7, b""
    while pos + HEADER.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER.size:  # the block's tail is padding
            pos += left
            continue
        crc, length, kind = HEADER.unpack_from(data, pos)
        if (crc, length, kind) == (0, 0, 0):
            pos += left
            continue
        chunk = data[pos + HEADER.size:pos + HEADER.size + length]
        assert len(chunk) == length, f"{path}: a record cut short at byte {pos}"
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad CRC at byte {pos}"
        pos += HEADER.size + length
        parts = chunk if kind in (FULL, FIRST) else parts + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


@dataclass
class OfflineRun:
    """What one offline run wrote: history rows, summary, metric definitions, alerts, tables, exit code."""

    path: Path  # the run's folder (``offline-run-<time>-<id>``)
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    metrics: list[Any] = field(default_factory=list)
    alerts: list[Any] = field(default_factory=list)
    exit_code: int | None = None

    @classmethod
    def read(cls, folder: Path) -> OfflineRun:
        (log,) = folder.glob("run-*.wandb")
        run = cls(folder)
        for record in records(log):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                run.rows.append({_key(i): json.loads(i.value_json) for i in record.history.item})
            elif kind == "summary":
                for item in record.summary.update:
                    if len(item.nested_key) > 1:  # one field of a value (a table's): kept whole below
                        run.summary.setdefault(item.nested_key[0], {})[item.nested_key[1]] = json.loads(
                            item.value_json)
                    else:
                        run.summary[_key(item)] = json.loads(item.value_json)
                for item in record.summary.remove:
                    run.summary.pop(_key(item), None)
            elif kind == "metric":
                run.metrics.append(record.metric)
            elif kind == "alert":
                run.alerts.append(record.alert)
            elif kind == "exit":
                run.exit_code = record.exit.exit_code
        return run

    def table(self, key: str) -> list[dict[str, Any]]:
        """The rows of the latest version of the table logged under ``key``, as dicts."""
        found = json.loads((self.path / "files" / self.summary[key]["path"]).read_text())
        return [dict(zip(found["columns"], row)) for row in found["data"]]

    def series(self, key: str, step: str = "gradwatch/step") -> dict[int, Any]:
        """``{step: value}`` of one key over the rows that hold it."""
        return {row[step]: row[key] for row in self.rows if key in row}


def offline_runs(root: Path) -> list[OfflineRun]:
    """Every finished offline run under a ``wandb`` folder's parent (``dir=`` of ``wandb.init``), oldest first.

    ``run.finish()`` returns before wandb's service has written everything: call ``wandb.teardown()`` (which
    waits for it) first. A run without its exit record is not complete, and fails here.
    """
    runs = [OfflineRun.read(folder) for folder in sorted((root / "wandb").glob("offline-run-*"))]
    assert all(run.exit_code is not None for run in runs), "an offline run without its exit record: call " \
        "wandb.teardown() before reading"
    return runs
