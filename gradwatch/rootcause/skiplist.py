"""Skip list (act stage): the samples that findings blamed and a rule left out, kept in the run folder.

The file ``skip_samples.txt`` in the run directory holds one sample id per line, as JSON (``17``
or ``"img_0042"``); lines that are empty or start with ``#`` are ignored. ``watcher.batches(loader)``
leaves those samples out of the batches it draws, and a later run can start from the same list
(``watcher.batches(loader, skip="runs/exp1")``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Hashable, Iterable, Iterator
from pathlib import Path
from typing import Any

from gradwatch.errors import ConfigError

FILE = "skip_samples.txt"


def _file(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    return p / FILE if p.is_dir() else p


def read(path: str | os.PathLike[str]) -> list[Any]:
    """The ids in a skip list: a run directory (its ``skip_samples.txt``) or the file itself.

    Raises:
        ConfigError: the file does not exist or a line is not a JSON number or string.
    """
    file = _file(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the skip list {str(file)!r}: {exc.strerror or exc}") from exc
    out = []
    for n, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{str(file)!r}, line {n}: a sample id must be a JSON number or string "
                              f"(17 or \"img_0042\"), got {text!r}")
        out.append(value)
    return out


class SkipList:
    """The samples to leave out, written to ``folder/skip_samples.txt`` as they are added.

    Args:
        folder: the run directory (None: kept in memory only).
    """

    def __init__(self, folder: Path | None = None) -> None:
        self.file = folder / FILE if folder is not None else None
        self._ids: dict[Hashable, None] = {}

    def __contains__(self, sample: object) -> bool:
        try:
            return sample in self._ids
        except TypeError:  # an unhashable id is never in the list
            return False

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._ids))

    def __bool__(self) -> bool:
        return bool(self._ids)

    def extend(self, ids: Iterable[Any], *, write: bool = True) -> list[Any]:
        """Add ids; the new ones are appended to the file (with ``write``). Returns the new ones."""
        new = [i for i in ids if i is not None and isinstance(i, Hashable) and i not in self._ids]
        for i in new:
            self._ids[i] = None
        if new and write and self.file is not None:
            with self.file.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(i) + "\n" for i in new)
                f.flush()
                os.fsync(f.fileno())
        return new

    def load(self, source: str | os.PathLike[str] | Iterable[Any]) -> None:
        """Also leave out another list's samples: a run directory, a skip file, or ids (written to this
        run's file too, so that it names every sample the run left out).
        """
        ids = read(source) if isinstance(source, (str, os.PathLike)) else list(source)
        self.extend(ids)
