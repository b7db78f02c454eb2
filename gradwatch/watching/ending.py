"""Ending: how this process is ending — a signal, ``sys.exit(N)``, an uncaught exception — told to the runs it closes.

The registry notes each as it happens (its signal handler, its ``sys.exit`` wrapper, its excepthook)
and closes the runs still open with :func:`outcome`: ``terminated`` (signal N), ``exited`` (code N),
``crashed`` (the exception), or ``finished`` (None here: the watcher's own status).
"""

from __future__ import annotations

import os
import signal as signals
import time
from dataclasses import dataclass, field
from typing import Any

#: the signals whose arrival closes the runs as ``terminated``: how SLURM and Kubernetes preempt a job
SIGNALS: tuple[int, ...] = tuple(getattr(signals, name) for name in ("SIGTERM",) if hasattr(signals, name))
#: how long a signal that ends the process waits for the runs to close before the process ends (seconds)
CLOSE_SECONDS = 10.0


@dataclass
class Ending:
    """What is known so far of how the process ends."""

    signal: int | None = None  # a signal of :data:`SIGNALS` arrived (or SIGINT, an uncaught KeyboardInterrupt)
    exception: str | None = None  # an uncaught exception, as "Type: message"
    code: int | None = None  # the code of the latest ``sys.exit`` call
    message: str | None = None  # ``sys.exit("message")``'s message
    #: each live watcher's step when ``sys.exit`` was called: a step after it means the exit was caught
    steps_at_exit: dict[int, int] = field(default_factory=dict)


NOW = Ending()


def forked() -> None:
    """In a child forked from this process: how the parent was ending (a signal it got, its ``sys.exit`` calls)
    is not the child's; the runs the child watches itself start from nothing known.
    """
    NOW.__dict__.update(vars(Ending()))


def signal_again(signum: int) -> None:
    """Send ``signum`` to this process again after :data:`CLOSE_SECONDS` (the runs are closed then, whatever
    the hook that the first one stopped is doing).
    """
    time.sleep(CLOSE_SECONDS)
    os.kill(os.getpid(), signum)


def exit_code(status: Any) -> int:
    """The process's exit status for ``sys.exit(status)``: None is 0, an int itself, anything else 1."""
    if status is None:
        return 0
    if isinstance(status, bool):
        return int(status)
    return status if isinstance(status, int) else 1


def exiting(status: Any, steps: dict[int, int]) -> None:
    """``sys.exit(status)`` was called while the live watchers were at ``steps`` (by watcher id)."""
    NOW.code = exit_code(status)
    NOW.message = None if status is None or isinstance(status, int) else str(status)[:500]
    NOW.steps_at_exit = dict(steps)


def raised(kind: type[BaseException], value: BaseException, tb: object = None) -> None:
    """An exception nothing caught ends the process (an uncaught KeyboardInterrupt: Python's own SIGINT exit);
    the excepthook's arguments.
    """
    if issubclass(kind, KeyboardInterrupt):
        NOW.signal = NOW.signal or int(signals.SIGINT)
        return
    NOW.exception = described_exception(kind, value)


def described_exception(kind: type[BaseException], value: BaseException | None) -> str:
    """``Type: message`` of an exception, at most 500 characters."""
    text = str(value) if value is not None else ""
    return f"{kind.__name__}: {text}"[:500] if text else kind.__name__


def of_block(kind: type[BaseException] | None, value: BaseException | None) -> tuple[str | None, dict[str, Any]]:
    """How a ``with`` block of a watcher that raised ``value`` ends its run: ``crashed`` with the exception,
    ``exited`` with a nonzero ``sys.exit`` code; None (finished) for ``sys.exit(0)`` and a KeyboardInterrupt.
    """
    if kind is None or issubclass(kind, KeyboardInterrupt):
        return None, {}
    if issubclass(kind, SystemExit):
        status = getattr(value, "code", None)
        code = exit_code(status)
        return ("exited", {"code": code, **({"message": str(status)[:500]} if isinstance(status, str) else {})}) \
            if code else (None, {})
    return "crashed", {"exception": described_exception(kind, value)}


def outcome(steps: dict[int, int], *, at_exit: bool) -> tuple[str | None, dict[str, Any]]:
    """The status and details (``signal``, ``code``, ``message``, ``exception``) of the runs closed now.

    Args:
        steps: each live watcher's step now (by watcher id): a ``sys.exit`` call followed by a step, or by a
            new watcher, was caught.
        at_exit: the interpreter is exiting (``atexit``); otherwise a run is closed by the program (only a
            signal that arrived before makes it ``terminated``).

    Returns:
        ``(None, {})`` when nothing says the run did not finish.
    """
    caught = any(NOW.steps_at_exit.get(k) != v for k, v in steps.items())  # a watcher trained, or began, after it
    code = NOW.code if at_exit and not caught else None
    detail: dict[str, Any] = {}
    if code:
        detail["code"] = code
        if NOW.message is not None:
            detail["message"] = NOW.message
    if NOW.signal is not None:
        return "terminated", {"signal": NOW.signal, **detail}
    if not at_exit:
        return None, {}
    if NOW.exception is not None:
        return "crashed", {"exception": NOW.exception}
    if code:
        return "exited", detail
    return None, {}
