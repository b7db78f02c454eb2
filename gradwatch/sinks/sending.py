"""Sending: a sink's own thread for a remote service, so that a slow or dead server never holds the writer.

The writer thread hands the sink's calls to the service over as jobs and returns at once; the
sender runs them in order until one fails, and the sink tells that failure at its next call (the
writer then disables the sink with its usual log line). Closing waits a bounded time.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable

from gradwatch.watching import guard as entry
from gradwatch.watching import register

log = logging.getLogger("gradwatch")


def _failed(exc: BaseException, kind: str, args: tuple[object, ...]) -> None:
    log.error("gradwatch: a sink's sending thread failed: %r", exc)


#: the guard of the sending threads: a failure of their own is logged (each keeps its error for its sink)
_GUARD = entry.Guard(_failed)


class Sender:
    """The one thread that talks to a service: runs the jobs handed to it, in order, until one fails."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        #: the exception that stopped the sending (the jobs after it are not run)
        self.error: BaseException | None = None
        self._thread = register.thread(_GUARD.hook("sink_thread", self._run), name)

    def put(self, job: Callable[[], None]) -> None:
        """Send ``job`` after those handed over before it."""
        self._jobs.put(job)

    def stop(self, timeout: float) -> bool:
        """Let it finish its jobs, waiting at most ``timeout`` seconds; whether it did."""
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                job()
        except BaseException as exc:  # told by the sink's next call; the jobs left are not run
            self.error = exc
