"""Store faults: two processes on one run, a kill while the store is created, readers holding it open
(issue 16, items 4, 7 and 8)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.store.schema import DB_NAME
from gradwatch.store.writer import StoreWriter, create_store

from . import pool
from .conftest import train


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def batches() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(16, 4), torch.randn(16, 2)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gradwatch", *args], capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------ item 4: a live writer is never overwritten
TRAINING = textwrap.dedent(
    """
    import platform, sys, time
    if sys.argv[2] != "here":  # a machine of its own that shares the folder (a cluster's file system)
        platform.node = lambda: sys.argv[2]
    import torch
    from torch import nn
    import gradwatch as gw
    torch.manual_seed(0)
    model = gw.watch(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), run=sys.argv[1],
                     flush_seconds=0.05, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while True:
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad(); loss.backward(); gw.watcher(model).observe(loss=loss); opt.step()
        step += 1
        if step == 50:
            print("ready", flush=True)
        if step > 50:
            time.sleep(0.01)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("host", ["here", "another-machine"])
def test_overwrite_refuses_a_run_whose_writer_is_alive_and_takes_it_once_it_is_gone(tmp_path: Path,
                                                                                     host: str) -> None:
    run_dir = tmp_path / "busy"
    script = tmp_path / "train.py"
    script.write_text(TRAINING)
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir), host], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(gw.RunError, match=rf"being written by another process \(pid {proc.pid}"):
            gw.watch(mlp(), run=run_dir, overwrite=True, console=False)
        with pytest.raises(gw.RunError, match="being written by another process"):
            gw.watch(mlp(), run=run_dir, console=False)
        time.sleep(0.3)
        with gw.open_run(run_dir) as run:
            assert run.steps >= 50 and run.status == "running", "the live run is untouched"
        assert any(run_dir.glob("events.out.tfevents.*")), "its TensorBoard file too"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    with gw.open_run(run_dir) as run:
        assert run.steps >= 50 and run.status == ("crashed" if host == "here" else "running")
    # the writer is gone (killed): its run can be replaced
    model = gw.watch(mlp(), run=run_dir, overwrite=True, console=False)
    train(model, batches, nn.functional.mse_loss, steps=3)
    gw.unwatch(model)
    with gw.open_run(run_dir) as run:
        assert run.steps == 3 and run.status == "finished"


def test_a_closed_run_of_this_process_can_be_overwritten_and_the_lock_is_released(tmp_path: Path) -> None:
    run_dir = tmp_path / "again"
    for steps in (2, 4):
        model = gw.watch(mlp(), run=run_dir, overwrite=True, console=False)
        train(model, batches, nn.functional.mse_loss, steps=steps)
        gw.unwatch(model)
        with gw.open_run(run_dir) as run:
            assert run.steps == steps
    # the store writer holds the lock until it closes; a store created and closed directly releases it
    writer = StoreWriter(create_store(run_dir, {"model": "X"}, overwrite=True))
    writer.close("finished")
    StoreWriter(create_store(run_dir, {"model": "Y"}, overwrite=True)).close("finished")
    with gw.open_run(run_dir) as run:
        assert run.meta["model"] == "Y"


# ------------------------------------------------------------------ item 8: a kill while the store is created
CREATING = textwrap.dedent(
    """
    import os, signal, sqlite3, sys
    trigger = sys.argv[2]
    real = sqlite3.connect

    def connect(*args, **kwargs):
        conn = real(*args, **kwargs)
        def trace(sql):
            if sql.lstrip().upper().startswith(trigger):
                os.kill(os.getpid(), signal.SIGKILL)
        conn.set_trace_callback(trace)
        return conn

    sqlite3.connect = connect
    import torch
    import gradwatch as gw
    gw.watch(torch.nn.Linear(2, 2), run=sys.argv[1], console=False, tensorboard=False)
    print("not killed", flush=True)
    """
)


def _killed_creating(where: Path, trigger: str) -> subprocess.CompletedProcess[str]:
    script = where / "create.py"
    script.write_text(CREATING)
    return subprocess.run([sys.executable, str(script), str(where / "r"), trigger], capture_output=True, text=True,
                          timeout=300)


#: what ``creations`` gives: by trigger, the killed creation's process to come, and its folder
Creations = dict[str, tuple[Future[subprocess.CompletedProcess[str]], Path]]


@pytest.fixture(scope="module")
def creations(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Creations]:
    """The killed creations of the triggers this session tests, started as the module begins, two at a time
    beside the test process, each in a folder of its own."""
    with ThreadPoolExecutor(2) as runner:
        started: Creations = {}
        test = "test_a_kill_while_the_store_is_created_leaves_the_path_free"
        for trigger in pool.chosen(request, "trigger", test=test):
            where = tmp_path_factory.mktemp("creation")
            started[trigger] = (runner.submit(_killed_creating, where, trigger), where)
        yield started
        for future, _ in started.values():
            future.cancel()  # a session stopped early (-x) runs no creation it no longer tests


@pytest.fixture(scope="module", autouse=True)
def _creations_begin(creations: Creations) -> None:
    """Start the killed creations with the module's first test."""


@pytest.mark.slow
@pytest.mark.parametrize("trigger", ["PRAGMA PAGE_SIZE", "CREATE TABLE", "INSERT OR REPLACE INTO META", "COMMIT"])
def test_a_kill_while_the_store_is_created_leaves_the_path_free(creations: Creations, trigger: str) -> None:
    future, tmp_path = creations[trigger]
    run_dir = tmp_path / "r"
    done = future.result()
    assert done.returncode == -signal.SIGKILL, (done.stdout, done.stderr)
    checked = cli("check", str(run_dir))
    assert checked.returncode == 2 and "corrupted" not in checked.stderr, checked.stderr
    assert "not a gradwatch run" in checked.stderr and len(checked.stderr.strip().splitlines()) == 1
    # the path is free: a new run takes it without overwrite=True, and nothing of the attempt stays behind
    model = gw.watch(mlp(), run=run_dir, console=False, tensorboard=False)
    train(model, batches, nn.functional.mse_loss, steps=2)
    gw.unwatch(model)
    with gw.open_run(run_dir) as run:
        assert run.steps == 2 and run.status == "finished"
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith((".", DB_NAME))) == [DB_NAME]


@pytest.mark.slow
def test_an_empty_store_left_by_an_interrupted_creation_does_not_block_the_path(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / DB_NAME).write_bytes(b"")  # what a kill right after the file was created left behind
    checked = cli("check", str(run_dir))
    assert checked.returncode == 2 and "corrupted" not in checked.stderr and "holds no run" in checked.stderr
    model = gw.watch(mlp(), run=run_dir, console=False, tensorboard=False)
    train(model, batches, nn.functional.mse_loss, steps=2)
    gw.unwatch(model)
    with gw.open_run(run_dir) as run:
        assert run.steps == 2
    tables = tmp_path / "tables"  # tables created, no metadata written yet
    tables.mkdir()
    conn = sqlite3.connect(tables / DB_NAME)
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.close()
    model = gw.watch(mlp(), run=tables, console=False, tensorboard=False)
    gw.unwatch(model)
    with gw.open_run(tables) as run:
        assert run.meta["model"] == "Sequential"


def test_a_store_that_holds_a_run_still_needs_overwrite(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    model = gw.watch(mlp(), run=run_dir, console=False, tensorboard=False)
    train(model, batches, nn.functional.mse_loss, steps=2)
    gw.unwatch(model)
    with pytest.raises(gw.RunError, match="already holds a run"):
        gw.watch(mlp(), run=run_dir, console=False, tensorboard=False)


# ------------------------------------------------------------------ item 7: close never waits on readers
def test_close_does_not_wait_for_a_reader_holding_a_transaction(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    model = gw.watch(mlp(), run=run_dir, console=False, tensorboard=False, flush_seconds=0.05)
    train(model, batches, nn.functional.mse_loss, steps=5)
    gw.watcher(model).flush()
    reader = sqlite3.connect(f"{(run_dir / DB_NAME).resolve().as_uri()}?mode=ro", uri=True)
    reader.execute("BEGIN")
    assert reader.execute("SELECT COUNT(*) FROM steps").fetchone()[0] >= 4  # a read snapshot is now held
    try:
        start = time.monotonic()
        gw.unwatch(model)
        assert time.monotonic() - start < 20.0, "close waited for the reader (its busy wait is 30 s)"
    finally:
        reader.close()
    with gw.open_run(run_dir) as run:
        assert run.status == "finished" and run.steps == 5


def test_close_waits_for_nobody_with_a_reader_open_through_open_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    model = gw.watch(mlp(), run=run_dir, console=False, tensorboard=False, flush_seconds=0.05)
    train(model, batches, nn.functional.mse_loss, steps=3)
    gw.watcher(model).flush()
    with gw.open_run(run_dir) as run:
        run._conn.execute("BEGIN")
        assert run.steps >= 2
        start = time.monotonic()
        gw.unwatch(model)
        assert time.monotonic() - start < 20.0  # not the 30 s busy wait
    with gw.open_run(run_dir) as run:
        assert run.status == "finished"
    # with no reader left, the next close leaves one self-contained file, as before
    again = tmp_path / "alone"
    model = gw.watch(mlp(), run=again, console=False, tensorboard=False)
    train(model, batches, nn.functional.mse_loss, steps=2)
    gw.unwatch(model)
    assert not (again / f"{DB_NAME}-wal").exists()
