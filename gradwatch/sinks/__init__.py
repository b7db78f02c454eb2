"""Sinks: where step records go (run store, TensorBoard ...), all called from the writer thread."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gradwatch.records import StepRecord


class Sink(Protocol):
    """What every sink implements. Sinks run in the writer thread, never in the training thread."""

    def write(self, records: Sequence[StepRecord]) -> None:
        """Write a batch of step records, in step order."""

    def close(self, status: str) -> None:
        """Flush and release resources; ``status`` is the run's final status."""
