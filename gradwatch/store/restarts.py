"""Store reader, restarts: where a resumed run's later processes took over, and what they superseded."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from gradwatch.store import decode

#: the columns of :meth:`Restarts.superseded` by table (the findings' as :meth:`Run.findings` names them)
SUPERSEDED_COLUMNS = {
    "steps": ["step", "time", "logged", "sampled", "skipped"],
    "scalars": ["step", "name", "value"],
    "findings": ["step", "kind", "severity", "layer", "phase", "message", "action"],
}


class Restarts:
    """The restarts half of :class:`gradwatch.store.reader.Run` (see :mod:`gradwatch.store.resume`)."""

    _db: Path
    _conn: sqlite3.Connection

    def _query(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError  # Run's

    @property
    def restarts(self) -> list[dict[str, Any]]:
        """The run's restarts (``gw.watch(..., resume=True)``), in order; empty for a run never resumed.

        Each is ``restart`` (1, 2 ...), ``step`` (the first step the resumed process recorded),
        ``time``, ``pid``, ``host``, ``superseded`` (how many stored steps of the earlier process, at
        ``step`` and later, it superseded), ``previous_status`` (the run's status when it resumed:
        ``running`` for a process that was killed) and ``layout_changed``. The run's series and
        findings are one continuous history: the superseded rows are read with :meth:`superseded`.
        """
        if not self.has_table("restarts"):
            return []
        rows = self._query("SELECT restart, step, time, pid, host, superseded, previous_status, layout_changed "
                           "FROM restarts ORDER BY restart")
        out = []
        for number, step, at, pid, host, superseded, previous, changed in rows:
            with decode.decoding(self._db, "the restarts"):
                out.append({"restart": decode.integer(self._db, "a restart", number),
                            "step": decode.integer(self._db, "a restart's step", step), "time": float(at),
                            "pid": pid if isinstance(pid, int) else None,
                            "host": host if isinstance(host, str) else None,
                            "superseded": decode.integer(self._db, "a restart's superseded steps", superseded),
                            "previous_status": previous if isinstance(previous, str) else None,
                            "layout_changed": bool(changed)})
        return out

    def superseded(self, table: str = "scalars") -> pd.DataFrame:
        """Rows of the earlier processes that a restart superseded (kept, not deleted), with the
        ``restart`` that superseded them: ``table`` is ``"steps"``, ``"scalars"`` (step, metric,
        value) or ``"findings"`` (the columns of :meth:`findings`). Empty for a run never resumed.
        """
        columns = SUPERSEDED_COLUMNS
        if table not in columns:
            raise ValueError(f"superseded() reads 'steps', 'scalars' or 'findings', not {table!r}")
        names = ["restart", *columns[table]]
        if not self.has_table(f"superseded_{table}"):
            rows: list[tuple[Any, ...]] = []
        else:
            rows = self._query(f"SELECT {', '.join(names)} FROM superseded_{table} ORDER BY restart, step")
        frame = pd.DataFrame(rows, columns=names)
        if table == "scalars":
            frame = frame.rename(columns={"name": "metric"})
            frame["value"] = pd.to_numeric(frame["value"]).astype("float64")
        for column in ("restart", "step"):
            frame[column] = frame[column].astype("int64")
        if table == "steps":
            for column in ("logged", "sampled", "skipped"):
                frame[column] = frame[column].astype(bool)
        return frame

    def restart_count(self) -> int:
        """How many times the run resumed (one cheap count, for live readers)."""
        return int(self._query("SELECT COUNT(*) FROM restarts")[0][0]) if self.has_table("restarts") else 0

    def has_table(self, name: str) -> bool:
        """Whether the store has table ``name`` (the restarts' tables exist once a run has resumed)."""
        return bool(self._query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)))
