"""Store writer: creates a run's SQLite store and appends step records in batched transactions."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from gradwatch.errors import RunError
from gradwatch.store import lock as run_lock
from gradwatch.store.findings import Finding
from gradwatch.store.records import LAYER, PARAM, Layout, StepRecord, present
from gradwatch.store.reserve import Reserve
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
    lock = run_lock.acquire(run_dir)  # a run whose writer is alive is never replaced: RunError
    try:
        _remove_unfinished(run_dir)  # what an interrupted creation left: it holds no run
        claim(run_dir, overwrite=overwrite)  # a run already there: replaced, or a RunError saying why not
        _build(db, {"schema_version": SCHEMA_VERSION, "status": "running", **meta})
    except BaseException:
        run_lock.claim(run_dir)
        lock.release()
        raise
    return db


#: a store being created, renamed to :data:`DB_NAME` once complete (``{pid}`` of its creator)
BUILDING = f".{DB_NAME}.{{pid}}.tmp"


def _build(db: Path, meta: Mapping[str, Any]) -> None:
    """Write a new store into a temporary file next to ``db``, then rename it into place.

    A kill at any moment leaves either no store or a complete one, never an empty database.
    """
    tmp = db.with_name(BUILDING.format(pid=os.getpid()))
    try:
        conn = sqlite3.connect(tmp, isolation_level=None)
        try:
            conn.execute("PRAGMA page_size=16384")  # packed vectors are a few KB; large pages waste less
            conn.execute("BEGIN")
            for statement in DDL.split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                             [(k, json.dumps(v)) for k, v in meta.items()])
            conn.execute("COMMIT")
            conn.execute("PRAGMA journal_mode=WAL")  # recorded in the file: every later connection uses it
        finally:
            conn.close()
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, db)
    except (sqlite3.Error, OSError) as exc:
        raise RunError(f"cannot write the run store in {str(db.parent)!r}: {exc}") from None
    finally:
        for leftover in db.parent.glob(f"{tmp.name}*"):
            leftover.unlink(missing_ok=True)


def _remove_unfinished(run_dir: Path) -> None:
    """Remove what an interrupted creation of a store left (with the run's lock held: nobody is creating).

    That is a temporary store of :func:`_build`, or, from gradwatch versions that created the store
    in place, a store file that holds no run: empty, without tables, or with no metadata written.
    """
    for leftover in run_dir.glob(BUILDING.format(pid="*") + "*"):
        leftover.unlink(missing_ok=True)
    db = run_dir / DB_NAME
    if _holds_no_run(db):
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)


def _holds_no_run(db: Path) -> bool:
    """Whether ``db`` is a store whose creation never finished (False when it is absent or unreadable)."""
    try:
        if db.stat().st_size == 0:
            return True
        conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=5.0)
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                return True
            return "meta" in tables and conn.execute("SELECT COUNT(*) FROM meta").fetchone()[0] == 0
        finally:
            conn.close()
    except (OSError, sqlite3.Error, UnicodeDecodeError):  # unreadable: not ours to remove
        return False


class StoreWriter:
    """Appends records to a store; used only from the writer thread.

    It keeps a small reserve file in the run directory while it writes: a disk still full at the run's
    end frees it (``reserve.free()``) so that the final status is written all the same.
    """

    def __init__(self, db: Path) -> None:
        #: the run's lock, taken by create_store: held until this writer closes
        self._lock = run_lock.claim(db.parent)
        try:
            self._conn = _connect(db)
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise
        self._layouts: set[int] = set()
        self.reserve = Reserve(db.parent)

    def write(self, records: Iterable[StepRecord]) -> None:
        """Write a batch of records in one transaction."""
        steps: list[tuple[Any, ...]] = []
        scalars: list[tuple[Any, ...]] = []
        vectors: list[tuple[Any, ...]] = []
        layouts: set[int] = set()  # written in this transaction: known once it commits
        conn = self._conn
        conn.execute("BEGIN")
        try:
            for rec in records:
                if rec.layout.version not in self._layouts | layouts:
                    self._write_layout(rec.layout, rec.step)
                    layouts.add(rec.layout.version)
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
            rollback(conn)
            raise
        self._layouts |= layouts

    def write_findings(self, findings: Iterable[Finding]) -> None:
        """Insert (or replace, by id) findings in one transaction."""
        rows = [
            (f.id, f.step, f.kind, f.severity, f.layer, f.phase, f.message, f.action,
             finding_json(f.data), time.time())
            for f in findings
        ]
        with transaction(self._conn):
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
        extra = {"owners": layout.owners, "saturating": layout.saturating, "trainable": layout.trainable,
                 "eps": layout.eps, "renewed": layout.renewed}
        self._conn.execute("INSERT OR IGNORE INTO layouts VALUES (?, ?)", (layout.version, step))
        self._conn.execute("INSERT OR REPLACE INTO layout_info VALUES (?, ?)", (layout.version, json.dumps(extra)))
        self._conn.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

    def stored_steps(self, ranges: Iterable[tuple[int, int]]) -> set[int]:
        """The steps of these inclusive ranges that the store holds."""
        found: set[int] = set()
        for lo, hi in ranges:
            found.update(r[0] for r in self._conn.execute("SELECT step FROM steps WHERE step BETWEEN ? AND ?",
                                                          (lo, hi)))
        return found

    def set_meta(self, **values: Any) -> None:
        """Update run metadata (status, finish time ...)."""
        with transaction(self._conn):
            self._conn.executemany(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                [(k, json.dumps(v)) for k, v in values.items()],
            )

    def close(self, status: str, **meta: Any) -> None:
        """Record the final status (and ``meta``) and, when no reader holds the store open, leave a single file.

        Never waits for readers: a reader's open transaction leaves the store in WAL mode (which
        readers handle too) instead of stalling the training process's exit. The connection and
        the run's lock are released also when the status cannot be written (a full disk), whose
        error is raised. A full disk frees the reserve first and tries once more; the reserve is
        never left behind.
        """
        try:
            try:
                self.set_meta(status=status, finished=time.time(), **meta)
            except Exception as exc:
                if not disk_full(exc) or not self.reserve.free():
                    raise
                self.set_meta(status=status, finished=time.time(), **meta)
            if self.reserve.freed:
                return  # no room to copy the WAL into the store: it stays in WAL mode (readers handle it)
            try:
                self._conn.execute("PRAGMA busy_timeout=0")  # from here on, a busy store is left as it is
                busy, frames, copied = self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                if busy == 0 and frames == copied:
                    self._conn.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.OperationalError:
                pass  # a reader holds the WAL open, or no room to copy it into the store
        finally:
            try:
                self._conn.close()
            finally:
                self.reserve.drop()
                if self._lock is not None:
                    self._lock.release()


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """One explicit transaction (the connection is in autocommit mode): committed, or rolled back on error."""
    conn.execute("BEGIN")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise


def rollback(conn: sqlite3.Connection) -> None:
    """End a failed transaction, if SQLite has not ended it already (it rolls back on its own after
    some errors, SQLITE_FULL among them: a ROLLBACK then fails with "no transaction is active").
    """
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:  # the transaction's own error is the one that matters
            pass


#: SQLite's primary result code for a full disk (``sqlite3.SQLITE_FULL``, which typeshed lacks)
_SQLITE_FULL = 13


def disk_full(exc: BaseException) -> bool:
    """Whether an error says the disk (or the user's quota) under the store is full."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        if isinstance(code, int):
            return code & 0xFF == _SQLITE_FULL
        return "disk is full" in str(exc)
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


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
