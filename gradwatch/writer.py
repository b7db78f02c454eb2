"""Writer: one background thread that takes step records off a bounded queue and feeds the sinks."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

from gradwatch.records import StepRecord
from gradwatch.sinks import Sink

log = logging.getLogger("gradwatch")

_STOP = object()
_BATCH = 512


class Writer:
    """Feeds records to sinks off the training thread, in batches.

    The training thread only calls :meth:`submit` (which waits only when the queue is full) and
    :meth:`flush` (which waits until everything submitted so far is written).
    """

    def __init__(self, sinks: Sequence[Sink], *, queue_size: int, flush_seconds: float, name: str) -> None:
        self._sinks = list(sinks)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._flush_seconds = flush_seconds
        self._failed: set[int] = set()
        self._thread = threading.Thread(target=self._run, name=f"gradwatch-writer-{name}", daemon=True)
        self._thread.start()

    def submit(self, record: StepRecord) -> None:
        """Queue one record for writing."""
        self._queue.put(record)

    def flush(self, timeout: float | None = None) -> None:
        """Block until every record submitted before this call is written by every sink."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self, status: str) -> None:
        """Write what is queued, close the sinks with the run's final status, stop the thread."""
        if not self._thread.is_alive():
            return
        self._queue.put((_STOP, status))
        self._thread.join()

    def _run(self) -> None:
        batch: list[StepRecord] = []
        deadline = time.monotonic() + self._flush_seconds
        while True:
            timeout = max(0.0, deadline - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            if isinstance(item, StepRecord):
                batch.append(item)
                if len(batch) < _BATCH and not self._queue.empty():
                    continue
                if len(batch) < _BATCH and time.monotonic() < deadline:
                    continue
            if batch:
                self._dispatch("write", batch)
                batch = []
            deadline = time.monotonic() + self._flush_seconds
            if isinstance(item, threading.Event):
                item.set()
            elif isinstance(item, tuple) and item and item[0] is _STOP:
                self._dispatch("close", item[1])
                return

    def _dispatch(self, method: str, arg: object) -> None:
        for i, sink in enumerate(self._sinks):
            if i in self._failed:
                continue
            try:
                getattr(sink, method)(arg)
            except Exception:  # a broken sink must never take training down
                self._failed.add(i)
                log.exception("gradwatch: %s sink failed and is disabled for this run", type(sink).__name__)
