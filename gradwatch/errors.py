"""Errors: the exceptions gradwatch raises at its boundaries, each with one clear message."""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable
from typing import Any, TypeVar

_E = TypeVar("_E", bound=BaseException)
_F = TypeVar("_F", bound=Callable[..., Any])
#: the directory of gradwatch's own modules (its frames are trimmed from the tracebacks it raises)
_HOME = os.path.dirname(os.path.abspath(__file__)) + os.sep


class GradwatchError(Exception):
    """Base class of every error gradwatch raises on purpose."""


class ConfigError(GradwatchError, ValueError):
    """Invalid options, rules or configuration given to gradwatch."""


class RunError(GradwatchError):
    """A run directory that cannot be created, written, found or read."""


class SchemaError(RunError):
    """A run store written by a newer gradwatch than the one reading it."""


class DamagedStoreError(RunError):
    """A run store holding what its writer could not have written (corrupted, truncated or edited)."""


class TrainingHalted(RuntimeError):
    """Raised from ``optimizer.step()`` when a rule halts training, before the update is applied."""

    def __init__(self, message: str, *, step: int | None = None, finding: object | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.finding = finding


class GradwatchWarning(UserWarning):
    """Something the user should know about that does not stop training."""


class InternalWarning(GradwatchWarning):
    """gradwatch failed inside a hook and detached itself; training went on unaffected."""


class DiskFullWarning(GradwatchWarning):
    """The disk under a run is full: its records wait in memory for space, or some could not be kept."""


class PluginWarning(GradwatchWarning):
    """A plugin failed while training and is disabled for the rest of the run; training went on."""


class GroupLeft(RuntimeError):
    """gradwatch failed on some rank of a distributed run: every rank stops watching at the same step."""

    def __init__(self, ranks: list[int], size: int) -> None:
        which = ", ".join(map(str, ranks))
        super().__init__(f"gradwatch failed on rank{'s' if len(ranks) > 1 else ''} {which} of {size}; "
                         "every rank stops watching at this step")
        self.ranks = ranks


def trimmed(exc: _E) -> _E:
    """``exc`` with a traceback of the frames outside gradwatch and the one frame that raised it.

    Raised again (``raise trimmed(exc) from exc.__cause__``: an explicit cause kept, no implicit context
    of gradwatch's) from the outermost gradwatch frame, the traceback the user
    sees holds their own frames, the library's that called gradwatch (torch's optimizer step) and two
    of gradwatch's: that outermost frame and the one that raised. The message is unchanged.
    """
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    if not frames:
        return exc
    kept = [f for f in frames[:-1] if not f.tb_frame.f_code.co_filename.startswith(_HOME)] + frames[-1:]
    new: types.TracebackType | None = None
    for f in reversed(kept):
        new = types.TracebackType(new, f.tb_frame, f.tb_lasti, f.tb_lineno)
    return exc.with_traceback(new)


def boundary(function: _F) -> _F:
    """Have the errors gradwatch raises from ``function`` (a public entry point) reach the user with a
    traceback of two gradwatch frames: the entry point's and the one that raised (:func:`trimmed`).
    """
    @functools.wraps(function)
    def entry(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except (GradwatchError, TrainingHalted) as exc:  # the same error, its message and chain unchanged
            raise trimmed(exc) from exc.__cause__

    return entry  # type: ignore[return-value]
