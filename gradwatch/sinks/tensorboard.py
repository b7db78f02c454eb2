"""TensorBoard sink: step records as event files in the run directory, one event per step.

A resumed run (``resume=True``) writes a new event file that starts with a ``SessionLog.START``
at the step it continues from, as ``SummaryWriter(purge_step=...)`` does: TensorBoard's readers
(``EventAccumulator`` and the server's ``plugin_event_accumulator``) then drop the earlier files'
events of that step and later (the superseded ones).

Tags are ``<metric>/<layer>`` so that TensorBoard groups per-layer series by metric, and
``global/<name>`` for the global gradient norm, loss, learning rate and observed scalars.
``grad_nonfinite/<layer>`` points are written only where the count is non-zero. Each event file
starts with a custom-scalars layout (TensorBoard's *Custom Scalars* tab: the global series, and one
chart per metric with every layer's series in it), read from
``gradwatch/dashboards/tensorboard/custom_scalars.json``.

The event file is written here rather than through TensorBoard's ``EventFileWriter``, whose
pure-Python CRC32C costs more CPU per step than everything else gradwatch does on a small
model; the record format (length, masked CRC32C of the length, data, masked CRC32C of the data)
is TensorBoard's own, and the files are read back by TensorBoard's reader in the tests. The
per-step events (scalars only) are serialized from precomputed bytes per tag rather than built
as protobuf objects: the writer thread shares the interpreter with training.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Sequence
from pathlib import Path

import google_crc32c
import numpy as np

from gradwatch.store.findings import Finding
from gradwatch.store.records import LAYER, StepRecord, present
from gradwatch.store.writer import disk_full

log = logging.getLogger("gradwatch")
_counter = itertools.count()


def _masked_crc(data: bytes) -> bytes:
    crc = google_crc32c.value(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


class EventFile:
    """An append-only TensorBoard event file (TFRecord framing of ``Event`` protos)."""

    def __init__(self, logdir: Path, *, last: bool = False) -> None:
        from tensorboard.compat.proto import event_pb2

        stamp = int(time.time())
        if last:  # named to sort after every event file there: TensorBoard reads a run's files in name order
            stamp = max([stamp, *(_stamp(p.name) + 1 for p in logdir.glob("events.out.tfevents.*"))])
        name = f"events.out.tfevents.{stamp:010d}.{socket.gethostname()}.{os.getpid()}.{next(_counter)}"
        self.path = logdir / name
        self._file = self.path.open("ab")
        self._kept = 0  # bytes of whole events on disk (as of the last flush)
        self.write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write(self, event: object) -> None:
        """Append one event (a protobuf message)."""
        self.write_bytes(event.SerializeToString())  # type: ignore[attr-defined]

    def write_bytes(self, data: bytes) -> None:
        """Append one serialized event."""
        header = struct.pack("<Q", len(data))
        self._file.write(header + _masked_crc(header) + data + _masked_crc(data))

    def flush(self) -> None:
        """Make what was written visible to readers."""
        self._file.flush()
        self._kept = self._file.tell()

    def rewind(self) -> None:
        """Drop what was written since the last flush (a full disk cut it short): the file ends on a whole event."""
        try:
            self._file.close()  # what it still buffers cannot be written either
        except OSError:
            pass
        self._file = self.path.open("ab")
        self._file.truncate(self._kept)
        self._file.seek(self._kept)

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()


def _stamp(name: str) -> int:
    """The time stamp in an event file's name (``events.out.tfevents.<stamp>.<host>...``; -1 if none)."""
    part = name.split(".")[3:4]
    return int(part[0]) if part and part[0].isdigit() else -1


#: the custom-scalars layout, as the JSON form of TensorBoard's ``Layout`` proto, in ``gradwatch.dashboards``
LAYOUT = ("tensorboard", "custom_scalars.json")


@functools.lru_cache(maxsize=1)
def _layout() -> bytes:
    """The serialized ``Layout`` proto, read once per process."""
    from importlib.resources import files

    from google.protobuf import json_format
    from tensorboard.plugins.custom_scalar import layout_pb2

    resource = files("gradwatch.dashboards")
    for part in LAYOUT:
        resource = resource / part
    return json_format.Parse(resource.read_text(encoding="utf-8"), layout_pb2.Layout()).SerializeToString()


def custom_scalars() -> object:
    """The ``Summary`` that gives a run TensorBoard's custom-scalars layout (the plugin's config tag)."""
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorboard.plugins.custom_scalar import metadata

    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[_layout()],
                                    tensor_shape=tensor_shape_pb2.TensorShapeProto())
    value = summary_pb2.Summary.Value(tag=metadata.CONFIG_SUMMARY_TAG, tensor=tensor,
                                      metadata=metadata.create_summary_metadata())
    return summary_pb2.Summary(value=[value])


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _value_prefix(tag: str) -> bytes:
    """The bytes of a ``Summary.value`` entry ``{tag, simple_value}`` up to the float's 4 bytes.

    ``Summary.Value`` is ``tag`` (field 1, string) and ``simple_value`` (field 2, float32), and
    ``Summary.value`` is its field 1 (repeated): one record per scalar, built from bytes instead of
    protobuf objects (a per-layer series writes one per layer and metric on every logged step).
    """
    name = tag.encode()
    body = b"\x0a" + _varint(len(name)) + name + b"\x15"
    return b"\x0a" + _varint(len(body) + 4) + body


class _Series:
    """One metric's per-layer values of a layout as ``Summary.value`` bytes, built with numpy.

    A template holds every layer's entry with a zero float; a record's floats are written into
    their four-byte slots and the layers it does not show are masked out: no Python object per
    layer (the writer thread shares the interpreter, and its garbage collector, with training).
    """

    def __init__(self, tags: list[str]) -> None:
        prefixes = [_value_prefix(tag) for tag in tags]
        self.lengths = np.asarray([len(p) + 4 for p in prefixes], dtype=np.int64)
        self.template = np.frombuffer(b"".join(p + bytes(4) for p in prefixes), dtype=np.uint8).copy()
        self.slots = (np.cumsum(self.lengths) - 4)[:, None] + np.arange(4)

    def encode(self, values: np.ndarray, shown: np.ndarray) -> bytes:
        """The entries of the shown layers, in layer order."""
        buf = self.template.copy()
        buf[self.slots] = np.ascontiguousarray(values, dtype="<f4").view(np.uint8).reshape(-1, 4)
        return buf.tobytes() if shown.all() else buf[np.repeat(shown, self.lengths)].tobytes()


def _event(wall_time: float, step: int, summary: bytes) -> bytes:
    """A serialized ``Event`` ``{wall_time (1, double), step (2, int64), summary (5, Summary)}``."""
    head = b"\x09" + struct.pack("<d", wall_time) + (b"\x10" + _varint(step) if step > 0 else b"")
    return head + b"\x2a" + _varint(len(summary)) + summary


class TensorBoard:
    """Writes per-layer metrics on logged steps and global scalars on every step."""

    def __init__(self, run_dir: Path, purge_step: int | None = None) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._file = EventFile(run_dir, last=purge_step is not None)
        if purge_step is not None:  # a resumed run: TensorBoard drops the earlier files' events from this step on
            # twice: the reader of TensorBoard's server (plugin_event_accumulator) takes a run's first START
            # for the start of its first session, not a restart, and the earlier files have none
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            for _ in range(2):
                self._file.write(self._event(wall_time=time.time(), step=purge_step, session_log=start))
        self._file.write(self._event(wall_time=time.time(), step=0, summary=custom_scalars()))
        self._file.flush()
        self._run = run_dir
        self._full = False
        self._tags: dict[tuple[int, str], _Series] = {}
        self._globals: dict[str, bytes] = {}
        self._findings: set[int | None] = set()

    def write(self, records: Sequence[StepRecord]) -> None:
        """Write one event per record holding all of its values, then flush (skipped while the disk is full)."""
        try:
            self._write(records)
        except OSError as exc:
            self._skipped(exc)

    def _skipped(self, exc: OSError) -> None:
        """A full disk: the events of this batch are skipped (the run store holds its records), the file kept whole."""
        if not disk_full(exc):
            raise exc
        self._file.rewind()
        if not self._full:
            self._full = True
            log.warning("gradwatch: the disk under %s is full (%s): TensorBoard events are skipped until space "
                        "returns; the run store keeps the records", self._run, exc.strerror or exc)

    def _write(self, records: Sequence[StepRecord]) -> None:
        f32, top = struct.Struct("<f").pack, 3.4028234663852886e38  # a finite scalar beyond float32's: its end
        pack = lambda v: f32(min(max(v, -top), top) if math.isfinite(v) else v)  # noqa: E731
        for rec in records:
            parts = [] if rec.flight else [self._global(k) + pack(v) for k, v in rec.scalars.items()]
            if rec.skipped and not rec.flight:
                parts.append(self._global("skipped") + pack(1.0))
            if rec.logged:
                for (scope, metric), vec in rec.vectors.items():
                    if scope != LAYER:
                        continue
                    shown = present(rec, scope, metric)
                    if metric == "grad_nonfinite":
                        shown &= vec != 0  # a flat zero series per layer is noise; the store keeps it
                    if shown.any():
                        parts.append(self._series(rec, metric).encode(vec, shown))
            self._file.write_bytes(_event(rec.time, rec.step, b"".join(parts)))
        self._file.flush()
        self._full = False

    def _global(self, name: str) -> bytes:
        prefix = self._globals.get(name)
        if prefix is None:
            prefix = self._globals[name] = _value_prefix(f"global/{name}")
        return prefix

    def write_findings(self, findings: Sequence[Finding]) -> None:
        """Findings as text (tag ``findings``), new ones only (updated repeat counts are not)."""
        from tensorboard.plugins.text.summary_v2 import text_pb

        fresh = [f for f in findings if f.id not in self._findings]  # others: updates of a count or outcome
        try:
            for f in fresh:
                where = f" `{f.layer}`" if f.layer else ""
                action = f" → **{f.action}**" if f.action else ""
                text = f"**{f.severity}** `{f.kind}`{where}: {f.message}{action}"
                self._file.write(self._event(wall_time=time.time(), step=f.step, summary=text_pb("findings", text)))
            self._file.flush()
        except OSError as exc:
            self._skipped(exc)
            return
        self._findings.update(f.id for f in fresh)

    def _series(self, rec: StepRecord, metric: str) -> _Series:
        key = (rec.layout.version, metric)
        series = self._tags.get(key)
        if series is None:
            series = self._tags[key] = _Series([f"{metric}/{name}" for name in rec.layout.layers])
        return series

    def close(self, status: str) -> None:
        """Flush and close the event file."""
        self._file.close()
