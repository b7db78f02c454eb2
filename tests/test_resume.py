"""Runs that resume (``gw.watch(..., resume=True, start_step=N)``): one continuous run, restarts marked.

The store's semantics are tested in-process here (superseded rows kept, ids and layouts going on, the
lock, old stores); the end-to-end test kills a training subprocess and resumes it from its checkpoint
(tests/test_resume_killed.py).
"""

from __future__ import annotations

import json
import math
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import gradwatch as gw
from gradwatch.cli import check as _registers_check  # noqa: F401
from gradwatch.cli import cli
from gradwatch.errors import ConfigError, GradwatchWarning, RunError
from gradwatch.step.layout import discover
from gradwatch.store import resume
from gradwatch.store.schema import DB_NAME, SCHEMA_VERSION


def _model(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))


def _train(run: Path, steps: int, *, losses: list[float] | None = None, model: nn.Module | None = None,
           **options: object) -> nn.Module:
    """Train ``steps`` steps into ``run``; ``losses`` are observed as the steps' losses (else the real one)."""
    model = model if model is not None else _model()
    gw.watch(model, run=run, rules=None, console=False, origin=False, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(steps):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        gw.watcher(model).observe(loss=loss if losses is None else losses[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    gw.watcher(model).close()
    return model


def _steady(n: int, level: float = 1.0) -> list[float]:
    """A healthy loss: a level with a small deterministic wiggle."""
    return [level + 0.01 * math.sin(i) for i in range(n)]


def test_a_resumed_run_is_one_continuous_run_and_keeps_the_superseded_rows(run_dir: Path) -> None:
    first = _steady(20)
    first[15] = math.nan  # a non-finite loss at step 15: a finding of the earlier process, past the restart
    _train(run_dir, 20, losses=first)
    with gw.open_run(run_dir) as run:
        assert list(run.findings()["step"]) == [15]
    second = [1.0 + 0.01 * math.cos(i) for i in range(10)]
    _train(run_dir, 10, losses=second, resume=True, start_step=12)

    with gw.open_run(run_dir) as run:
        assert run.status == "finished" and run.steps == 22
        assert list(run.step_info()["step"]) == list(range(22))
        loss = run.scalars()["loss"]
        assert list(loss.index) == list(range(22))
        assert loss.loc[:11].tolist() == pytest.approx(first[:12])  # the earlier process's, before the restart
        assert loss.loc[12:].tolist() == pytest.approx(second)  # the resumed process's
        assert run.findings().empty  # step 15's finding was the earlier process's, superseded
        assert set(run.metrics(metrics="grad_norm", include_global=False)["step"]) == set(range(22))
        [restart] = run.restarts
        assert restart["restart"] == 1 and restart["step"] == 12 and restart["superseded"] == 8
        assert restart["previous_status"] == "finished" and restart["layout_changed"] is False
        assert run.progress()["restarts"] == 1
        # nothing was deleted: the earlier process's rows from the restart on are kept, marked
        steps = run.superseded("steps")
        assert list(steps["step"]) == list(range(12, 20)) and set(steps["restart"]) == {1}
        kept = run.superseded("scalars")
        old_loss = kept[kept["metric"] == "loss"].set_index("step")["value"]
        assert list(old_loss.index) == list(range(12, 20))
        assert old_loss.drop(15).tolist() == pytest.approx([first[s] for s in range(12, 20) if s != 15])
        found = run.superseded("findings")
        assert list(found["step"]) == [15] and list(found["kind"]) == ["nonfinite"]
        assert list(found["restart"]) == [1]
        assert run.verdict is not None and run.verdict["status"] == "finished" and run.verdict["steps"] == 22
    conn = sqlite3.connect(run_dir / DB_NAME)
    try:  # the format stays the one every reader reads: no migration, no new version
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 1
    finally:
        conn.close()


def test_finding_ids_go_on_from_the_stored_ones(run_dir: Path) -> None:
    first = _steady(10)
    first[3] = first[4] = math.nan  # one finding, its repeat folded into it
    _train(run_dir, 10, losses=first)
    second = _steady(6)
    second[2] = math.inf  # step 10 + 2
    _train(run_dir, 6, losses=second, resume=True)  # no start_step: after the last stored step

    with gw.open_run(run_dir) as run:
        assert run.restarts[0]["step"] == 10 and run.restarts[0]["superseded"] == 0
        assert list(run.findings()["step"]) == [3, 12]  # the earlier finding was not replaced by the new one
        assert run.superseded("findings").empty
        assert run.findings()["data"][0]["repeats"] == 2
        assert run.verdict is not None and run.verdict["findings"]["error"] == 3  # both processes' occurrences


def test_a_second_restart_supersedes_the_first_ones_steps_too(run_dir: Path) -> None:
    _train(run_dir, 10, losses=_steady(10))
    _train(run_dir, 10, losses=_steady(10, 2.0), resume=True, start_step=8)  # steps 8..17
    _train(run_dir, 5, losses=_steady(5, 3.0), resume=True, start_step=15)  # steps 15..19

    with gw.open_run(run_dir) as run:
        assert [(r["restart"], r["step"], r["superseded"]) for r in run.restarts] == [(1, 8, 2), (2, 15, 3)]
        loss = run.scalars()["loss"]
        assert list(loss.index) == list(range(20))
        assert loss.loc[:7].tolist() == pytest.approx(_steady(8))
        assert loss.loc[8:14].tolist() == pytest.approx(_steady(7, 2.0))
        assert loss.loc[15:].tolist() == pytest.approx(_steady(5, 3.0))
        steps = run.superseded("steps")
        assert steps.groupby("restart")["step"].apply(list).to_dict() == {1: [8, 9], 2: [15, 16, 17]}


def test_resume_of_a_run_whose_writer_was_killed_is_allowed(run_dir: Path) -> None:
    """A preempted job leaves its run 'running' under a pid that is gone: it may be resumed."""
    _train(run_dir, 6, losses=_steady(6))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    conn = sqlite3.connect(run_dir / DB_NAME)
    with conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'status'", (json.dumps("running"),))
        conn.execute("UPDATE meta SET value = ? WHERE key = 'pid'", (json.dumps(int(dead.stdout)),))
    conn.close()
    with gw.open_run(run_dir) as run:
        assert run.status == "crashed"  # running, by a process that is gone

    _train(run_dir, 3, losses=_steady(3), resume=True, start_step=4)
    with gw.open_run(run_dir) as run:
        assert run.status == "finished"  # the last process's ending
        assert run.restarts[0]["previous_status"] == "running" and run.steps == 7
        assert "finished" in run.meta and run.meta["pid"] != int(dead.stdout)


def test_resume_of_a_run_being_written_is_refused(run_dir: Path) -> None:
    model = _model()
    gw.watch(model, run=run_dir, rules=None, console=False)
    try:
        with pytest.raises(RunError, match="being written"):
            resume.resume_store(run_dir, {"pid": 1, "host": "elsewhere"}, 0, discover(_model(), version=1).layout)
    finally:
        gw.unwatch(model)
    with gw.open_run(run_dir) as run:
        assert run.restarts == [] and run.status == "finished"


def test_resume_without_a_stored_run_starts_a_new_one_from_start_step(run_dir: Path, tmp_path: Path) -> None:
    _train(run_dir, 4, losses=_steady(4), resume=True)
    with gw.open_run(run_dir) as run:
        assert list(run.step_info()["step"]) == [0, 1, 2, 3] and run.restarts == []
    other = tmp_path / "other"
    _train(other, 3, losses=_steady(3), resume=True, start_step=100)
    with gw.open_run(other) as run:
        assert list(run.step_info()["step"]) == [100, 101, 102] and run.restarts == []


def test_start_step_without_resume_numbers_a_new_run_from_it(run_dir: Path) -> None:
    _train(run_dir, 3, losses=_steady(3), start_step=50)
    with gw.open_run(run_dir) as run:
        assert list(run.scalars().index) == [50, 51, 52] and run.restarts == []
    with pytest.raises(RunError, match="already holds a run"):  # a stored run is resumed only when asked to
        _train(run_dir, 1, start_step=53)


def test_a_run_that_resumes_with_another_layout_says_so(run_dir: Path) -> None:
    _train(run_dir, 5, losses=_steady(5))
    changed = r"another layout than the run's \(changes the type or size of '0', '2', '0.weight'"
    with pytest.warns(GradwatchWarning, match=changed):
        _train(run_dir, 3, losses=_steady(3), model=_model(width=16), resume=True, start_step=5)
    with gw.open_run(run_dir) as run:
        [restart] = run.restarts
        assert restart["layout_changed"] is True
        [change] = run.meta["layout_changes"]
        assert change["restart"] == 1 and change["step"] == 5
        assert change["changed"] == ["0", "2", "0.weight", "0.bias", "2.weight"]
        assert change["added"] == change["removed"] == []
        assert run.layers == ["0", "1", "2"]
        assert run.layout().layer_numel[0] == 16 * 4 + 16  # the new layout is the latest
        assert run.layout(1).layer_numel[0] == 8 * 4 + 8  # the earlier one still decodes the earlier steps
        norms = run.matrix("grad_norm")  # both layouts' steps, as the latest layout's columns
        assert list(norms.index) == list(range(8)) and norms[["0", "2"]].notna().all().all()


def test_the_same_layout_goes_on_as_the_same_version(run_dir: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradwatchWarning)
        _train(run_dir, 5, losses=_steady(5))
        _train(run_dir, 3, losses=_steady(3), resume=True, start_step=5)
    conn = sqlite3.connect(run_dir / DB_NAME)
    try:
        assert conn.execute("SELECT DISTINCT layout FROM steps").fetchall() == [(1,)]
    finally:
        conn.close()


def _spike_run(run_dir: Path, **options: object) -> list[int]:
    """The steps of the loss spikes found in a process that trains 5 steps, a spike at its second."""
    losses = _steady(5)
    losses[1] = 50.0
    _train(run_dir, 5, losses=losses, **options)
    with gw.open_run(run_dir) as run:
        found = run.findings()
        return [int(s) for s in found.loc[found["kind"] == "loss_spike", "step"]]


def test_detector_baselines_resume_from_the_stored_history(run_dir: Path, tmp_path: Path) -> None:
    """A spike right after a restart is caught: the loss detector's history is the stored run's, no warm-up."""
    _train(run_dir, 40, losses=_steady(40))
    assert _spike_run(run_dir, resume=True, start_step=30) == [31]
    # the same process without the stored history is still warming up at its second step: nothing found
    assert _spike_run(tmp_path / "fresh", start_step=30) == []


def tensorboard_loss(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``global/loss`` as TensorBoard's two readers read it: (step, value) pairs in the order they give them."""
    from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
    from tensorboard.util import tensor_util

    legacy = event_accumulator.EventAccumulator(str(run_dir))
    legacy.Reload()
    server = plugin_event_accumulator.EventAccumulator(str(run_dir))  # what TensorBoard's server reads with
    server.Reload()
    return {"EventAccumulator": [(e.step, e.value) for e in legacy.Scalars("global/loss")],
            "plugin_event_accumulator": [(e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
                                         for e in server.Tensors("global/loss")]}


def test_tensorboard_reads_one_continuous_run(run_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _train(run_dir, 12, losses=_steady(12))
    _train(run_dir, 6, losses=_steady(6, 5.0), resume=True, start_step=9)  # steps 9..14
    _train(run_dir, 4, losses=_steady(4, 7.0), resume=True, start_step=12)  # steps 12..15
    expected = _steady(9) + _steady(3, 5.0) + _steady(4, 7.0)
    for reader, loss in tensorboard_loss(run_dir).items():
        assert [step for step, _ in loss] == list(range(16)), reader  # the earlier processes' later steps purged
        assert [value for _, value in loss] == pytest.approx(expected, rel=1e-6), reader
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("grad_norm/0")] == list(range(16))


def test_check_reports_the_restarts(run_dir: Path) -> None:
    _train(run_dir, 10, losses=_steady(10))
    _train(run_dir, 4, losses=_steady(4), resume=True, start_step=7)
    runner = CliRunner()
    text = runner.invoke(cli, ["check", str(run_dir)])
    assert text.exit_code == 0, text.output
    # the title starts with the run's path, whose length is the temporary folder's: rich may wrap it
    assert "11 steps, finished, resumed at step 7 (3 steps of the earlier process superseded)" in " ".join(
        text.output.split())
    data = json.loads(runner.invoke(cli, ["check", str(run_dir), "--format", "json"]).output)
    assert data["restarts"] == [{"step": 7, "superseded": 3, "previous_status": "finished", "layout_changed": False}]
    assert data["steps"] == 11 and data["verdict"] == "pass"


def test_a_run_that_never_resumed_reads_as_before(run_dir: Path) -> None:
    _train(run_dir, 3, losses=_steady(3))
    with gw.open_run(run_dir) as run:
        assert run.restarts == [] and run.progress()["restarts"] == 0
        assert run.superseded("steps").empty and run.superseded("findings").empty
        assert list(run.superseded("scalars").columns) == ["restart", "step", "metric", "value"]
        with pytest.raises(ValueError, match="superseded"):
            run.superseded("vectors")
    conn = sqlite3.connect(run_dir / DB_NAME)
    try:  # a new run's store is as it was: the restarts' tables come with the first restart
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        conn.close()
    assert not {"restarts", "superseded_steps"} & tables


@pytest.mark.parametrize(("options", "message"), [
    ({"resume": True, "overwrite": True}, "contradict"),
    ({"resume": "yes"}, "resume must be True or False"),
    ({"start_step": -1}, "start_step must be a step number"),
    ({"start_step": 2.0}, "start_step must be a step number"),
])
def test_bad_resume_options_are_refused(run_dir: Path, options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        gw.watch(_model(), run=run_dir, **options)
    assert not run_dir.exists()


def test_the_report_marks_the_restarts(run_dir: Path) -> None:
    from gradwatch.report import data, figures

    _train(run_dir, 10, losses=_steady(10))
    _train(run_dir, 4, losses=_steady(4), resume=True, start_step=7)
    with gw.open_run(run_dir) as run:
        report = data.collect(run)
    assert report.restarts == [7]
    assert ("resumed", "at step 7 (3 earlier steps superseded)") in report.facts
    fig = figures.timeline(report)
    assert fig is not None
    lines = [s for s in fig.layout.shapes if s.line.dash == "dash"]
    assert {(s.x0, s.x1) for s in lines} == {(7, 7)} and len(lines) == 2  # on the loss's and the norm's chart
    assert [a.text for a in fig.layout.annotations if a.x == 7] == ["resumed"]


@pytest.mark.slow  # a real browser
def test_the_dashboard_marks_the_restarts(run_dir: Path, browser) -> None:  # type: ignore[no-untyped-def]
    from gradwatch.dashboards import data
    from gradwatch.dashboards.server import start

    _train(run_dir, 10, losses=_steady(10))
    _train(run_dir, 4, losses=_steady(4), resume=True, start_step=7)
    with gw.open_run(run_dir) as run:
        assert data.curves(run, data.Curves())["restarts"] == [7]
        assert data.curves(run, data.Curves(), start=8)["restarts"] == []
        summary = data.summary(run, "run")
    assert ["resumed", "at step 7 (3 earlier steps superseded)"] in summary["facts"] and summary["restarts"] == 1
    with start(run_dir.parent, poll=0.25) as dash:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{dash.url}run?run=run")
        page.wait_for_selector("#timeline .main-svg")
        marks = page.evaluate("""() => { const l = document.getElementById('timeline').layout;
            return [l.shapes.filter(s => s.line.dash === 'dash').map(s => s.x0),
                    (l.annotations || []).filter(a => a.text === 'resumed').map(a => a.x)]; }""")
        assert marks == [[7], [7]]
        assert page.locator("text=resumed").count() >= 1


def test_resume_where_a_store_creation_was_interrupted_starts_a_new_run(run_dir: Path) -> None:
    run_dir.mkdir()
    (run_dir / DB_NAME).write_bytes(b"")  # a kill during the creation of an older gradwatch's store
    _train(run_dir, 3, losses=_steady(3), resume=True)
    with gw.open_run(run_dir) as run:
        assert run.steps == 3 and run.restarts == []


def test_a_stored_history_that_cannot_be_replayed_leaves_the_detectors_warming_up(run_dir: Path) -> None:
    first = _steady(8)
    first[1] = math.nan
    _train(run_dir, 8, losses=first)
    conn = sqlite3.connect(run_dir / DB_NAME)
    with conn:  # a damaged vector at step 2: the reader refuses it
        conn.execute("UPDATE vectors SET codec = 0, data = x'00' WHERE step = 2")
    conn.close()
    second = _steady(3)
    second[0] = math.inf
    with pytest.warns(GradwatchWarning, match="could not be replayed into the detectors .*warm up afresh"):
        _train(run_dir, 3, losses=second, resume=True, start_step=6)
    with gw.open_run(run_dir) as run:
        assert run.status == "finished" and run.restarts[0]["step"] == 6
        assert list(run.findings()["step"]) == [1, 6]  # the new finding did not replace the stored one
        assert run.verdict is not None and run.verdict["findings"]["error"] == 2
