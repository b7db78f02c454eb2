"""Store reader: ``gw.open_run(path)`` opens a run read-only and returns pandas views of it."""

from __future__ import annotations

import math
import os
import sqlite3
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gradwatch.errors import RunError, SchemaError
from gradwatch.store import decode
from gradwatch.store.lock import writer_alive
from gradwatch.store.records import LAYER, PARAM, Layout, StepRecord
from gradwatch.store.restarts import Restarts
from gradwatch.store.schema import DB_NAME, SCHEMA_VERSION
from gradwatch.store.series import Series, bounds, where_clause

FINDING_COLUMNS = ["step", "kind", "severity", "layer", "phase", "message", "action", "data"]
#: findings columns that can be missing (a global finding has no layer): None there, never NaN
_NULLABLE = ("layer", "phase", "action")


def open_run(path: str | os.PathLike[str]) -> Run:
    """Open a run directory (or its ``gradwatch.sqlite``) for reading.

    A run that a watcher of this same process is still writing is flushed first, so that every
    step recorded so far is read; ``run.live`` then tells that it is still being written.

    Raises:
        RunError: the path does not exist, is not a gradwatch run, or cannot be read.
        DamagedStoreError: the store is corrupted, truncated or holds values its writer could not have
            written (also raised by any read that meets such a value later).
        SchemaError: the run was written by a newer gradwatch.
    """
    return Run(path)


class Run(Series, Restarts):
    """A recorded run, read-only; safe to use while the training process is still writing it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        try:
            db = p / DB_NAME if p.is_dir() else p
            if not p.exists():
                raise RunError(f"no run at {str(p)!r}: the path does not exist")
            if not db.is_file() or (p.is_file() and p.name != DB_NAME and not _looks_like_sqlite(p)):
                raise RunError(f"{str(p)!r} is not a gradwatch run: it holds no {DB_NAME}")
        except OSError as exc:
            raise RunError(f"cannot read {str(p)!r}: {exc.strerror or exc}") from None
        self.path = db.parent
        self._db = db
        self._closed = False
        try:
            self._conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=30.0)
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            rows = self._conn.execute("SELECT key, value FROM meta").fetchall() if "meta" in tables else []
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:  # a damaged schema's message may not decode
            raise decode.sqlite_error(db, exc) from None
        if not rows and not (tables - {"meta"}):
            raise RunError(f"{str(p)!r} is not a gradwatch run: its {DB_NAME} holds no run (its creation was "
                           "interrupted); a new run can be written there")
        if version > SCHEMA_VERSION:
            from gradwatch.version import __version__

            raise SchemaError(
                f"the run at {str(self.path)!r} was written with store schema {version}, newer than "
                f"{SCHEMA_VERSION} which gradwatch {__version__} reads; upgrade gradwatch to read it"
            )
        self.meta: dict[str, Any] = decode.meta(db, rows)
        # a run written by this process: flush its writer so that every step recorded so far is read
        # (no registry imported means no watcher in this process, and readers need not import torch)
        registry = sys.modules.get("gradwatch.watching.registry")
        if registry is not None and self.meta.get("status") == "running":
            registry.flush_run(self.path)

    # ----------------------------------------------------------------- metadata
    def __repr__(self) -> str:
        if self._closed:
            return f"Run({str(self.path)!r}, closed)"
        status = self.status
        live = ", live: still being written" if status == "running" else ""
        return f"Run({str(self.path)!r}, steps={self.steps}, status={status!r}{live})"

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the database connection (reading the run afterwards raises :class:`RunError`)."""
        self._conn.close()
        self._closed = True

    def _query(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        try:
            return self._conn.execute(sql, tuple(args)).fetchall()
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:  # a damaged schema's message may not decode
            if self._closed:  # not damaged: read after close() or its ``with`` block
                raise RunError(f"the run at {str(self.path)!r} was closed (by close() or at the end of its "
                               "'with gw.open_run(...)' block): read it inside the block, or open it again") from None
            raise decode.sqlite_error(self._db, exc) from None

    @property
    def status(self) -> str:
        """``running``, ``finished``, ``halted``, ``terminated``, ``exited``, or ``crashed`` (see :attr:`ended`)."""
        row = self._query("SELECT value FROM meta WHERE key = 'status'")
        status = decode.json_text(self._db, "metadata 'status'", row[0][0]) if row else "unknown"
        if not isinstance(status, str):
            raise decode.damaged(self._db, f"metadata 'status' holds {status!r}, not a status")
        if status == "running" and not writer_alive(self.meta.get("pid"), self.meta.get("host")):
            return "crashed"
        return str(status)

    @property
    def ended(self) -> dict[str, Any]:
        """``status``, with the verdict's ``signal``, ``code``, ``message`` or ``exception`` (docs/reading.md)."""
        from gradwatch.store import verdict
        return verdict.ended(self.status, verdict.read(self.path))

    @property
    def live(self) -> bool:
        """Whether a training process is still writing the run (its status is ``running``).

        A live run is read as far as it has been written: the writer commits every
        ``flush_seconds`` (and at once for a watcher of this process when the run is opened), so
        ``steps`` and the frames grow on later reads. Close the watcher (``gw.watcher(model).close()``)
        or let training end to read the finished run.
        """
        return self.status == "running"

    @property
    def verdict(self) -> dict[str, Any] | None:
        """The run's ``verdict.json`` (status, worst severity, finding counts, halt), None while running."""
        from gradwatch.store import verdict

        return verdict.read(self.path)

    @property
    def steps(self) -> int:
        """How many optimizer steps the run recorded."""
        return int(self._query("SELECT COUNT(*) FROM steps")[0][0])

    @property
    def incomplete(self) -> dict[str, Any] | None:
        """The steps a full disk kept out of the store (``reason``, ``missing_steps``, ``steps`` ranges), or None."""
        return decode.incomplete(self._db, self.meta.get("incomplete"))

    def check_vectors(self) -> None:
        """Raise :class:`DamagedStoreError` if a stored vector is not packed as its layout says (a table scan)."""
        decode.packed(self._db, self._query(decode.MISPACKED))

    def progress(self) -> dict[str, Any]:
        """A cheap marker of how far the run has got, for live viewers (a few index lookups).

        Returns ``steps`` (count), ``last_step`` (None before the first), ``row`` (the newest
        stored vector's row id: it grows whenever vectors are written, for any step), ``findings``
        (count), ``status`` and ``restarts`` (count: what was read before a restart is read again).
        """
        (steps, last), = self._query("SELECT COUNT(*), MAX(step) FROM steps")
        (row,), = self._query("SELECT MAX(rowid) FROM vectors")
        (findings,), = self._query("SELECT COUNT(*) FROM findings")
        decode.checked(self._db, "the steps", {"the last step": last})
        return {"steps": int(steps), "last_step": None if last is None else int(last), "row": int(row or 0),
                "findings": int(findings), "status": self.status, "restarts": self.restart_count()}

    def written_since(self, metric: str, row: int = 0, scope: str = LAYER) -> tuple[int, int, int] | None:
        """Vectors of ``metric`` stored after row id ``row`` (see :meth:`progress`), for incremental readers.

        Returns ``(first step, last step, newest row id)`` of those vectors, or None when there are none.
        A vector rewritten for an earlier step (the flight recorder fills in past steps) counts as new.
        """
        if row > 0:
            sql = ("SELECT MIN(step), MAX(step), MAX(rowid) FROM vectors "
                   "WHERE rowid > ? AND scope = ? AND metric = ?")
            args: tuple[Any, ...] = (row, scope, metric)
        else:
            sql = "SELECT MIN(step), MAX(step), MAX(rowid) FROM vectors WHERE scope = ? AND metric = ?"
            args = (scope, metric)
        (first, last, newest), = self._query(sql, args)
        decode.checked(self._db, f"the vectors of {metric!r}", {"a step": first, "the last step": last})
        return None if first is None else (int(first), int(last), int(newest))

    def records(self, chunk: int = 1000, steps: slice | None = None) -> Iterator[StepRecord]:
        """Replay the stored steps as step records, in step order (for detectors run offline).

        Vectors exist on the steps they were written for (logged steps; per-parameter vectors
        on detailed ones); ``flight`` is never set. Reads ``chunk`` steps at a time, so memory
        stays bounded on long runs; ``steps`` (a ``slice(start, stop)``) reads a range.
        """
        layouts: dict[int, Layout] = {}
        last = self._query("SELECT MAX(step) FROM steps")[0][0]
        if last is None:
            return
        lo, end = bounds(steps, decode.integer(self._db, "the last step", last) + 1)
        for start in range(lo, end, chunk):
            where, args = where_clause("name", None, window := slice(start, min(start + chunk, end)))
            scalars: dict[int, dict[str, float]] = {}
            with decode.decoding(self._db, "the global scalars"):
                for name, step, value in self._query(f"SELECT name, step, value FROM scalars WHERE {where}", args):
                    scalars.setdefault(decode.integer(self._db, "a step", step), {})[name] = (
                        math.nan if value is None else float(value))
            vectors: dict[int, dict[tuple[str, str], np.ndarray]] = {}
            for scope in (LAYER, PARAM):
                for block in self._blocks(scope, None, window):
                    values = np.where(block.present, block.values, np.float32(np.nan))
                    for r, step in enumerate(block.steps.tolist()):
                        vectors.setdefault(step, {})[(scope, block.metric)] = values[r]
            rows = self._query("SELECT step, time, layout, logged, sampled, skipped FROM steps "
                               "WHERE step >= ? AND step < ? ORDER BY step", (window.start, window.stop))
            for step, at, version, logged, sampled, skipped in rows:
                if version not in layouts:
                    layouts[version] = self.layout(decode.integer(self._db, "a step's layout", version))
                vecs = vectors.get(step, {})
                with decode.decoding(self._db, "the steps"):
                    record = StepRecord(step=decode.integer(self._db, "a step", step), time=float(at),
                                        layout=layouts[version], scalars=scalars.get(step, {}), vectors=vecs,
                                        skipped=bool(skipped), logged=bool(logged), sampled=bool(sampled),
                                        detail=any(scope == PARAM for scope, _ in vecs))
                yield record

    # ------------------------------------------------------------------ metrics
    def findings(self) -> pd.DataFrame:
        """Findings in step order: step, kind, severity, layer, phase, message, action, data.

        ``layer`` is None for a global finding (the loss, the global gradient norm), ``phase`` is
        None for every kind but ``nonfinite``, and ``action`` is None where no action was
        recorded: missing values are always None (an ``object`` column), never NaN.
        """
        rows = decode.findings(self._db, self._query(f"SELECT {', '.join(FINDING_COLUMNS)} FROM findings "
                                                     "ORDER BY step, id"))
        frame = pd.DataFrame(rows, columns=FINDING_COLUMNS)
        for column in _NULLABLE:
            frame[column] = pd.Series([r[FINDING_COLUMNS.index(column)] for r in rows], dtype=object)
        frame["data"] = pd.Series([r[-1] for r in rows], dtype=object)  # decoded and checked above
        frame["step"] = frame["step"].astype("int64")
        return frame


def _looks_like_sqlite(path: Path) -> bool:
    with path.open("rb") as fh:
        return fh.read(16) == b"SQLite format 3\x00"

