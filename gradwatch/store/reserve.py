"""Reserve: a little disk kept in the run directory while it is written, freed for the final status on a full disk."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

#: the reserve file in the run directory (removed when the run closes)
RESERVE = ".gradwatch-reserve"
#: its size: the final status (a few 16 KB pages of the WAL), the findings held and the verdict
RESERVE_BYTES = 128 << 10


class Reserve:
    """:data:`RESERVE_BYTES` of the run directory's disk, allocated (not sparse) when the writer opens.

    A disk that is still full when the run ends would leave the store saying ``running`` (read as
    ``crashed``); freeing the reserve then makes room for the final status, its ``incomplete`` note
    and the verdict. None is taken where there is no room for it at the start.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path: Path | None = run_dir / RESERVE
        #: the reserve was freed because the disk was full
        self.freed = False
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, RESERVE_BYTES)
                else:  # pragma: no cover - platforms without fallocate: written zeros take their blocks too
                    os.write(fd, bytes(RESERVE_BYTES))
            finally:
                os.close(fd)
        except OSError:
            self.drop()

    def free(self) -> bool:
        """Give the reserve's room back to the disk (it is full); whether there was one to free."""
        if self.path is None:
            return False
        self.drop()
        self.freed = True
        return True

    def drop(self) -> None:
        """Remove the reserve file (when the run closes: it is never left behind)."""
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            self.path = None
