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
from gradwatch.snapshots import Snapshots, rng_state

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
    from gradwatch.snapshots import Snapshots, rng_state

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
