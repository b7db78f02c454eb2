"""Runs under a folder: where they are and one summary row each (``gradwatch ls``, the dashboard)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradwatch.errors import DamagedStoreError, GradwatchError
from gradwatch.store import verdict
from gradwatch.store.findings import rank
from gradwatch.store.reader import open_run
from gradwatch.store.schema import DB_NAME


def find_runs(root: Path) -> list[Path]:
    """Run directories under ``root`` (itself included, and the runs nested inside a run), in path order."""
    return sorted(p.parent for p in root.rglob(DB_NAME) if p.is_file())


def updated(run_dir: Path) -> float:
    """When the run's store last changed (its WAL included)."""
    times = []
    for p in (run_dir / DB_NAME, run_dir / f"{DB_NAME}-wal"):
        try:
            times.append(p.stat().st_mtime)
        except OSError:  # no WAL (a closed run), or removed meanwhile
            pass
    return max(times, default=0.0)


def describe_run(run_dir: Path, root: Path) -> dict[str, Any]:
    """One row of ``gradwatch ls``: name, steps, status (``ended``: how, ``status_detail``: for people),
    verdict, counts, last update.

    A run that cannot be read has status ``damaged`` (its store is corrupted or holds values its
    writer could not have written) or ``unreadable`` (anything else), and its ``error``.
    """
    name = str(run_dir.relative_to(root)) if run_dir != root else str(run_dir)
    row: dict[str, Any] = {"run": name if name != "." else str(run_dir), "path": str(run_dir),
                           "updated": updated(run_dir)}
    try:
        with open_run(run_dir) as run:
            counts = run.findings()["severity"].value_counts().to_dict()
            worst = max(counts, key=rank, default=None)
            ended = run.ended
            row.update(steps=run.steps, status=ended["status"], ended=ended, status_detail=verdict.describe(ended),
                       worst=worst, findings={s: int(counts.get(s, 0)) for s in ("info", "warning", "error")})
    except GradwatchError as exc:  # one run that cannot be read never stops the others from being listed
        status = "damaged" if isinstance(exc, DamagedStoreError) else "unreadable"
        row.update(steps=None, status=status, worst=None, findings=None, error=str(exc))
    except Exception as exc:  # a damage the reader does not know yet: still one row, never a failed listing
        row.update(steps=None, status="unreadable", worst=None, findings=None,
                   error=f"the run store of {name!r} cannot be read: {type(exc).__name__}: {exc}")
    return row
