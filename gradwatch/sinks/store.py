"""Store sink: step records into the run's SQLite store, held in memory while the disk is full.

A write that finds the disk (or the quota) full does not disable the sink: what could not be
written is kept, in order, and written as soon as a later write finds room. Findings and metadata
are always kept (they are few: repeats fold into one finding); step records are kept up to
:data:`HOLD_BYTES`, and those beyond are dropped, counted, and recorded in the run's ``incomplete``
metadata when it closes. The writer thread turns the sink's notices into warnings in the training
thread: one when writing starts failing, and one at the end when steps were dropped.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradwatch.errors import DiskFullWarning
from gradwatch.store.findings import Finding
from gradwatch.store.records import StepRecord
from gradwatch.store.writer import StoreWriter, disk_full

log = logging.getLogger("gradwatch")

#: the most memory the step records held while the disk is full may take (their vectors, roughly)
HOLD_BYTES = 64 << 20
#: step records written per transaction while a backlog drains (a disk with a little room takes some)
CHUNK = 64
#: what a finding printed while it is held says (also the ``reason`` of a run's ``incomplete``)
FULL = "disk full"


class Store:
    """Writes records to the run store created by :func:`gradwatch.store.create_store`."""

    def __init__(self, db: Path) -> None:
        self._writer = StoreWriter(db)
        self._run = db.parent
        self._records: deque[tuple[StepRecord, int]] = deque()  # held, oldest first, with their size
        self._held = 0  # bytes held in ``_records``
        self._findings: dict[object, Finding] = {}  # held, by id: the latest version of each
        self._meta: dict[str, object] = {}
        self._dropped: list[list[int]] = []  # steps dropped, as inclusive ranges in arrival order
        self._full = False
        self._warned = False
        self._notices: list[tuple[type[Warning], str]] = []

    # ---------------------------------------------------------------- sink
    def write(self, records: Sequence[StepRecord]) -> None:
        """Append records in one transaction (held when the disk is full)."""
        if self._room():
            try:
                self._writer.write(records)
                return
            except Exception as exc:
                self._failed(exc)
        for rec in records:
            self._hold(rec)

    def write_findings(self, findings: Sequence[Finding]) -> None:
        """Insert findings, or update those written before (same id), in one transaction."""
        if self._room():
            try:
                self._writer.write_findings(findings)
                return
            except Exception as exc:
                self._failed(exc)
        for f in findings:
            self._findings[f.id if f.id is not None else object()] = f

    def write_meta(self, values: dict[str, object]) -> None:
        """Record run metadata (replacing earlier values of the same keys)."""
        if self._room():
            try:
                self._writer.set_meta(**values)
                return
            except Exception as exc:
                self._failed(exc)
        self._meta.update(values)

    def close(self, status: str) -> None:
        """Write what is held, then the final status (and what is missing), and close the database."""
        if self._full:
            self._drain()
        if self._full:  # still full at the end: the room kept for it takes the findings and the final status
            self._writer.reserve.free()
        for rec, _ in self._records:  # the disk is still full: nothing held can be kept any more
            self._drop(rec.step)
        self._records.clear()
        extra: dict[str, Any] = dict(self._meta)
        if self._findings:  # written with the status, or not at all
            try:
                self._writer.write_findings(list(self._findings.values()))
                self._findings.clear()
            except Exception as exc:
                if not disk_full(exc):
                    raise
        missing = self._missing()
        if missing is not None:
            extra["incomplete"] = missing
        try:
            self._writer.close(status, **extra)
        except Exception as exc:
            if not disk_full(exc):
                raise
            self._notices.append((DiskFullWarning, (
                f"gradwatch: the disk under the run {str(self._run)!r} is still full at its end: its final status "
                f"({status!r}) could not be written, so the run reads as 'crashed' once this process ends; "
                + (f"{len(self._findings)} findings were not stored" if self._findings else "its findings are stored")
                + (f", {missing['missing_steps']} steps are missing" if missing else ""))))
            return
        if self._writer.reserve.freed:
            self._notices.append((DiskFullWarning, (
                f"gradwatch: the disk under the run {str(self._run)!r} is still full at its end: its final status "
                f"({status!r}) is written, in the room gradwatch kept for it; "
                + (f"{len(self._findings)} findings were not stored" if self._findings else "its findings are stored")
                + (f"; the run is incomplete: {missing['missing_steps']} steps ({_ranges(missing['steps'])}) "
                   "could not be kept" if missing else ""))))
        elif missing is not None:
            self._notices.append((DiskFullWarning, (
                f"gradwatch: the run {str(self._run)!r} is incomplete: {missing['missing_steps']} steps "
                f"({_ranges(missing['steps'])}) could not be kept while the disk was full (more than "
                f"{_size(HOLD_BYTES)} of records waited for space) and are missing from its store; its findings "
                "are all stored")))

    # --------------------------------------------------- for the writer
    def unstored(self) -> str | None:
        """Why findings written so far are not all in the store (``"disk full"``), or None when they are."""
        return FULL if self._findings else None

    def take_notices(self) -> list[tuple[type[Warning], str]]:
        """The warnings to give the user since the last call (category, message)."""
        out, self._notices = self._notices, []
        return out

    # ---------------------------------------------------------- holding
    def _failed(self, exc: Exception) -> None:
        """A write failed: a full disk starts holding; any other error disables the sink (raised)."""
        if not disk_full(exc):
            raise exc
        self._full = True
        if not self._warned:
            self._warned = True
            self._notices.append((DiskFullWarning, (
                f"gradwatch: the disk under the run {str(self._run)!r} is full ({exc}); training goes on, and "
                f"gradwatch keeps the run's records in memory (up to {_size(HOLD_BYTES)} of steps, every "
                f"finding) and writes them when space returns. Until then a finding is printed with "
                f"'not stored: {FULL}'; steps beyond that memory are dropped and the run is marked incomplete.")))
        else:
            log.warning("gradwatch: the disk under the run %s is full again (%s); holding its records", self._run, exc)

    def _hold(self, rec: StepRecord) -> None:
        size = 256 + 64 * len(rec.scalars) + sum(v.nbytes for v in rec.vectors.values())
        if self._held + size > HOLD_BYTES:
            if not self._dropped:
                log.warning("gradwatch: %s of records wait for space under %s: later steps are dropped "
                            "until space returns (the run will be marked incomplete)", _size(HOLD_BYTES), self._run)
            self._drop(rec.step)
            return
        self._records.append((rec, size))
        self._held += size

    def _drop(self, step: int) -> None:
        last = self._dropped[-1] if self._dropped else None
        if last is not None and last[0] <= step <= last[1] + 1:
            last[1] = max(last[1], step)
        else:
            self._dropped.append([step, step])

    def _room(self) -> bool:
        """Whether the disk takes writes: always while it was not full, else once what is held is written."""
        if self._full:
            self._drain()
        return not self._full

    def _drain(self) -> None:
        """Write what is held, oldest first, for as long as the disk takes it."""
        try:
            if self._findings:
                self._writer.write_findings(list(self._findings.values()))
                self._findings.clear()
            if self._meta:
                self._writer.set_meta(**self._meta)
                self._meta.clear()
            while self._records:
                chunk = [self._records[i] for i in range(min(CHUNK, len(self._records)))]
                self._writer.write([rec for rec, _ in chunk])
                for _ in chunk:
                    self._held -= self._records.popleft()[1]
        except Exception as exc:
            if not disk_full(exc):
                raise
            return
        if self._full:
            self._full = False
            log.warning("gradwatch: space returned under %s: the records held meanwhile are written", self._run)

    def _missing(self) -> dict[str, Any] | None:
        """What the run's store lacks for good: the dropped steps that no later write brought back."""
        if not self._dropped:
            return None
        merged: list[list[int]] = []  # a flight-recorder step dropped again may repeat an earlier range
        for lo, hi in sorted(self._dropped):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        stored = self._writer.stored_steps([(lo, hi) for lo, hi in merged])
        ranges: list[list[int]] = []
        for lo, hi in merged:
            for step in range(lo, hi + 1):
                if step in stored:
                    continue
                if ranges and ranges[-1][1] + 1 == step:
                    ranges[-1][1] = step
                else:
                    ranges.append([step, step])
        if not ranges:
            return None
        return {"reason": FULL, "missing_steps": sum(hi - lo + 1 for lo, hi in ranges), "steps": ranges}


def _ranges(ranges: Sequence[Sequence[int]], most: int = 4) -> str:
    """Step ranges as text: ``31-150, 200``, the first ``most`` of them."""
    text = [f"{lo}-{hi}" if hi > lo else f"{lo}" for lo, hi in ranges[:most]]
    return ", ".join(text) + (f" and {len(ranges) - most} more ranges" if len(ranges) > most else "")


def _size(n: int) -> str:
    return f"{n / (1 << 20):.3g} MB" if n >= 1 << 20 else f"{n / 1024:.3g} KB"
