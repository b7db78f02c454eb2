"""TensorBoard sink: step records as event files in the run directory, one event per step.

Tags are ``<metric>/<layer>`` so that TensorBoard groups per-layer series by metric, and
``global/<name>`` for the global gradient norm, loss, learning rate and observed scalars.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gradwatch.records import LAYER, StepRecord, present


class TensorBoard:
    """Writes per-layer metrics on logged steps and global scalars on every step."""

    def __init__(self, run_dir: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._file = EventFileWriter(str(run_dir), max_queue_size=64, flush_secs=10)
        self._tags: dict[tuple[int, str], list[str]] = {}

    def write(self, records: Sequence[StepRecord]) -> None:
        """Write one event per record holding all of its values."""
        value = self._summary.Value
        for rec in records:
            values = [value(tag=f"global/{k}", simple_value=v) for k, v in rec.scalars.items()]
            if rec.skipped:
                values.append(value(tag="global/skipped", simple_value=1.0))
            if rec.logged:
                for (scope, metric), vec in rec.vectors.items():
                    if scope != LAYER:
                        continue
                    tags = self._layer_tags(rec, metric)
                    keep = np.flatnonzero(present(rec, scope, metric))
                    values.extend(value(tag=tags[i], simple_value=float(vec[i])) for i in keep)
            event = self._event(wall_time=rec.time, step=rec.step, summary=self._summary(value=values))
            self._file.add_event(event)

    def _layer_tags(self, rec: StepRecord, metric: str) -> list[str]:
        key = (rec.layout.version, metric)
        if key not in self._tags:
            self._tags[key] = [f"{metric}/{name}" for name in rec.layout.layers]
        return self._tags[key]

    def close(self, status: str) -> None:
        """Flush and close the event file."""
        self._file.close()
