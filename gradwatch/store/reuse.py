"""Store reuse: what a new run does with a run directory that already holds a run."""

from __future__ import annotations

import json
import platform
import sqlite3
from pathlib import Path

from gradwatch.errors import RunError
from gradwatch.store.lock import running
from gradwatch.store.schema import DB_NAME

#: files of a run that belong to the store being replaced (the TensorBoard files are matched apart)
RUN_FILES = (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm", "verdict.json", "report.html")


def _held(db: Path) -> tuple[str, int, int | None, str | None] | None:
    """(status, steps, pid, host) of the stored run, or None when the store cannot be read."""
    try:
        conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=5.0)
        try:
            meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('status', 'pid', 'host')"))
            (steps,), = conn.execute("SELECT COUNT(*) FROM steps")
        finally:
            conn.close()
        status = json.loads(meta.get("status", '"unknown"'))
        pid, host = (json.loads(meta[k]) if k in meta else None for k in ("pid", "host"))
    except (sqlite3.Error, ValueError):
        return None
    return str(status), int(steps), pid if isinstance(pid, int) else None, host if isinstance(host, str) else None


def _writing(pid: int | None, host: str | None) -> bool:
    """Whether the process that created the run provably still runs (on this machine)."""
    return pid is not None and host == platform.node() and running(pid)


def claim(run_dir: Path, *, overwrite: bool) -> None:
    """Make ``run_dir`` ready for a new store, or raise RunError saying why it cannot be used.

    - no store there: nothing to do;
    - a store that a live process on this machine is writing: refused, even with ``overwrite``;
    - a store with no recorded step (a script that stopped before its first optimizer step):
      replaced, since there is nothing in it to lose;
    - any other run (finished, halted, crashed with steps, being written on another machine, or
      unreadable): refused unless ``overwrite``, then replaced.

    Replacing removes the store, its TensorBoard event files, ``verdict.json`` and ``report.html``.
    """
    db = run_dir / DB_NAME
    if not db.exists():
        return
    held = _held(db)
    if held is not None:
        status, steps, pid, host = held
        if status == "running" and _writing(pid, host):
            raise RunError(
                f"run directory {str(run_dir)!r} holds a run that process {pid} is still writing; "
                "pass a new run= path, or stop that process first"
            )
        empty = steps == 0 and not (status == "running" and host != platform.node())
        if not empty and not overwrite:
            raise RunError(
                f"run directory {str(run_dir)!r} already holds a run ({status}, {steps} "
                f"step{'s' * (steps != 1)}); pass a new run= path, or overwrite=True to replace it"
            )
    elif not overwrite:
        raise RunError(
            f"run directory {str(run_dir)!r} already holds a run store that cannot be read; pass a new "
            "run= path, or overwrite=True to replace it"
        )
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for old in run_dir.glob("events.out.tfevents.*"):
        old.unlink()
