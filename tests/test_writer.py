"""The writer thread: batching, flush, bounded queue, failing sinks."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import pytest

from gradwatch.store.records import Layout, StepRecord
from gradwatch.store.thread import Writer

LAYOUT = Layout(1, ("a",), ("Linear",), (4,), ("a.weight",), (4,), ((0, 0),), (0,))


def record(step: int) -> StepRecord:
    return StepRecord(step=step, time=0.0, layout=LAYOUT, scalars={"loss": float(step)})


class Collect:
    def __init__(self, delay: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.closed: str | None = None
        self.delay = delay

    def write(self, records: Sequence[StepRecord]) -> None:
        time.sleep(self.delay)
        self.batches.append([r.step for r in records])

    def close(self, status: str) -> None:
        self.closed = status


class Broken:
    def write(self, records: Sequence[StepRecord]) -> None:
        raise OSError("disk full")

    def close(self, status: str) -> None:
        raise OSError("disk full")


def test_records_are_batched_and_flush_waits_for_them() -> None:
    sink = Collect()
    writer = Writer([sink], queue_size=100, flush_seconds=60.0, name="t")
    for step in range(10):
        writer.submit(record(step))
    assert sink.batches == [], "nothing is written per record"
    writer.flush()
    assert sink.batches == [list(range(10))]
    writer.close("finished")
    assert sink.closed == "finished"


def test_full_queue_makes_the_producer_wait_and_drops_nothing() -> None:
    sink = Collect(delay=0.01)
    writer = Writer([sink], queue_size=4, flush_seconds=60.0, name="t")
    for step in range(50):
        writer.submit(record(step))
    writer.close("finished")
    assert [s for batch in sink.batches for s in batch] == list(range(50))


def test_a_failing_sink_is_disabled_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    good = Collect()
    writer = Writer([Broken(), good], queue_size=10, flush_seconds=60.0, name="t")
    with caplog.at_level(logging.ERROR, logger="gradwatch"):
        writer.submit(record(0))
        writer.flush()
        writer.submit(record(1))
        writer.close("finished")
    assert [s for batch in good.batches for s in batch] == [0, 1] and good.closed == "finished"
    assert sum("Broken sink failed" in r.getMessage() for r in caplog.records) == 1


def test_writes_happen_on_the_writer_thread() -> None:
    seen: list[str] = []

    class Where(Collect):
        def write(self, records: Sequence[StepRecord]) -> None:
            seen.append(threading.current_thread().name)

    writer = Writer([Where()], queue_size=10, flush_seconds=60.0, name="run1")
    writer.submit(record(0))
    writer.close("finished")
    assert seen == ["gradwatch-writer-run1"]
