"""Store lock: the process writing a run holds a lock on its directory until its store closes.

The lock is an exclusive ``flock`` on ``gradwatch.lock`` in the run directory. The operating system
releases it when the process ends, however it ends, so a run whose writer is gone (finished,
crashed, killed) can always be replaced, and one whose writer is alive never is — whatever its
metadata says, on whatever machine that shares the folder honours ``flock``.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
from pathlib import Path
from typing import Any

from gradwatch.errors import RunError

if sys.platform != "win32":
    import fcntl

LOCK_NAME = "gradwatch.lock"

#: locks taken by :func:`acquire` that no store writer has claimed yet, by resolved run directory
_pending: dict[Path, RunLock] = {}
_guard = threading.Lock()


class RunLock:
    """A held run lock; :meth:`release` gives it up (idempotent)."""

    def __init__(self, fd: int | None, run_dir: Path) -> None:
        self._fd = fd
        self.run_dir = run_dir

    def release(self) -> None:
        """Unlock and close the lock file (it stays in the run directory, empty of meaning)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if sys.platform != "win32":
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def acquire(run_dir: Path) -> RunLock:
    """Take the lock of ``run_dir`` for this process (already taken and unclaimed: that same lock).

    Raises:
        RunError: another process, or another store writer of this one, holds it: the run is
            being written.
    """
    key = run_dir.resolve()
    with _guard:
        held = _pending.get(key)
    if held is not None:
        return held
    if sys.platform == "win32":  # no flock: the store's recorded pid is the only guard (see store.reuse)
        lock = RunLock(None, run_dir)
    else:
        path = run_dir / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise RunError(f"cannot create the lock file {str(path)!r}: {exc.strerror or exc}; "
                           "pass run= a directory you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunError(
                f"run directory {str(run_dir)!r} is being written by {holder}; a run is never replaced while "
                "its writer runs, not even with overwrite=True: pass a new run= path, or stop that process first"
            ) from None
        except OSError as exc:  # a file system without locks: go on unguarded, as before locks existed
            if exc.errno not in (getattr(os, "ENOLCK", -1), getattr(os, "EOPNOTSUPP", -1), getattr(os, "ENOSYS", -1)):
                os.close(fd)
                raise RunError(f"cannot lock {str(path)!r}: {exc.strerror or exc}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {platform.node()}\n".encode(), 0)
        except OSError:  # the lock holds without the note of who holds it
            pass
        lock = RunLock(fd, run_dir)
    with _guard:
        _pending[key] = lock
    return lock


def claim(run_dir: Path) -> RunLock | None:
    """The lock :func:`acquire` took for ``run_dir``, handed to its store writer (None if none was taken)."""
    with _guard:
        return _pending.pop(run_dir.resolve(), None)


def _holder(fd: int) -> str:
    """Who holds the lock, from the note its holder wrote into the file."""
    try:
        text, host = os.pread(fd, 300, 0).decode("utf-8", "replace").split()[:2]
        pid = int(text)
    except (OSError, ValueError):
        return "another process"
    if pid == os.getpid() and host == platform.node():
        return f"this process (pid {pid}): close the watcher that writes it first (gw.unwatch)"
    return f"another process (pid {pid} on {host})"


def writer_alive(pid: Any, host: Any) -> bool:
    """Whether the writer process still runs (unknown hosts count as alive)."""
    return not isinstance(pid, int) or host != platform.node() or running(pid)


def running(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
