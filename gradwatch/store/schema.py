"""Store schema: the on-disk format of a run (SQLite), its version, and how vectors are packed."""

from __future__ import annotations

import zlib

import numpy as np

#: bump when the format changes; readers refuse stores with a newer version
SCHEMA_VERSION = 1
DB_NAME = "gradwatch.sqlite"

#: vector codecs: raw little-endian float32, or zlib-compressed float32
RAW, ZLIB = 0, 1

DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS layouts (layout INTEGER PRIMARY KEY, first_step INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    layout INTEGER NOT NULL, scope TEXT NOT NULL, idx INTEGER NOT NULL,
    name TEXT NOT NULL, type TEXT NOT NULL, numel INTEGER NOT NULL,
    leaf INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (layout, scope, idx)
);
CREATE TABLE IF NOT EXISTS layout_info (layout INTEGER PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY, time REAL NOT NULL, layout INTEGER NOT NULL,
    logged INTEGER NOT NULL, sampled INTEGER NOT NULL, skipped INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS scalars (
    name TEXT NOT NULL, step INTEGER NOT NULL, value REAL,
    PRIMARY KEY (name, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS vectors (
    scope TEXT NOT NULL, metric TEXT NOT NULL, step INTEGER NOT NULL, layout INTEGER NOT NULL,
    codec INTEGER NOT NULL, data BLOB NOT NULL, mask BLOB
);
CREATE UNIQUE INDEX IF NOT EXISTS vectors_by_metric ON vectors (scope, metric, step);
CREATE TABLE IF NOT EXISTS findings (
    id INTEGER PRIMARY KEY, step INTEGER NOT NULL, kind TEXT NOT NULL, severity TEXT NOT NULL,
    layer TEXT, phase TEXT, message TEXT NOT NULL, action TEXT, data TEXT, time REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS findings_by_step ON findings (step);
"""


def pack(values: np.ndarray, present: np.ndarray) -> tuple[int, bytes, bytes | None]:
    """Pack a vector into (codec, data, mask); the mask is None when every entry is present."""
    raw = np.ascontiguousarray(values, dtype="<f4").tobytes()
    codec, data = RAW, raw
    if len(raw) >= 64:
        small = zlib.compress(raw, 1)
        if len(small) * 2 <= len(raw):
            codec, data = ZLIB, small
    mask = None if present.all() else np.packbits(present).tobytes()
    return codec, data, mask


def unpack(codec: int, data: bytes, mask: bytes | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack`: (float32 values, boolean presence)."""
    raw = zlib.decompress(data) if codec == ZLIB else data
    values = np.frombuffer(raw, dtype="<f4")
    if mask is None:
        present = np.ones(len(values), dtype=bool)
    else:
        present = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), count=len(values)).astype(bool)
    if len(values) != n:
        raise ValueError(f"vector holds {len(values)} values where its layout has {n}")
    return values, present
