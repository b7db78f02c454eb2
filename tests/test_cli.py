"""The ``gradwatch`` command line, run as users run it: the installed console script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import gradwatch as gw


def gradwatch(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["gradwatch", *args], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "COLUMNS": "120"})


@pytest.mark.slow  # trains the demo in a subprocess
def test_demo_trains_writes_a_run_and_summarises_it(tmp_path: Path) -> None:
    result = gradwatch("demo", "--run", str(tmp_path / "demo"), "--steps", "40")
    assert result.returncode == 0, result.stderr
    run = gw.open_run(tmp_path / "demo")
    assert run.steps == 40 and run.status == "finished"
    out = result.stdout
    assert "steps" in out and "40" in out
    assert "global grad norm" in out
    assert "smallest gradients" in out and "largest gradients" in out
    smallest = run.metrics("grad_norm", include_global=False).groupby("layer")["value"].median().idxmin()
    assert smallest in out
    assert "tensorboard --logdir" in out
    report = tmp_path / "demo" / "report.html"
    assert f"Report:       {report}" in out
    assert f"Dashboard:    gradwatch dashboard {tmp_path}  (then open http://127.0.0.1:6007/)" in out
    assert report.is_file() and 'data-state="' in report.read_text(encoding="utf-8")
    assert not [p.name for p in report.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow  # the full 300-step demo in a subprocess
def test_demo_pathologies_are_found_and_rescued(tmp_path: Path) -> None:
    """The full demo: a NaN born in `features` at step 100 is skipped, the explosion at 180 clipped."""
    result = gradwatch("demo", "--run", str(tmp_path / "demo"))
    assert result.returncode == 0, result.stderr
    run = gw.open_run(tmp_path / "demo")
    found = run.findings()
    key = list(zip(found.step, found.kind, found.layer, found.action))
    assert (100, "nonfinite", "features", "skip") in key
    assert (180, "exploding", "head", "clip") in key
    assert set(found.severity[found.step < 100]) <= {"info"}, "the healthy stretch before the trouble is quiet"
    loss = run.scalars()["loss"]
    assert loss.iloc[-20:].mean() < 0.1 * loss.iloc[:20].mean()
    assert "findings" in result.stdout and "features" in result.stdout and "skip" in result.stdout
    head = result.stdout.splitlines()[:4]  # said first, before the red error: the trouble is planted on purpose
    assert head[1] == "Two batches are bad on purpose, to show what gradwatch finds and how its rules rescue training:"
    assert head[2].startswith("  step 100: ") and head[3].startswith("  step 180: ")
    assert "The findings at steps 100 and 180 come from the batches made bad on purpose" in result.stdout
    assert run.verdict["worst"] == "error" and run.verdict["status"] == "finished"
    report = (tmp_path / "demo" / "report.html").read_text(encoding="utf-8")
    assert 'id="verdict" data-state="errors"' in report
    assert 'data-kind="nonfinite" data-step="100"' in report and 'data-kind="exploding" data-step="180"' in report


@pytest.mark.slow  # trains the demo in a subprocess
def test_demo_default_run_directory(tmp_path: Path) -> None:
    result = gradwatch("demo", "--steps", "5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert gw.open_run(tmp_path / "runs" / "demo").steps == 5


def test_python_dash_m_and_version() -> None:
    result = subprocess.run([sys.executable, "-m", "gradwatch", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and gw.__version__ in result.stdout


def test_usage_error_exits_2_without_traceback() -> None:
    result = gradwatch("demo", "--steps", "0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "--steps" in result.stderr


@pytest.mark.slow  # starts the demo in a subprocess
def test_unwritable_run_is_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    result = gradwatch("demo", "--run", str(tmp_path / "file" / "run"), "--steps", "2")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("gradwatch: error: cannot create run directory")
