"""Writer: one background thread that takes step records off a bounded queue and feeds the sinks."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import warnings
from collections import deque
from collections.abc import Sequence

from gradwatch import guard as entry
from gradwatch import register
from gradwatch.sinks import Sink
from gradwatch.store.findings import Finding
from gradwatch.store.records import StepRecord

log = logging.getLogger("gradwatch")

_STOP = object()
#: how often a training thread waiting on the writer checks that the writer thread is still alive
_POLL = 0.05


class WriterDied(RuntimeError):
    """The writer thread has stopped: nothing submitted can be written any more."""


class _Findings(list):  # type: ignore[type-arg]
    """A batch of findings in the queue (copies: the training thread may update the originals)."""


class _Meta(dict):  # type: ignore[type-arg]
    """Run metadata to record (plain JSON-able values)."""

_BATCH = 512


class Writer:
    """Feeds records to sinks off the training thread, in batches.

    The training thread only calls :meth:`submit` (which waits only when the queue is full) and
    :meth:`flush` (which waits until everything submitted so far is written). The writer thread
    sleeps until ``flush_seconds`` pass, a flush is asked for, or the queue is half full, then
    drains the queue in one batch: no wake-up per step.
    """

    def __init__(self, sinks: Sequence[Sink], *, queue_size: int, flush_seconds: float, name: str,
                 guard: entry.Guard | None = None) -> None:
        self._sinks = list(sinks)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._high_water = max(1, queue_size // 2)
        self._wake = threading.Event()
        self._flush_seconds = flush_seconds
        self._failed: set[int] = set()
        #: warnings the sinks asked for in the writer thread, given in the training thread (its filters apply)
        self._notices: deque[tuple[type[Warning], str]] = deque()
        #: why the writer thread stopped before it was closed (None while it runs, or after close)
        self.died: BaseException | None = None
        # its failure is told in the watching thread (by its guard), and by :class:`WriterDied` to a caller
        guard = guard if guard is not None else entry.Guard(lambda exc, kind, args: None)
        self._thread = register.thread(guard.hook("writer", self._run), f"gradwatch-writer-{name}")

    @property
    def alive(self) -> bool:
        """Whether the writer thread still runs."""
        return self._thread.is_alive()

    def submit(self, record: StepRecord) -> None:
        """Queue one record for writing.

        Raises:
            WriterDied: the writer thread has stopped (the record cannot be written).
        """
        self._put(record)
        if self._queue.qsize() >= self._high_water:
            self._wake.set()

    def unstored(self) -> str | None:
        """Why the findings written so far are not all in the run's store (``"disk full"``, or its store
        sink failed), or None when they are; asked after :meth:`flush`, before a finding is printed.
        """
        for i, sink in enumerate(self._sinks):
            unstored = getattr(sink, "unstored", None)
            if callable(unstored):
                return "the store failed" if i in self._failed else unstored()
        return None

    def submit_findings(self, findings: Sequence[Finding]) -> None:
        """Queue findings (new, or written before and updated) for every sink that takes them."""
        self._put(_Findings([dataclasses.replace(f, data=dict(f.data)) for f in findings]))
        self._wake.set()

    def submit_meta(self, **values: object) -> None:
        """Queue run metadata (e.g. the optimizers found) for every sink that keeps it."""
        self._put(_Meta(values))

    def flush(self, timeout: float | None = None) -> None:
        """Block until every record submitted before this call is written by every sink.

        Returns at once when the writer was closed. Raises :class:`WriterDied` when the writer
        thread stopped on its own: the training thread never waits on a dead writer.
        """
        if self.died is None and not self._thread.is_alive():
            return  # closed: everything was written
        done = threading.Event()
        self._put(done)
        self._wake.set()
        waited = 0.0
        while not done.wait(_POLL):
            waited += _POLL
            if not self._thread.is_alive():
                self._check()
                return
            if timeout is not None and waited >= timeout:
                return
        self._tell()

    def _tell(self) -> None:
        """Give the sinks' warnings, in the calling thread (the training thread, where the user's filters are)."""
        while self._notices:
            category, message = self._notices.popleft()
            warnings.warn(message, category, stacklevel=4)

    def _put(self, item: object) -> None:
        """Queue an item, waiting while the queue is full, but never on a writer thread that stopped."""
        if self._notices:
            self._tell()
        self._check()
        try:  # the usual case: room in the queue, no timed wait
            self._queue.put_nowait(item)
            return
        except queue.Full:
            pass
        while True:
            try:
                self._queue.put(item, timeout=_POLL)
                return
            except queue.Full:
                self._check()

    def _check(self) -> None:
        if self.died is not None or not self._thread.is_alive():
            raise WriterDied(f"the writer thread stopped: {self.died!r}" if self.died is not None
                             else "the writer thread stopped")

    def close(self, status: str) -> None:
        """Write what is queued, close the sinks with the run's final status, stop the thread."""
        while self._thread.is_alive():  # a writer that died is not waited for
            try:
                self._queue.put((_STOP, status), timeout=_POLL)
            except queue.Full:
                continue
            self._wake.set()
            self._thread.join()
        self._tell()

    def _run(self) -> None:
        try:
            self._drain()
        except BaseException as exc:  # anything that kills the thread: the training thread learns of it
            self.died = exc
            raise WriterDied(f"the writer thread stopped: {exc!r}; nothing more is written") from exc

    def _drain(self) -> None:
        while True:
            self._wake.wait(self._flush_seconds)
            self._wake.clear()
            batch: list[StepRecord] = []
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, StepRecord):
                    batch.append(item)
                    if len(batch) >= _BATCH:
                        self._dispatch("write", batch)
                        batch = []
                    continue
                if batch:  # a flush or stop marker: everything before it is written first
                    self._dispatch("write", batch)
                    batch = []
                if isinstance(item, _Findings):
                    self._dispatch("write_findings", item)
                elif isinstance(item, _Meta):
                    self._dispatch("write_meta", item)
                elif isinstance(item, threading.Event):
                    item.set()
                elif isinstance(item, tuple) and item and item[0] is _STOP:
                    self._dispatch("close", item[1])
                    return
            if batch:
                self._dispatch("write", batch)

    def _dispatch(self, method: str, arg: object) -> None:
        for i, sink in enumerate(self._sinks):
            if i in self._failed or not hasattr(sink, method):
                continue
            try:
                getattr(sink, method)(arg)
            except Exception:  # a broken sink must never take training down
                self._failed.add(i)
                log.exception("gradwatch: %s sink failed and is disabled for this run", type(sink).__name__)
            finally:
                take = getattr(sink, "take_notices", None)
                if callable(take):
                    self._notices.extend(take())
