"""A disk that fills up mid-run (issue 27, item 1): records wait in memory and are written when space
returns, one warning says so, a finding is printed only once stored (or says it is not), and a run
that finished reads ``finished``, marked incomplete when steps could not be kept.

Two ways to fill the disk: a real 4 MB tmpfs under the run (where this process may mount one), and
a connection of the store that reports SQLITE_FULL for a window of steps, which always runs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.sinks import store as store_sink
from gradwatch.store import writer as store_writer
from gradwatch.store.reserve import RESERVE
from gradwatch.store.writer import StoreWriter, create_store

#: the steps whose batch is scaled up: each gives an ``exploding`` and/or a ``loss_spike`` finding
PLANTED = (60, 120, 180, 240)
STEPS = 300
FINDING_LINE = re.compile(r"gradwatch (?:info|warning|error) step (\d+) (\w+)")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))


def _train(run: Path, at_step: Any, **options: Any) -> list[warnings.WarningMessage]:
    """300 watched steps with planted gradient explosions; ``at_step(step, watcher)`` runs after each step."""
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = gw.watch(_model(), run=run, flush_seconds=0.05, **options)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(STEPS):
            x = torch.randn(32, 64) * (1e4 if step in PLANTED else 1.0)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            gw.watcher(model).observe(loss=loss)
            opt.step()
            at_step(step, gw.watcher(model))
        gw.watcher(model).close()
    return [w for w in caught if issubclass(w.category, gw.GradwatchWarning)]


def _printed(err: str) -> list[tuple[int, str, bool]]:
    """The findings printed on the console: (step, kind, printed as not stored)."""
    out = []
    for block in re.split(r"\n(?=gradwatch (?:info|warning|error) step)", err):
        m = FINDING_LINE.search(block)
        if m:
            out.append((int(m.group(1)), m.group(2), "(not stored: disk full)" in " ".join(block.split())))
    return out


def _check_json(run: Path) -> tuple[int, dict[str, Any], str]:
    """``gradwatch check`` of the run, as JSON and as text (the two read it at once)."""
    with ThreadPoolExecutor(2) as commands:
        json_check = commands.submit(subprocess.run, [sys.executable, "-m", "gradwatch", "check", str(run),
                                                      "--format", "json"], capture_output=True, text=True, timeout=120)
        text = subprocess.run([sys.executable, "-m", "gradwatch", "check", str(run)],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
        done = json_check.result()
    return done.returncode, json.loads(done.stdout), text.stdout


# ------------------------------------------------------------ fault injected: SQLITE_FULL for a window
class _Disk:
    full = False


class _Filling:
    """The store's connection, on a disk that is full while ``_Disk.full``: every write fails with
    SQLITE_FULL, after which SQLite has rolled the transaction back (as it does on a full disk)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def __enter__(self) -> Any:
        return self._conn.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._conn.__exit__(*exc)

    def _fail(self, sql: str) -> None:
        if _Disk.full and sql.lstrip().upper().startswith(("INSERT", "UPDATE", "COMMIT")):
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise sqlite3.OperationalError("database or disk is full")

    def execute(self, sql: str, *args: Any) -> Any:
        self._fail(sql)
        return self._conn.execute(sql, *args)

    def executemany(self, sql: str, *args: Any) -> Any:
        self._fail(sql)
        return self._conn.executemany(sql, *args)


@pytest.fixture
def filling(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_Disk]]:
    real = store_writer._connect
    monkeypatch.setattr(store_writer, "_connect", lambda path: _Filling(real(path)))
    _Disk.full = False
    yield _Disk
    _Disk.full = False


def _window(first: int, last: int) -> Any:
    def at_step(step: int, watcher: gw.Watcher) -> None:
        if step == first:
            _Disk.full = True
        if step == last:
            _Disk.full = False
    return at_step


@pytest.mark.slow
def test_a_disk_full_for_a_while_loses_nothing(tmp_path: Path, filling: type[_Disk],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    told = _train(run, _window(40, 150), tensorboard=False)
    printed = _printed(capsys.readouterr().err)
    assert [type(w.message) for w in told] == [gw.DiskFullWarning], [str(w.message) for w in told]
    assert "is full" in str(told[0].message) and "when space returns" in str(told[0].message)
    assert {s for s, _, _ in printed} == set(PLANTED), printed
    # persist, then print: a finding printed while the disk was full says it was not stored (yet)
    assert all(unstored == (40 <= step < 150) for step, _, unstored in printed), printed
    with gw.open_run(run) as r:
        assert r.status == "finished" and r.incomplete is None
        assert r.steps == STEPS, "the steps held while the disk was full were written when space returned"
        stored = {(int(s), k) for s, k in zip(r.findings()["step"], r.findings()["kind"])}
        assert {(s, k) for s, k, _ in printed} <= stored, "a printed finding is missing from the store"
        assert len(r.scalars("grad_norm")) == STEPS
    code, out, text = _check_json(run)
    assert code == 0 and out["status"] == "finished" and out["incomplete"] is None and out["steps"] == STEPS
    assert "incomplete" not in text


@pytest.mark.slow
def test_records_beyond_the_memory_held_are_dropped_and_the_run_says_which(
        tmp_path: Path, filling: type[_Disk], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(store_sink, "HOLD_BYTES", 20_000)  # a few dozen steps of this model
    run = tmp_path / "run"
    told = _train(run, _window(40, 150), tensorboard=False)
    printed = _printed(capsys.readouterr().err)
    assert [type(w.message) for w in told] == [gw.DiskFullWarning, gw.DiskFullWarning], told
    with gw.open_run(run) as r:
        gap, steps = r.incomplete, r.steps
        assert r.status == "finished", "a run that finished reads finished, however much was lost"
        assert gap is not None and gap["reason"] == "disk full"
        assert gap["missing_steps"] == STEPS - r.steps > 0
        held = set(r.scalars("grad_norm").index)
        assert not any(lo <= s <= hi for lo, hi in gap["steps"] for s in held)
        # records are written a little after their step: those of the steps just before the window met it too
        assert all(lo <= hi < 150 for lo, hi in gap["steps"]) and set(range(150, STEPS)) <= held, gap
        assert set(range(20)) <= held, gap
        stored = {(int(s), k) for s, k in zip(r.findings()["step"], r.findings()["kind"])}
    assert {(s, k) for s, k, _ in printed} <= stored, "findings are never dropped"
    summary = str(told[1].message)
    assert f"{gap['missing_steps']} steps" in summary and "incomplete" in summary
    code, out, text = _check_json(run)
    assert code == 0, "an incomplete run is reported; its findings decide the exit code"
    assert out["status"] == "finished" and out["incomplete"] == gap and out["steps"] == steps
    assert f"finished, incomplete: {gap['missing_steps']} steps missing (disk full)" in text


def test_a_write_that_finds_the_disk_full_raises_that_error_not_a_failed_rollback(
        tmp_path: Path, filling: type[_Disk]) -> None:
    from gradwatch.store.records import Layout, StepRecord

    layout = Layout(1, ("a",), ("Linear",), (4,), ("a.weight",), (4,), ((0, 0),), (0,))
    db = create_store(tmp_path / "run", {"model": "m"}, overwrite=False)
    writer = StoreWriter(db)
    _Disk.full = True
    with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
        writer.write([StepRecord(step=0, time=0.0, layout=layout, scalars={"loss": 1.0})])
    _Disk.full = False  # space came back: the layout the failed transaction held is written again
    writer.write([StepRecord(step=1, time=0.0, layout=layout, scalars={"loss": 1.0})])
    writer.close("finished")
    with gw.open_run(tmp_path / "run") as r:
        assert r.steps == 1 and r.layers == ["a"]


# ------------------------------------------- a real 4 MB filesystem (room for a run, its events and its reserve)
@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if shutil.which("mount") is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a 4 MB tmpfs needs root and mount(8); the fault-injected tests cover the logic")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"this process may not mount a tmpfs ({done.stderr.strip()}); the fault-injected tests "
                    "cover the logic")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _event_steps(path: Path) -> list[int]:
    """The steps of a TensorBoard event file's events, every record's framing and checksums verified."""
    import struct

    from tensorboard.compat.proto import event_pb2

    from gradwatch.sinks.tensorboard import _masked_crc

    data, at, steps = path.read_bytes(), 0, []
    while at < len(data):
        header = data[at:at + 8]
        assert len(header) == 8 and data[at + 8:at + 12] == _masked_crc(header), f"torn record at byte {at}"
        (n,) = struct.unpack("<Q", header)
        body = data[at + 12:at + 12 + n]
        assert len(body) == n and data[at + 12 + n:at + 16 + n] == _masked_crc(body), f"torn record at byte {at}"
        steps.append(event_pb2.Event.FromString(body).step)
        at += 16 + n
    return steps


@pytest.mark.slow
def test_a_real_filesystem_filling_up_and_freed(small_disk: Path, capsys: pytest.CaptureFixture[str],
                                                caplog: pytest.LogCaptureFixture) -> None:
    run, filler = small_disk / "run", small_disk / "filler"

    def at_step(step: int, watcher: gw.Watcher) -> None:
        if step == 30:  # fill the disk but for 100 KB: the store runs out of room within a few steps
            watcher.flush()  # the steps so far on disk first (else, on a loaded machine, still in TensorBoard's buffer)
            room = os.statvfs(small_disk)
            with open(filler, "wb") as fh:
                fh.write(b"\0" * max(0, room.f_bavail * room.f_frsize - 100_000))
        if step == 200:
            filler.unlink()

    told = _train(run, at_step)
    printed = _printed(capsys.readouterr().err)
    assert [type(w.message) for w in told] == [gw.DiskFullWarning], [str(w.message) for w in told]
    assert {s for s, _, _ in printed} == set(PLANTED), printed
    assert any(unstored for _, _, unstored in printed), "no finding met the full disk: the test planted none"
    with gw.open_run(run) as r:
        assert r.status == "finished" and r.incomplete is None
        assert r.steps == STEPS
        stored = {(int(s), k) for s, k in zip(r.findings()["step"], r.findings()["kind"])}
        assert {(s, k) for s, k, _ in printed} <= stored
    code, out, _ = _check_json(run)
    assert code == 0 and out["status"] == "finished" and out["incomplete"] is None and out["steps"] == STEPS
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a sink failed (a traceback logged)"
    # TensorBoard skipped the events it had no room for, its file whole, and went on once space returned
    (events,) = run.glob("events.out.tfevents.*")
    tb_steps = set(_event_steps(events))
    assert set(range(210, STEPS)) <= tb_steps and set(range(20)) <= tb_steps


@pytest.mark.slow
def test_a_disk_still_full_at_the_end_says_what_it_could_not_write(tmp_path: Path, filling: type[_Disk]) -> None:
    run = tmp_path / "run"
    told = _train(run, _window(250, STEPS + 1), tensorboard=False)
    assert [type(w.message) for w in told] == [gw.DiskFullWarning, gw.DiskFullWarning], told
    end = str(told[1].message)
    assert "still full at its end" in end and "could not be written" in end and "'crashed' once" in end, end
    with gw.open_run(run) as r:
        steps = r.steps
    assert steps < STEPS
    _, out, _ = _check_json(run)  # the status could not be written: never a false 'finished' ('crashed' once
    assert out["status"] == "running" and out["steps"] == steps, out  # its writer, this process, has ended)


# ------------------------------------------------- full until the end: the final status all the same
class _Reserved(_Filling):
    """A disk full while ``_Disk.full`` and the run's reserve file is there: freeing it makes room, as
    freeing a real file's blocks does."""

    def __init__(self, conn: sqlite3.Connection, run_dir: Path) -> None:
        super().__init__(conn)
        self._reserve = run_dir / RESERVE

    def _fail(self, sql: str) -> None:
        if self._reserve.exists():
            super()._fail(sql)


@pytest.fixture
def filling_but_reserved(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_Disk]]:
    real = store_writer._connect
    monkeypatch.setattr(store_writer, "_connect", lambda path: _Reserved(real(path), Path(path).parent))
    _Disk.full = False
    yield _Disk
    _Disk.full = False


def _still_full_at_the_end_reads_incomplete(run: Path, told: list[warnings.WarningMessage]) -> None:
    """The run's final status and verdict are written, ``check`` says incomplete (not crashed), nothing is left over."""
    assert [type(w.message) for w in told] == [gw.DiskFullWarning, gw.DiskFullWarning], told
    end = str(told[1].message)
    assert "still full at its end" in end and "final status ('finished') is written" in end, end
    assert "the run is incomplete" in end and "crashed" not in end, end
    with gw.open_run(run) as r:
        assert r.status == "finished", r.status
        gap, steps = r.incomplete, r.steps
    assert gap is not None and gap["reason"] == "disk full" and gap["missing_steps"] > 0 and steps < STEPS
    assert json.loads((run / "verdict.json").read_text())["status"] == "finished"
    assert not (run / RESERVE).exists(), "the reserve is never left behind"
    code, out, text = _check_json(run)
    assert out["status"] == "finished" and out["incomplete"] == gap and out["steps"] == steps, out
    assert f"finished, incomplete: {gap['missing_steps']} steps missing (disk full)" in text, text
    assert "crashed" not in text and code == 0, (code, text)


@pytest.mark.slow
def test_a_disk_full_until_the_end_still_gets_its_final_status(tmp_path: Path,
                                                               filling_but_reserved: type[_Disk]) -> None:
    run = tmp_path / "run"
    told = _train(run, _window(250, STEPS + 1), tensorboard=False)
    _still_full_at_the_end_reads_incomplete(run, told)


@pytest.mark.slow
def test_a_real_filesystem_full_until_the_end_still_gets_its_final_status(small_disk: Path) -> None:
    run, filler = small_disk / "run", small_disk / "filler"

    def at_step(step: int, watcher: gw.Watcher) -> None:
        if step == 250:  # fill the disk to the last block, for good (the store may have filled it already)
            watcher.flush()
            try:
                with open(filler, "wb") as fh:
                    while True:
                        fh.write(b"\0" * 4096)
                        fh.flush()
            except OSError:
                pass
        if step == STEPS - 1:
            assert os.statvfs(small_disk).f_bavail == 0, "the disk is full at the end"

    told = _train(run, at_step, tensorboard=False)
    _still_full_at_the_end_reads_incomplete(run, told)
