"""Store resume: a run continued by a later process (``gw.watch(..., resume=True)``) after a restart.

A job restarted from a checkpoint of step N continues the run it was writing: the steps it trains
are numbered from N on. What the earlier process recorded for steps N and later is *superseded*:
its rows move, in the transaction that records the restart, from ``steps``, ``scalars``,
``vectors`` and ``findings`` into the tables of the same name prefixed ``superseded_``, each row
with the number of the restart that superseded it. Nothing is deleted, and the run's own tables
keep one continuous history, which every reader (and gradwatch versions that know nothing of
restarts) reads as before. The ``restarts`` table has one row per restart: its number (1, 2 ...),
the step it continues from, its time, the process, how many stored steps it superseded and
whether the model's layout changed. Stores without these tables (every run that never resumed)
need no migration: the tables are created by the first restart.
"""

from __future__ import annotations

import json
import os
import platform
import sqlite3
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradwatch.errors import RunError
from gradwatch.store import lock as run_lock
from gradwatch.store.records import LAYER, PARAM, Layout
from gradwatch.store.reuse import _held, _writing
from gradwatch.store.schema import DB_NAME, SCHEMA_VERSION
from gradwatch.store.writer import _connect, _holds_no_run, rollback

#: the tables a restart creates (``IF NOT EXISTS``: a second restart finds them)
RESUME_DDL = """
CREATE TABLE IF NOT EXISTS restarts (
    restart INTEGER PRIMARY KEY, step INTEGER NOT NULL, time REAL NOT NULL, pid INTEGER, host TEXT,
    superseded INTEGER NOT NULL, previous_status TEXT, layout_changed INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS superseded_steps (
    restart INTEGER NOT NULL, step INTEGER NOT NULL, time REAL NOT NULL, layout INTEGER NOT NULL,
    logged INTEGER NOT NULL, sampled INTEGER NOT NULL, skipped INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS superseded_scalars (
    restart INTEGER NOT NULL, name TEXT NOT NULL, step INTEGER NOT NULL, value REAL
);
CREATE TABLE IF NOT EXISTS superseded_vectors (
    restart INTEGER NOT NULL, scope TEXT NOT NULL, metric TEXT NOT NULL, step INTEGER NOT NULL,
    layout INTEGER NOT NULL, codec INTEGER NOT NULL, data BLOB NOT NULL, mask BLOB
);
CREATE TABLE IF NOT EXISTS superseded_findings (
    restart INTEGER NOT NULL, id INTEGER NOT NULL, step INTEGER NOT NULL, kind TEXT NOT NULL,
    severity TEXT NOT NULL, layer TEXT, phase TEXT, message TEXT NOT NULL, action TEXT, data TEXT,
    time REAL NOT NULL
);
"""

#: the run's tables whose rows a restart supersedes, with their columns in order
SUPERSEDED = {
    "steps": "step, time, layout, logged, sampled, skipped",
    "scalars": "name, step, value",
    "vectors": "scope, metric, step, layout, codec, data, mask",
    "findings": "id, step, kind, severity, layer, phase, message, action, data, time",
}

#: metadata of the earlier process that the resuming one replaces (its own is written over the rest)
_KEPT_META = ("created",)


@dataclass
class Restart:
    """What a resumed run's process needs from the stored run.

    Attributes:
        restart: the number of this restart (1 for the first).
        step: the first step this process records (steps are numbered from it).
        superseded: how many stored steps (``step`` and later) it superseded.
        previous_status: the stored status when it resumed (``running`` for a killed process).
        version: the layout version this process's layout takes: the last kept step's when the
            layout is the same and no later version is stored, else a new one.
        changed: when the layout differs from the last kept step's, ``{"added": [...],
            "removed": [...], "changed": [...]}`` (layers and parameters; changed: another type or
            size); None when it is the same (or nothing was kept to compare with).
        next_finding: the id this process's first finding takes (ids go on from the stored ones).
        counts: the kept findings by severity (with their folded repeats, as the judge counts), and
            ``worst`` their worst severity (None: none).
    """

    restart: int
    step: int
    superseded: int
    previous_status: str
    version: int
    changed: dict[str, list[str]] | None
    next_finding: int
    counts: dict[str, int] = field(default_factory=lambda: {"info": 0, "warning": 0, "error": 0})
    worst: str | None = None


def stored(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run store that a resume would continue (not one whose creation was
    interrupted: that holds no run, and a new run is created there).
    """
    db = run_dir / DB_NAME
    return db.is_file() and not _holds_no_run(db)


def next_step(run_dir: Path) -> int:
    """The step after the last one stored (0 for a run without steps, or no readable run)."""
    try:
        conn = sqlite3.connect(f"{(run_dir / DB_NAME).resolve().as_uri()}?mode=ro", uri=True, timeout=30.0)
        try:
            (last,), = conn.execute("SELECT MAX(step) FROM steps")
        finally:
            conn.close()
    except sqlite3.Error:
        return 0
    return int(last) + 1 if isinstance(last, int) else 0


def resume_store(run_dir: Path, meta: Mapping[str, Any], start_step: int | None, layout: Layout) -> Restart:
    """Continue the run stored in ``run_dir`` from ``start_step`` (None: after its last stored step)
    with a model of ``layout`` (its version is decided here: :attr:`Restart.version`).

    Takes the run's lock (a run whose writer still runs is refused, whatever its status) and, in
    one transaction, supersedes the stored steps from ``start_step`` on, records the restart and
    writes this process's metadata (``status`` running again; the earlier ``verdict.json``, which
    described the earlier process's end, is removed). The lock stays taken for the store writer.

    Raises:
        RunError: the run is being written, cannot be read, or was written by a newer gradwatch.
    """
    db = run_dir / DB_NAME
    lock = run_lock.acquire(run_dir)
    try:
        held = _held(db)
        if held is None:
            raise RunError(f"run directory {str(run_dir)!r} holds a run store that cannot be read, so it cannot be "
                           "resumed; pass a new run= path, or overwrite=True (without resume) to replace it")
        status, _, pid, host = held
        if status == "running" and _writing(pid, host):
            raise RunError(f"run directory {str(run_dir)!r} holds a run that process {pid} is still writing; "
                           "it can be resumed once that process has ended")
        try:
            restart = _supersede(db, meta, start_step, status, layout)
        except sqlite3.Error as exc:
            raise RunError(f"cannot resume the run in {str(run_dir)!r}: {exc}") from None
        (run_dir / "verdict.json").unlink(missing_ok=True)
    except BaseException:
        run_lock.claim(run_dir)
        lock.release()
        raise
    return restart


def _supersede(db: Path, meta: Mapping[str, Any], start_step: int | None, status: str, layout: Layout) -> Restart:
    conn = _connect(db)
    try:
        (version,), = conn.execute("PRAGMA user_version").fetchall()
        if version > SCHEMA_VERSION:
            raise RunError(f"the run at {str(db.parent)!r} was written with store schema {version}, newer than "
                           f"{SCHEMA_VERSION}: upgrade gradwatch to resume it")
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in RESUME_DDL.split(";"):  # in the transaction: a failed restart leaves no table behind
                if statement.strip():
                    conn.execute(statement)
            (last,), = conn.execute("SELECT MAX(step) FROM steps").fetchall()
            step = (last + 1 if last is not None else 0) if start_step is None else start_step
            (number,), = conn.execute("SELECT COALESCE(MAX(restart), 0) + 1 FROM restarts").fetchall()
            (superseded,), = conn.execute("SELECT COUNT(*) FROM steps WHERE step >= ?", (step,)).fetchall()
            for table, columns in SUPERSEDED.items():
                conn.execute(f"INSERT INTO superseded_{table} (restart, {columns}) "
                             f"SELECT ?, {columns} FROM {table} WHERE step >= ?", (number, step))
                conn.execute(f"DELETE FROM {table} WHERE step >= ?", (step,))
            (kept_layout,), = conn.execute("SELECT layout FROM steps WHERE step < ? ORDER BY step DESC LIMIT 1",
                                           (step,)).fetchall() or [(None,)]
            (layouts,), = conn.execute("SELECT COALESCE(MAX(layout), 0) FROM layouts").fetchall()
            changed = None if kept_layout is None else _difference(conn, int(kept_layout), layout)
            version = int(kept_layout) if kept_layout == layouts and changed is None else int(layouts) + 1
            conn.execute("INSERT INTO restarts (restart, step, time, pid, host, superseded, previous_status, "
                         "layout_changed) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (number, step, time.time(), meta.get("pid"), meta.get("host", platform.node()),
                          superseded, status, changed is not None))
            kept = {k for (k,) in conn.execute("SELECT key FROM meta")} & set(_KEPT_META)
            conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                             [(k, json.dumps(v)) for k, v in {**meta, "status": "running"}.items() if k not in kept])
            conn.execute("DELETE FROM meta WHERE key = 'finished'")
            if changed is not None:
                row = conn.execute("SELECT value FROM meta WHERE key = 'layout_changes'").fetchone()
                changes = _list(row[0]) if row else []
                changes.append({"restart": number, "step": step, **changed})
                conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('layout_changes', ?)",
                             (json.dumps(changes),))
            (next_id,), = conn.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM ("
                                       "SELECT id FROM findings UNION ALL SELECT id FROM superseded_findings)"
                                       ).fetchall()
            counts = {"info": 0, "warning": 0, "error": 0}
            for severity, data in conn.execute("SELECT severity, data FROM findings"):
                if severity in counts:
                    counts[severity] += _repeats(data)
            conn.execute("COMMIT")
        except BaseException:
            rollback(conn)
            raise
    finally:
        conn.close()
    worst = next((s for s in ("error", "warning", "info") if counts[s]), None)
    return Restart(restart=int(number), step=int(step), superseded=int(superseded), previous_status=status,
                   version=version, changed=changed, next_finding=int(next_id), counts=counts, worst=worst)


def _difference(conn: sqlite3.Connection, version: int, layout: Layout) -> dict[str, list[str]] | None:
    """The layers and parameters ``layout`` adds to the stored layout ``version``, removes from it, and
    changes (their type or size) in model order; None when the two are the same.
    """
    stored = {(scope, name): (kind, int(numel)) for scope, name, kind, numel in conn.execute(
        "SELECT scope, name, type, numel FROM entries WHERE layout = ? ORDER BY idx", (version,))}
    now = {(LAYER, n): (t, k) for n, t, k in zip(layout.layers, layout.layer_types, layout.layer_numel)}
    now.update({(PARAM, n): ("Parameter", k) for n, k in zip(layout.params, layout.param_numel)})
    if now == stored:
        return None
    return {"added": [key[1] for key in now if key not in stored],
            "removed": [key[1] for key in stored if key not in now],
            "changed": [key[1] for key, entry in now.items() if key in stored and stored[key] != entry]}


def _repeats(data: Any) -> int:
    """How many occurrences a stored finding stands for (its folded ``repeats``; 1 when it has none)."""
    try:
        value = json.loads(data).get("repeats", 1) if isinstance(data, str) else 1
    except (ValueError, AttributeError):
        return 1
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _list(text: str) -> list[Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return value if isinstance(value, list) else []


def tracker_run(run_dir: Path, tracker: str) -> tuple[str | None, list[dict[str, Any]]]:
    """What a remote tracker's sink (``wandb``, ``mlflow``) needs to continue its run in a resumed run.

    Returns:
        The id of the tracker's run that the run's metadata keeps (``<tracker>_run``; None: none kept),
        and the run's restarts (``restart``, ``step``, ``superseded``, ``previous_status``, in order)
        when the latest is this process's own (empty when this process did not resume the run, or no
        run store can be read there).
    """
    try:
        conn = sqlite3.connect(f"{(run_dir / DB_NAME).resolve().as_uri()}?mode=ro", uri=True, timeout=30.0)
        try:
            found = conn.execute("SELECT value FROM meta WHERE key = ?", (f"{tracker}_run",)).fetchone()
            tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            rows = conn.execute("SELECT restart, step, superseded, previous_status, pid FROM restarts ORDER BY "
                                "restart").fetchall() if "restarts" in tables else []
        finally:
            conn.close()
    except sqlite3.Error:
        return None, []
    run_id = json.loads(found[0]) if found else None
    restarts = [dict(zip(("restart", "step", "superseded", "previous_status"), row[:4])) for row in rows]
    ours = bool(rows) and rows[-1][4] == os.getpid()  # the latest restart is this process's own
    return (run_id if isinstance(run_id, str) else None), (restarts if ours else [])


def keep_tracker_run(run_dir: Path, tracker: str, run_id: str) -> None:
    """Keep the id of the tracker's run in the run's metadata (``<tracker>_run``), for a later resume."""
    conn = _connect(run_dir / DB_NAME)
    try:
        conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (f"{tracker}_run", json.dumps(run_id)))
    finally:
        conn.close()
