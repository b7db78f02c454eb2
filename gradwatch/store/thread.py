"""Writer: one background thread that takes step records off a bounded queue and feeds the sinks.

The training thread's side of the hand-over is safe against an exception raised at any bytecode (a
signal handler's ``sys.exit``, a Ctrl-C): it only appends to a deque and releases or acquires plain
locks, each one call that happens whole or not at all, and it tells whether the writer thread runs
by a flag that thread clears as it ends. ``queue.Queue`` and ``threading.Event`` take a Python-level
condition's lock in ``__enter__``, and ``Thread.is_alive``/``join`` interrupted at the wrong bytecode
mark a running thread stopped (CPython issue 90882, up to Python 3.12): an exception there left the
queue's lock held (the run's close then hung) or the writer taken for dead (the run was never
closed: its store said ``running``, read as ``crashed``, with no step written).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import warnings
from collections import deque
from collections.abc import Sequence

from gradwatch.sinks import Sink
from gradwatch.store.findings import Finding
from gradwatch.store.records import StepRecord
from gradwatch.watching import guard as entry
from gradwatch.watching import register

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


class _Flush:
    """A flush marker: the writer thread releases ``done`` once everything queued before it is written."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Lock()
        self.done.acquire()


def _signal(lock: threading.Lock) -> None:
    """Wake the one thread waiting to acquire ``lock`` (a binary semaphore: released, or already so)."""
    try:
        lock.release()
    except RuntimeError:  # released already, not yet taken: the waiter wakes once either way
        pass


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
        #: what waits for the writer thread, oldest first: appended by the training thread, taken by the writer
        self._items: deque[object] = deque()
        self._size = max(1, queue_size)
        self._high_water = max(1, queue_size // 2)
        #: binary semaphores (see :func:`_signal`): wake the writer thread; room made in the queue
        self._wake, self._room = threading.Lock(), threading.Lock()
        self._wake.acquire()
        self._room.acquire()
        self._flush_seconds = flush_seconds
        self._failed: set[int] = set()
        #: warnings the sinks asked for in the writer thread, given in the training thread (its filters apply)
        self._notices: deque[tuple[type[Warning], str]] = deque()
        #: why the writer thread stopped before it was closed (None while it runs, or after close)
        self.died: BaseException | None = None
        #: the latest record the writer thread took (the same record handed over twice is written once)
        self._taken: StepRecord | None = None
        #: the writer thread runs: cleared by that thread as it ends, and only there
        self._running = True
        #: released by the writer thread as it ends (what :meth:`close` waits on)
        self._ended = threading.Lock()
        self._ended.acquire()
        # its failure is told in the watching thread (by its guard), and by :class:`WriterDied` to a caller
        guard = guard if guard is not None else entry.Guard(lambda exc, kind, args: None)
        self._thread = register.thread(guard.hook("writer", self._run), f"gradwatch-writer-{name}", ended=self._stopped)

    @property
    def alive(self) -> bool:
        """Whether the writer thread still runs."""
        return self._running

    def submit(self, record: StepRecord) -> None:
        """Queue one record for writing.

        Raises:
            WriterDied: the writer thread has stopped (the record cannot be written).
        """
        self._put(record)
        if len(self._items) >= self._high_water:
            _signal(self._wake)

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
        _signal(self._wake)

    def submit_meta(self, **values: object) -> None:
        """Queue run metadata (e.g. the optimizers found) for every sink that keeps it."""
        self._put(_Meta(values))

    def flush(self, timeout: float | None = None) -> None:
        """Block until every record submitted before this call is written by every sink.

        Returns at once when the writer was closed. Raises :class:`WriterDied` when the writer
        thread stopped on its own: the training thread never waits on a dead writer.
        """
        if self.died is None and not self._running:
            return  # closed: everything was written
        marker = _Flush()
        self._put(marker)
        _signal(self._wake)
        waited = 0.0
        while not marker.done.acquire(timeout=_POLL):
            waited += _POLL
            if not self._running:
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
        while len(self._items) >= self._size:  # full: wake the writer, and wait for the room it makes
            _signal(self._wake)
            self._room.acquire(timeout=_POLL)
            self._check()
        self._items.append(item)  # the hand-over: one call, done whole or not at all

    def _check(self) -> None:
        if self.died is not None or not self._running:
            raise WriterDied(f"the writer thread stopped: {self.died!r}" if self.died is not None
                             else "the writer thread stopped")

    def close(self, status: str) -> None:
        """Write what is queued, close the sinks with the run's final status, stop the thread."""
        if self._running:  # a writer that died is not waited for
            self._items.append((_STOP, status))
            _signal(self._wake)
            while self._running:
                self._ended.acquire(timeout=_POLL)
        self._tell()

    def orphan(self) -> None:
        """In a child forked from the process this writer writes for: its thread is not here (a fork copies only
        the forking thread), so nothing is handed over nor waited for any more (:meth:`flush` and :meth:`close`
        return at once), and the sinks are left as they are, for good.

        The sinks are the parent's: its store's SQLite connection (which SQLite says a forked child must not
        use, closing it included: a close may write to the database file) and its run lock (an ``flock``,
        shared with the parent: unlocked here, it would be unlocked there). Neither is closed, nor freed when
        the child's interpreter ends (one reference more that nothing gives back); the child's copies of their
        file descriptors close as the child exits, which leaves the parent's as they are.
        """
        self._running, self.died = False, None
        self._items.clear()
        self._notices.clear()
        for sink in self._sinks:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(sink))
        self._sinks = []

    def _run(self) -> None:
        try:
            self._drain()
        except BaseException as exc:  # anything that kills the thread: the training thread learns of it
            self.died = exc
            raise WriterDied(f"the writer thread stopped: {exc!r}; nothing more is written") from exc

    def _stopped(self) -> None:
        """The writer thread ends (in it, last): the training thread stops handing it anything."""
        self._running = False
        self._ended.release()

    def _drain(self) -> None:
        while True:
            self._wake.acquire(timeout=self._flush_seconds)
            batch: list[StepRecord] = []
            while True:
                try:
                    item = self._items.popleft()
                except IndexError:
                    break
                if len(self._items) + 1 >= self._size:  # it was full: a producer may wait for room
                    _signal(self._room)
                if isinstance(item, StepRecord):
                    if item is self._taken:  # handed over again (a step's close interrupted after it): once
                        continue
                    self._taken = item
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
                elif isinstance(item, _Flush):
                    item.done.release()
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
