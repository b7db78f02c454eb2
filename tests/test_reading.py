"""Reading a run as a newcomer does: unknown names raise with the valid ones listed, missing values
are None, a run still being written is flushed and says it is live, and a run directory that
already holds a run is reused, refused or replaced as documented (docs/reading.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.errors import DamagedStoreError
from gradwatch.store.schema import DB_NAME

from .conftest import train


def sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def batches() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(16, 4), torch.randn(16, 1)


@pytest.fixture
def run(run_dir: Path) -> gw.Run:
    model = gw.watch(sequential(), run=run_dir, console=False, sample_every=1)
    train(model, batches, nn.functional.mse_loss, steps=12)
    gw.watcher(model).observe(acc=0.5)
    train(model, batches, nn.functional.mse_loss, steps=1)
    gw.unwatch(model)
    return gw.open_run(run_dir)


@pytest.mark.parametrize(("call", "message"), [
    (lambda r: r.metrics("grad_nrom"),
     r"unknown metric 'grad_nrom'; did you mean 'grad_norm'\? valid metrics are: .*'acc'"),
    (lambda r: r.metrics(["grad_norm", "lss"]), r"unknown metric 'lss'; did you mean 'loss'\?"),
    (lambda r: r.metrics(layers=["fc1"]), r"unknown layer 'fc1'; valid layers are: '0', '1', '2'$"),
    (lambda r: r.metrics("grad_norm", layers="0.weight"),
     r"'0.weight' is a parameter, not a layer: pass per_parameter=True"),
    (lambda r: r.metrics("grad_norm", layers=["0.wieght"], per_parameter=True),
     r"unknown layer '0.wieght'; did you mean '0.weight'\? valid layers are: '0', '1', '2', '0.weight'"),
    (lambda r: r.matrix("gradnorm"), r"unknown metric 'gradnorm'; did you mean 'grad_norm'\? valid metrics are: "
                                     r"'act_norm', .*'update_ratio'$"),
    (lambda r: r.matrix("loss"), r"'loss' is a global scalar, not a per-layer metric: read it with run.scalars\(\)"),
    (lambda r: r.matrix("grad_norm", scope="params"), r"unknown scope 'params'; valid scopes are: 'layer', 'param'"),
    (lambda r: r.series("los"), r"unknown metric 'los'; did you mean 'loss'\?"),
    (lambda r: r.scalars(["lr", "accc"]), r"unknown metric 'accc'; did you mean 'acc'\?"),
])
def test_unknown_names_raise_with_the_valid_ones_listed(run: gw.Run, call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        call(run)


def test_a_closed_run_says_it_is_closed_not_damaged(run: gw.Run) -> None:
    with run:
        assert run.steps == 13
    assert repr(run) == f"Run({str(run.path)!r}, closed)"
    for read in (lambda: run.steps, lambda: run.scalars(), lambda: run.findings(), lambda: run.layout()):
        with pytest.raises(gw.RunError, match=r"was closed .*open it again") as caught:
            read()
        assert not isinstance(caught.value, DamagedStoreError)


def test_known_names_read_as_before(run: gw.Run) -> None:
    assert set(run.metrics("grad_norm", layers=["0"])["layer"]) == {"0"}
    assert set(run.metrics("grad_norm", layers=["0.weight"], per_parameter=True)["layer"]) == {"0.weight"}
    assert run.metrics("acc")["value"].tolist() == [0.5]  # an observed scalar is a metric of this run
    assert list(run.matrix("grad_norm").columns) == ["0", "1", "2"]
    assert run.scalars(["acc"])["acc"].dropna().tolist() == [0.5]
    # a metric gradwatch measures but this run lacks is an empty answer, not an error
    assert run.metrics("grad_norm_preclip").empty and run.series("grad_norm_preclip")[0].size == 0


def test_a_long_list_of_valid_names_is_cut_and_says_where_to_see_them(run_dir: Path) -> None:
    model = gw.watch(nn.Sequential(*[nn.Linear(2, 2) for _ in range(40)]), run=run_dir, console=False)
    train(model, lambda: (torch.randn(4, 2), torch.randn(4, 2)), nn.functional.mse_loss, steps=2)
    gw.unwatch(model)
    with pytest.raises(ValueError, match=r"'29' \.\.\. \(40 in all: run\.layers\)$"):
        gw.open_run(run_dir).metrics(layers=["40"])


def _exploding_and_global(run_dir: Path) -> gw.Run:
    """A run with findings on layers (exploding) and a global one (the loss spike: no layer, no phase)."""
    model = gw.watch(sequential(), run=run_dir, console=False, rules=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(30):
        x, y = batches()
        if step == 25:
            y = y * 1e4
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)
    return gw.open_run(run_dir)


def test_a_global_findings_layer_and_phase_are_none_whatever_else_is_in_the_frame(run_dir: Path) -> None:
    found = _exploding_and_global(run_dir).findings()
    spike = found[found["kind"] == "loss_spike"]
    assert len(spike) == 1, found
    assert spike["layer"].tolist() == [None] and spike["phase"].tolist() == [None]
    for column in ("layer", "phase", "action"):
        assert found[column].dtype == object
        assert not any(isinstance(v, float) for v in found[column]), found[column].tolist()  # never NaN
    assert any(isinstance(v, str) for v in found["layer"])  # beside layer findings (exploding per layer)


def test_an_empty_findings_frame_has_the_same_columns_and_types(run_dir: Path) -> None:
    gw.unwatch(gw.watch(sequential(), run=run_dir, console=False))  # a run without a step: no finding
    found = gw.open_run(run_dir).findings()
    assert found.empty and list(found.columns) == ["step", "kind", "severity", "layer", "phase", "message",
                                                   "action", "data"]
    assert found["layer"].dtype == object and found["data"].dtype == object


def test_open_run_in_the_writing_process_flushes_and_says_it_is_live(run_dir: Path) -> None:
    model = gw.watch(sequential(), run=run_dir, console=False, flush_seconds=60.0)
    train(model, batches, nn.functional.mse_loss, steps=50)
    run = gw.open_run(run_dir)
    # the writer commits every 60 s here: without the flush at open_run next to nothing is on disk;
    # the latest step is written when the next step begins or the run closes
    assert run.steps >= 49 and run.status == "running" and run.live
    assert "live: still being written" in repr(run)
    assert run.verdict is None
    gw.watcher(model).close()
    assert (run.steps, run.status, run.live) == (50, "finished", False)
    assert "live" not in repr(run)


@pytest.mark.slow  # a training subprocess
def test_a_run_written_by_another_live_process_is_live(run_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        from torch import nn
        import gradwatch as gw
        model = gw.watch(nn.Linear(3, 1), run={str(run_dir)!r}, console=False, flush_seconds=0.05)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad(); model(torch.randn(2, 3)).sum().backward(); opt.step()
        gw.watcher(model).flush()
        print("ready", flush=True)
        sys.stdin.readline()
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        run = gw.open_run(run_dir)
        assert run.live and run.status == "running" and run.steps >= 4
        # (the store's lock names the writer where locks exist; the recorded pid otherwise)
        with pytest.raises(gw.RunError, match=r"being written by|process \d+ is still writing"):
            gw.watch(nn.Linear(3, 1), run=run_dir, overwrite=True)  # never replaced under a live writer
    finally:
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.close()
        proc.wait(timeout=60)
    assert (gw.open_run(run_dir).status, gw.open_run(run_dir).live) == ("finished", False)


def _stop_before_the_first_step(run_dir: Path) -> None:
    """A script that dies before its first optimizer step: a crashed run of 0 steps."""
    code = (f"import os, torch, gradwatch as gw; gw.watch(torch.nn.Linear(2, 1), run={str(run_dir)!r}, "
            "console=False); os._exit(1)")
    subprocess.run([sys.executable, "-c", code], check=False, timeout=120)


@pytest.mark.slow  # a subprocess that dies before its first step
def test_an_empty_crashed_run_is_replaced_without_overwrite(run_dir: Path) -> None:
    _stop_before_the_first_step(run_dir)
    assert (gw.open_run(run_dir).status, gw.open_run(run_dir).steps) == ("crashed", 0)
    model = gw.watch(sequential(), run=run_dir, console=False)
    train(model, batches, nn.functional.mse_loss, steps=3)
    gw.unwatch(model)
    assert (gw.open_run(run_dir).status, gw.open_run(run_dir).steps) == ("finished", 3)


def test_a_run_with_steps_is_refused_then_replaced_with_overwrite(run_dir: Path) -> None:
    model = gw.watch(sequential(), run=run_dir, console=False)
    train(model, batches, nn.functional.mse_loss, steps=3)
    gw.unwatch(model)
    (run_dir / "report.html").write_text("old report")
    with pytest.raises(gw.RunError, match=r"already holds a run \(finished, 3 steps\); pass a new run= path, "
                                          r"or overwrite=True to replace it"):
        gw.watch(sequential(), run=run_dir)
    assert gw.open_run(run_dir).steps == 3
    assert (run_dir / "verdict.json").exists()
    model = gw.watch(sequential(), run=run_dir, console=False, overwrite=True)
    assert not (run_dir / "verdict.json").exists() and not (run_dir / "report.html").exists()
    assert gw.open_run(run_dir).steps == 0
    gw.unwatch(model)


def test_an_unreadable_store_needs_overwrite(run_dir: Path) -> None:
    run_dir.mkdir()
    (run_dir / DB_NAME).write_bytes(b"not a database at all" * 100)
    with pytest.raises(gw.RunError, match="already holds a run store that cannot be read"):
        gw.watch(sequential(), run=run_dir)
    gw.unwatch(gw.watch(sequential(), run=run_dir, overwrite=True, console=False))
    assert gw.open_run(run_dir).status == "finished"


@pytest.mark.slow  # a fresh interpreter
def test_reading_needs_no_torch(run: gw.Run) -> None:
    code = (f"import sys, gradwatch as gw; r = gw.open_run({str(run.path)!r}); r.metrics(); r.findings(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert out.stdout.strip() == "False"


def test_missing_values_in_metrics_are_none_for_global_rows(run: gw.Run) -> None:
    frame = run.metrics(["grad_norm"])
    assert frame["layer"].dtype == object
    assert frame.loc[frame["layer"].isna(), "layer"].map(type).eq(type(None)).all()
    assert isinstance(frame, pd.DataFrame)
