"""Errors: the exceptions gradwatch raises at its boundaries, each with one clear message."""

from __future__ import annotations


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
