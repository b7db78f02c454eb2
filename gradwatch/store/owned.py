"""Store, owned files: the files of a run directory that its writer owns, which no command writes over.

A command that writes a file (``gradwatch report -o``, ``gradwatch check --output``) refuses a path
that is, or leads through a symbolic link to, one of them: the run store and its WAL, shared-memory
and journal files, the lock, ``verdict.json``, the skip list, TensorBoard event files and rollback
snapshots in a run directory (a folder that holds a run store), or any run store a command reads.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable
from pathlib import Path

from gradwatch.errors import GradwatchError
from gradwatch.store.schema import DB_NAME

#: the names a run directory's own files have: what each is
OWNED = {
    DB_NAME: "the run store",
    f"{DB_NAME}-wal": "the run store's write-ahead log",
    f"{DB_NAME}-shm": "the run store's shared-memory index",
    f"{DB_NAME}-journal": "the run store's journal",
    "gradwatch.lock": "the run's lock",
    "verdict.json": "the run's verdict",
    "skip_samples.txt": "the run's skip list",
    "events.out.tfevents.*": "a TensorBoard event file of the run",
    "snapshot-*.pt": "a rollback snapshot of the run",
    "snapshot-*.pt.tmp": "a rollback snapshot of the run being written",
}


def _resolved(path: Path) -> Path:
    try:
        return Path(os.path.realpath(path))
    except (OSError, ValueError):  # a loop of links, a name the system refuses: compared as written
        return path.absolute()


def owner(path: str | os.PathLike[str], runs: Iterable[str | os.PathLike[str]] = ()) -> str | None:
    """What ``path`` is of a run (``the run store of the run at 'runs/exp1'`` ...), None when it is no run's file.

    Args:
        path: a file a command is about to write (relative, or through links: resolved first).
        runs: the runs (directories or stores) the command reads: their stores are theirs whatever their name.
    """
    target = _resolved(Path(path))
    folder = target.parent
    for run in runs:
        store = _resolved(Path(run))
        store = store / DB_NAME if store.is_dir() else store
        for suffix in ("", "-wal", "-shm", "-journal"):
            if target == store.with_name(store.name + suffix):
                return f"{OWNED[DB_NAME + suffix]} of the run at {str(store.parent)!r}"
    if not (folder / DB_NAME).is_file():
        return None
    for pattern, what in OWNED.items():
        if fnmatch.fnmatchcase(target.name, pattern):
            return f"{what} at {str(folder)!r}"
    return None


def refuse(path: str | os.PathLike[str], what: str, runs: Iterable[str | os.PathLike[str]] = ()) -> None:
    """Refuse to write ``what`` (``the report`` ...) to ``path`` when it is a run's own file.

    Raises:
        GradwatchError: one line naming the file and what it is of which run.
    """
    found = owner(path, runs)
    if found is not None:
        raise GradwatchError(f"refusing to write {what} to {str(path)!r}: it is {found}, which it would destroy; "
                             "choose another output file")
