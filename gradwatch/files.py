"""Files: writing a text file atomically (a reader never sees it half-written)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from gradwatch.errors import GradwatchError


def write_text_atomic(path: Path, text: str, what: str = "the file") -> None:
    """Write ``text`` through a temporary file in the same folder, fsync it, then rename it into place.

    Missing folders on the way to ``path`` are created.

    Raises:
        GradwatchError: the file cannot be written (``what`` names it in the message); no
            temporary file is left behind.
    """
    folder = path.parent if str(path.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise GradwatchError(f"cannot write {what} to {str(path)!r}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as an ordinary file would be, not mkstemp's 0600
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise GradwatchError(f"cannot write {what} to {str(path)!r}: {exc.strerror or exc}") from None
