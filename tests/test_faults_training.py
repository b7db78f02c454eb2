"""Faults inside gradwatch never break, hang or mislead the training it watches (issue 16: 1, 2, 3, 10).

Each test plants the fault for real: a disk that fills up under the snapshots, a directory where
an old snapshot file should be, a writer thread that dies, a process killed the moment a finding
is printed.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.judging.judge import Judge
from gradwatch.step import snapshots as snapshots_module
from gradwatch.store.thread import Writer

from . import pool

ROOT = Path(__file__).resolve().parents[1]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _loop(model: nn.Module, steps: int, *, nan_at: int | None = None) -> int:
    """The README's loop: ``gw.watcher(model).observe(loss=loss)`` every step; returns the steps trained."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    done = 0
    for step in range(steps):
        x = torch.randn(16, 8, generator=gen)
        if step == nan_at:
            x[0, 0] = float("nan")
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
        done += 1
    return done


def _rollback(**kw: object) -> list[gw.Rule]:
    return [gw.Rule(when="nonfinite", do="rollback", **kw)]  # type: ignore[arg-type]


# ----------------------------------------------------------------- item 1
def test_a_full_disk_under_the_snapshots_disables_them_and_training_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snaps = tmp_path / "snaps"
    real_fsync = os.fsync

    def full(fd: int) -> None:  # the snapshot file was written; committing it finds the disk full
        if any(p.suffix == ".tmp" for p in snaps.glob("*")):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(snapshots_module.os, "fsync", full)
    model = gw.watch(_model(), run=tmp_path / "run", rules=_rollback(), snapshot_dir=snaps, console=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _loop(model, 12, nan_at=8) == 12
    watcher = gw.watcher(model)
    assert not watcher.detached and not watcher.closed, "gradwatch detached itself over a snapshot"
    messages = [str(w.message) for w in caught if issubclass(w.category, gw.GradwatchWarning)]
    assert sum("could not write a rollback snapshot" in m for m in messages) == 1, messages
    assert not any(issubclass(w.category, gw.InternalWarning) for w in caught)
    assert not list(snaps.glob("*.tmp")), "a half-written snapshot was left behind"
    gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        assert run.steps == 12
        nan = run.findings().query("kind == 'nonfinite'")
        assert list(nan["step"]) == [8]
        outcome = nan.iloc[0]["data"]["outcome"]
        assert outcome["rolled_back"] is False  # no snapshot to restore: the step was skipped instead


def test_a_directory_where_an_old_snapshot_was_disables_snapshots_only(tmp_path: Path) -> None:
    snaps = tmp_path / "snaps"
    model = gw.watch(_model(), run=tmp_path / "run", rules=_rollback(), snapshot_dir=snaps, snapshot_keep=1,
                     snapshot_every=1, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            if step == 2:  # someone made a directory of the snapshot that is about to be replaced
                (old,) = snaps.glob("snapshot-*.pt")
                old.unlink()
                old.mkdir()
                (old / "keep").write_text("x")
            opt.zero_grad()
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            gw.watcher(model).observe(loss=loss)
            opt.step()
    assert not gw.watcher(model).detached
    assert any("could not write a rollback snapshot" in str(w.message) for w in caught)
    assert gw.watcher(model).step == 6


def test_a_number_too_large_for_a_float_is_refused_at_observe(tmp_path: Path) -> None:
    model = gw.watch(_model(), run=tmp_path / "run", console=False)
    with pytest.raises(ValueError, match="too large for a float"):
        gw.watcher(model).observe(loss=10**400)
    assert _loop(model, 3) == 3
    assert not gw.watcher(model).detached
    gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        assert run.steps == 3 and run.status == "finished"


def test_after_an_internal_failure_the_watcher_stays_reachable_and_does_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check = Judge.check

    def broken(self: Judge, record: object) -> object:
        if getattr(record, "step", 0) == 3:
            raise RuntimeError("planted bug in gradwatch")
        return check(self, record)  # type: ignore[arg-type]

    monkeypatch.setattr(Judge, "check", broken)
    model = gw.watch(_model(), run=tmp_path / "run", console=False)
    with pytest.warns(gw.InternalWarning, match="planted bug"):
        assert _loop(model, 8) == 8  # the README's loop keeps calling gw.watcher(model).observe(...)
    watcher = gw.watcher(model)
    assert watcher.detached and watcher.closed
    watcher.observe(loss=1.0)
    watcher.flush()
    assert list(watcher.batches([1, 2])) == [1, 2]
    assert not model._forward_pre_hooks and not model._forward_hooks, "hooks left on the model"
    with gw.open_run(tmp_path / "run") as run:
        assert run.status == "crashed" and run.steps == 3
    gw.unwatch(model)
    with pytest.raises(gw.ConfigError, match="not watched"):
        gw.watcher(model)
    gw.watch(model, run=tmp_path / "again", console=False)  # a detached model can be watched afresh
    assert _loop(model, 2) == 2
    assert not gw.watcher(model).detached


# ----------------------------------------------------------------- item 2
def test_flush_seconds_beyond_an_hour_is_refused(tmp_path: Path) -> None:
    with pytest.raises(gw.ConfigError, match=r"flush_seconds must be a finite positive number of seconds, at most 3600"
                       ):
        gw.watch(_model(), run=tmp_path / "run", flush_seconds=1e10)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("rules", [None, "default"])
def test_a_dead_writer_thread_never_blocks_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    rules: str | None) -> None:
    def dies(self: Writer, method: str, arg: object) -> None:
        raise RuntimeError("planted: the writer thread dies")

    monkeypatch.setattr(Writer, "_dispatch", dies)
    model = gw.watch(_model(), run=tmp_path / "run", rules=rules, queue_size=4, console=False)
    result: list[int] = []
    caught: list[warnings.WarningMessage] = []

    def train() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            result.append(_loop(model, 20, nan_at=10))  # 5x the queue, and a finding that flushes
        caught.extend(seen)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "training blocked on gradwatch's dead writer thread"
    assert result == [20]
    assert gw.watcher(model).detached
    internal = [str(w.message) for w in caught if issubclass(w.category, gw.InternalWarning)]
    assert len(internal) == 1 and "writer thread stopped" in internal[0], internal


# ----------------------------------------------------------------- item 3
_KILLED_AT_PRINT = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    from torch import nn
    import gradwatch as gw
    from gradwatch.judging.judge import Judge
    from gradwatch.sinks.store import Store

    write_findings = Store.write_findings
    def slow(self, findings):  # a slow disk: committing findings takes a while
        time.sleep(0.3)
        write_findings(self, findings)
    Store.write_findings = slow

    show = Judge._print
    def killed(self, finding):  # the process is killed the moment the NaN's line is printed
        show(self, finding)
        if finding.kind == "nonfinite":
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    Judge._print = killed

    rule = sys.argv[2]
    torch.manual_seed(0)
    model = gw.watch(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), run=sys.argv[1],
                     rules=[gw.Rule(when="nonfinite", do=rule)], snapshot_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(20):
        x = torch.randn(16, 8)
        if step == 6:
            x[0, 0] = float("nan")
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
""")


def _killed_at_print(where: Path, rule: str) -> subprocess.CompletedProcess[str]:
    script = where / "train.py"
    script.write_text(_KILLED_AT_PRINT)
    return subprocess.run([sys.executable, str(script), str(where / "run"), rule], capture_output=True, text=True,
                          timeout=300, cwd=where)


#: what ``killed`` gives: by rule, the killed training's process to come, and its folder
Killed = dict[str, tuple[Future[subprocess.CompletedProcess[str]], Path]]


@pytest.fixture(scope="module")
def killed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Killed]:
    """The killed trainings of the rules this session tests, started together as the module begins (two
    processes beside the test process), each in a folder of its own."""
    with ThreadPoolExecutor(2) as runner:
        started: Killed = {}
        test = "test_a_finding_on_the_console_is_in_the_store_when_the_process_is_killed"
        for rule in pool.chosen(request, "rule", test=test):
            where = tmp_path_factory.mktemp(f"killed-{rule}")
            started[rule] = (runner.submit(_killed_at_print, where, rule), where)
        yield started
        for future, _ in started.values():
            future.cancel()  # a session stopped early (-x) runs no training it no longer tests


@pytest.fixture(scope="module", autouse=True)
def _killed_as_the_module_begins(killed: Killed) -> None:
    """Start the killed trainings with the module's first test."""


@pytest.mark.parametrize("rule", ["skip", "rollback"])
@pytest.mark.slow  # a training subprocess, killed
def test_a_finding_on_the_console_is_in_the_store_when_the_process_is_killed(killed: Killed, rule: str) -> None:
    future, tmp_path = killed[rule]
    proc = future.result()
    run = tmp_path / "run"
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "step 6 nonfinite" in proc.stderr  # the line was printed
    with gw.open_run(run) as opened:
        found = opened.findings().query("kind == 'nonfinite'")
    assert list(found["step"]) == [6], "the printed finding is missing from the store"
    outcome = found.iloc[0]["data"].get("outcome", {})
    if rule == "rollback":
        assert outcome.get("rolled_back") is True and outcome.get("restored_step") == 5, outcome
    else:
        assert outcome.get("skipped") is True, outcome
    check = subprocess.run([sys.executable, "-m", "gradwatch", "check", str(run)], capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 1, check.stdout + check.stderr


# ---------------------------------------------------------------- item 10
def test_grad_norm_cannot_be_observed(tmp_path: Path) -> None:
    model = gw.watch(_model(), run=tmp_path / "run", console=False)
    with pytest.raises(ValueError, match="'grad_norm' is measured by gradwatch itself"):
        gw.watcher(model).observe(grad_norm=123.0)
    _loop(model, 2)
    assert gw.watcher(model).latest["grad_norm"] != 123.0
