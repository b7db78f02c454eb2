"""Snapshot faults: temporary files left by a kill or a failed write are cleaned up (issue 16, item 9)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.step.snapshots import Snapshots, rng_state

from .test_actions import batch, one_step, regression


def test_leftover_temporary_snapshots_are_removed_when_a_run_uses_the_folder(run_dir: Path, tmp_path: Path) -> None:
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    leftovers = [snaps / "snapshot-000000002.pt.tmp", snaps / "snapshot-000000040.pt.tmp"]
    for path in leftovers:
        path.write_bytes(b"half a snapshot" * 1000)  # what a kill or a full disk left behind
    mine = snaps / "notes.tmp"
    mine.write_text("not a snapshot: left alone")
    model, x, y = regression()
    gw.watch(model, run=run_dir, rules=[gw.Rule(when="nonfinite", do="rollback")], snapshot_every=4,
             snapshot_dir=str(snaps), console=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(6):
        one_step(model, opt, *batch(x, y, step))
    gw.unwatch(model)
    assert not any(p.exists() for p in leftovers)
    assert mine.exists()
    assert [p.name for p in sorted(snaps.glob("snapshot-*.pt"))] == ["snapshot-000000000.pt", "snapshot-000000004.pt"]


FULL_DISK = textwrap.dedent(
    """
    import errno, resource, signal, sys
    from pathlib import Path
    import torch
    from gradwatch.step.snapshots import Snapshots, rng_state

    folder = Path(sys.argv[1])
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snaps = Snapshots(2, folder)
    snaps.take(0, torch.nn.Linear(2, 2), [], [], [], rng_state())  # a small one fits
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
    try:
        snaps.take(1, model, [opt], [], [], rng_state())
    except Exception as exc:  # torch reports the EFBIG of its writer as a RuntimeError
        cause = exc if isinstance(exc, OSError) else exc.__context__
        print("failed", errno.errorcode[cause.errno], flush=True)
    else:
        print("written", flush=True)
    """
)


@pytest.mark.slow
def test_a_snapshot_write_that_fails_leaves_no_temporary_file(tmp_path: Path) -> None:
    folder = tmp_path / "snaps"
    script = tmp_path / "full.py"
    script.write_text(FULL_DISK)
    done = subprocess.run([sys.executable, str(script), str(folder)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["failed", "EFBIG"], done.stdout
    assert sorted(p.name for p in folder.iterdir()) == ["snapshot-000000000.pt"], "no half-written file stays"


def test_snapshots_on_disk_still_restore(tmp_path: Path) -> None:
    model = nn.Linear(3, 3)
    snaps = Snapshots(1, tmp_path / "s")
    snap = snaps.take(7, model, [], [], [], rng_state())
    assert snaps.load(snap)["model"]["weight"].equal(model.weight.detach())


INTERRUPTED = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import torch
    from torch import nn
    import gradwatch as gw

    run, snaps, how = sys.argv[1], sys.argv[2], sys.argv[3]
    sig = signal.SIGINT if how == "ctrl-c" else signal.SIGUSR1
    # Ctrl-C as in a terminal, whatever this process inherited: a job put in the background by a
    # non-interactive shell starts with SIGINT ignored, and Python then leaves it ignored
    print("inherited SIGINT handler:", signal.getsignal(signal.SIGINT), file=sys.stderr)  # said if the test fails
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if how == "exit":  # a handler of the user's that ends the process with sys.exit
        signal.signal(signal.SIGUSR1, lambda *_: sys.exit(143))

    def send() -> None:  # the signal arrives the moment the second snapshot's file is opened
        tmp = os.path.join(snaps, "snapshot-000000001.pt.tmp")
        while not os.path.exists(tmp):
            time.sleep(0.0002)
        os.kill(os.getpid(), sig)

    threading.Thread(target=send, daemon=True).start()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 1))  # a 64 MiB snapshot: written for a while
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    gw.watch(model, run=run, rules=[gw.Rule(when="nonfinite", do="rollback")], console=False,
             snapshot_dir=snaps, snapshot_every=1, snapshot_keep=2)
    x = torch.randn(2, 4096)
    step = -1
    try:
        for step in range(20):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    except (KeyboardInterrupt, SystemExit) as exc:
        inside = exc.__context__ is not None and "inline_container" in str(exc.__context__)
        print(type(exc).__name__, getattr(exc, "code", ""), step, "inside" if inside else "outside", flush=True)
        sys.exit(3)
    print("finished", flush=True)
    """
)


@pytest.mark.slow  # a few subprocesses, each interrupted while it writes a snapshot
@pytest.mark.parametrize("how", ["ctrl-c", "exit"])
def test_an_interrupt_while_a_snapshot_is_written_reaches_the_loop(tmp_path: Path, how: str) -> None:
    """torch.save turns a KeyboardInterrupt raised in its file's write into a RuntimeError: it must not be
    taken for a failed snapshot (training would go on, the user unable to stop it), nor leave half a file.
    """
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    outcomes = []
    for attempt in range(6):  # until the signal lands inside torch.save's write (most tries)
        snaps = tmp_path / f"snaps{attempt}"
        done = subprocess.run([sys.executable, str(script), str(tmp_path / f"run{attempt}"), str(snaps), how],
                              capture_output=True, text=True, timeout=300)
        words = done.stdout.split()
        assert done.returncode == 3 and words[0] == ("KeyboardInterrupt" if how == "ctrl-c" else "SystemExit"), \
            (done.stdout, done.stderr[-2000:])
        assert how == "ctrl-c" or words[1] == "143"
        assert words[-2] == "1"  # at the step whose snapshot was being written
        assert "could not write a rollback snapshot" not in done.stderr
        assert not list(snaps.glob("*.tmp")), "no half-written snapshot stays"
        kept = sorted(snaps.glob("snapshot-*.pt"))
        assert [p.name for p in kept] == ["snapshot-000000000.pt"]
        assert set(torch.load(kept[0], weights_only=False)) == {"model", "optimizers", "schedulers", "scalers", "rng"}
        outcomes.append(words[-1])
        if "inside" in outcomes:
            break
    print(how, outcomes)
    assert "inside" in outcomes, f"the signal never landed inside torch.save's write: {outcomes}"


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), SystemExit(143)], ids=["ctrl-c", "exit"])
def test_the_guard_lets_an_interrupt_through_every_hook(interrupt: BaseException) -> None:
    """Only an Exception of gradwatch's own detaches a watcher; an interrupt landing in a hook goes on up."""
    from gradwatch.watching.guard import KINDS, Guard

    failures: list[BaseException] = []
    guard = Guard(lambda exc, kind, args: failures.append(exc))

    def lands(*_: object) -> None:
        raise interrupt

    for kind in KINDS:
        with pytest.raises(type(interrupt)):
            guard.hook(kind, lands)()
    assert not failures and not guard.dead
