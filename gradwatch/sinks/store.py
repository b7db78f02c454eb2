"""Store sink: step records into the run's SQLite store."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gradwatch.findings import Finding
from gradwatch.records import StepRecord
from gradwatch.store.writer import StoreWriter


class Store:
    """Writes records to the run store created by :func:`gradwatch.store.create_store`."""

    def __init__(self, db: Path) -> None:
        self._writer = StoreWriter(db)

    def write(self, records: Sequence[StepRecord]) -> None:
        """Append records in one transaction."""
        self._writer.write(records)

    def write_findings(self, findings: Sequence[Finding]) -> None:
        """Insert findings, or update those written before (same id), in one transaction."""
        self._writer.write_findings(findings)

    def write_meta(self, values: dict[str, object]) -> None:
        """Record run metadata (replacing earlier values of the same keys)."""
        self._writer.set_meta(**values)

    def close(self, status: str) -> None:
        """Write the final status and close the database."""
        self._writer.close(status)
