"""Store writer: creates a run's SQLite store and appends step records in batched transactions."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gradwatch.errors import RunError
from gradwatch.findings import Finding
from gradwatch.records import LAYER, PARAM, Layout, StepRecord, present
from gradwatch.store.reuse import claim
from gradwatch.store.schema import DB_NAME, DDL, SCHEMA_VERSION, pack


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA page_size=16384")  # packed vectors are a few KB; large pages waste less
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def create_store(run_dir: Path, meta: Mapping[str, Any], *, overwrite: bool) -> Path:
    """Create (or, with ``overwrite``, replace) the store of a run; raise RunError if impossible.

    Runs in the caller's thread, before any training state is touched, so that a run path that
    cannot be created or written fails at ``gw.watch`` with a clear message.
    """
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunError(
            f"cannot create run directory {str(run_dir)!r}: {exc.strerror or exc}; "
            "pass run= a directory you can write to"
        ) from None
    db = run_dir / DB_NAME
    claim(run_dir, overwrite=overwrite)  # a run already there: replaced, or a RunError saying why not
    try:
        conn = _connect(db)
        with conn:
            conn.executescript(DDL)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            rows = {"schema_version": SCHEMA_VERSION, "status": "running", **meta}
            conn.executemany(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                [(k, json.dumps(v)) for k, v in rows.items()],
            )
        conn.close()
    except sqlite3.Error as exc:
        raise RunError(f"cannot write the run store in {str(run_dir)!r}: {exc}") from None
    return db


class StoreWriter:
    """Appends records to a store; used only from the writer thread."""

    def __init__(self, db: Path) -> None:
        self._conn = _connect(db)
        self._layouts: set[int] = set()

    def write(self, records: Iterable[StepRecord]) -> None:
        """Write a batch of records in one transaction."""
        steps: list[tuple[Any, ...]] = []
        scalars: list[tuple[Any, ...]] = []
        vectors: list[tuple[Any, ...]] = []
        conn = self._conn
        conn.execute("BEGIN")
        try:
            for rec in records:
                if rec.layout.version not in self._layouts:
                    self._write_layout(rec.layout, rec.step)
                steps.append((rec.step, rec.time, rec.layout.version, rec.logged, rec.sampled, rec.skipped))
                scalars.extend((k, rec.step, _real(v)) for k, v in rec.scalars.items())
                if rec.logged:
                    for (scope, metric), values in rec.vectors.items():
                        if scope == PARAM and not rec.detail:
                            continue
                        codec, data, mask = pack(values, present(rec, scope, metric))
                        vectors.append((scope, metric, rec.step, rec.layout.version, codec, data, mask))
            conn.executemany("INSERT OR REPLACE INTO steps VALUES (?, ?, ?, ?, ?, ?)", steps)
            conn.executemany("INSERT OR REPLACE INTO scalars VALUES (?, ?, ?)", scalars)
            conn.executemany("INSERT OR REPLACE INTO vectors VALUES (?, ?, ?, ?, ?, ?, ?)", vectors)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def write_findings(self, findings: Iterable[Finding]) -> None:
        """Insert (or replace, by id) findings in one transaction."""
        rows = [
            (f.id, f.step, f.kind, f.severity, f.layer, f.phase, f.message, f.action,
             finding_json(f.data), time.time())
            for f in findings
        ]
        with self._conn:
            self._conn.executemany("INSERT OR REPLACE INTO findings VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def _write_layout(self, layout: Layout, step: int) -> None:
        leaves = set(layout.leaves)
        rows = [
            (layout.version, LAYER, i, name, typ, n, i in leaves)
            for i, (name, typ, n) in enumerate(zip(layout.layers, layout.layer_types, layout.layer_numel))
        ]
        rows += [
            (layout.version, PARAM, i, name, "Parameter", n, False)
            for i, (name, n) in enumerate(zip(layout.params, layout.param_numel))
        ]
        extra = {"owners": layout.owners, "saturating": layout.saturating, "trainable": layout.trainable}
        self._conn.execute("INSERT OR IGNORE INTO layouts VALUES (?, ?)", (layout.version, step))
        self._conn.execute("INSERT OR REPLACE INTO layout_info VALUES (?, ?)", (layout.version, json.dumps(extra)))
        self._conn.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
        self._layouts.add(layout.version)

    def set_meta(self, **values: Any) -> None:
        """Update run metadata (status, finish time ...)."""
        with self._conn:
            self._conn.executemany(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                [(k, json.dumps(v)) for k, v in values.items()],
            )

    def close(self, status: str) -> None:
        """Record the final status and leave a single, self-contained database file."""
        self.set_meta(status=status, finished=time.time())
        try:
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._conn.execute("PRAGMA journal_mode=DELETE")
        except sqlite3.OperationalError:
            pass  # a reader holds the WAL open; it stays in WAL mode, which readers handle too
        self._conn.close()


def finding_json(data: Mapping[str, Any]) -> str:
    """A finding's data as the JSON the store keeps (numpy numbers as numbers, other objects as text).

    Raises:
        TypeError, ValueError: data that JSON cannot hold (a key that is not a string or a
            number, a reference cycle).
    """
    return json.dumps(data, default=_plain, allow_nan=True)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _real(value: float) -> float | None:
    """SQLite stores NaN as NULL; keep infinities, map NaN to a NULL the reader turns back into NaN."""
    return None if isinstance(value, float) and math.isnan(value) else value


def default_meta() -> dict[str, Any]:
    """Metadata every run records about the process that wrote it."""
    import platform

    import torch

    from gradwatch.version import __version__

    return {
        "gradwatch_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "host": platform.node(),
        "pid": os.getpid(),
        "created": time.time(),
    }
