"""The command line agrees with itself: ``check`` takes a folder of runs as ``ls`` and ``dashboard`` do,
``-o`` creates the folders it needs, and every usage error is one ``gradwatch: error:`` line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import gradwatch as gw
from gradwatch.cli import cli


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def gradwatch(*args: str, cwd: Path | None = None) -> Result:
    """The command, run in this process through the same entry (``cli.main``) as the console script."""
    here = Path.cwd()
    try:
        os.chdir(cwd or here)
        res = CliRunner().invoke(cli, list(args), env={"COLUMNS": "160"}, prog_name="gradwatch")
    finally:
        os.chdir(here)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return Result(res.exit_code, res.stdout, res.stderr)


def installed(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user runs it."""
    return subprocess.run(["gradwatch", *args], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "COLUMNS": "160"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runs/a (healthy), runs/team/b (a NaN: an error), nested as people keep them."""
    root = tmp_path_factory.mktemp("cli") / "runs"
    torch.manual_seed(0)
    for name, poison in (("a", False), ("team/b", True)):
        model = gw.watch(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), run=root / name, console=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(6):
            x = torch.randn(8, 3)
            if poison and step == 3:
                x[0, 0] = float("nan")
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        gw.unwatch(model)
    return root


def test_check_a_folder_checks_every_run_under_it_like_ls(runs: Path) -> None:
    listed = json.loads(gradwatch("ls", str(runs), "--format", "json").stdout)
    checked = gradwatch("check", str(runs), "--format", "json")
    assert checked.returncode == 1, checked.stderr  # runs/team/b has an error
    verdicts = {Path(r["run"]).relative_to(runs).as_posix(): r["verdict"] for r in json.loads(checked.stdout)}
    assert verdicts == {"a": "pass", "team/b": "fail"}
    assert sorted(verdicts) == sorted(r["run"] for r in listed), "check and ls find the same runs"
    # a folder and one of its runs named again: each run is judged once
    again = json.loads(gradwatch("check", str(runs), str(runs / "a"), "--format", "json").stdout)
    assert len(again) == 2


def test_check_a_folder_without_runs_is_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "nothing" / "here").mkdir(parents=True)
    result = gradwatch("check", str(tmp_path / "nothing"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "is not a gradwatch run and holds none" in result.stderr


@pytest.mark.parametrize(("fmt", "name"), [("junit", "gw.xml"), ("json", "gw.json"), ("text", "gw.txt")])
def test_check_output_creates_missing_folders(runs: Path, tmp_path: Path, fmt: str, name: str) -> None:
    out = tmp_path / "out" / "deeper" / name
    result = gradwatch("check", str(runs / "a"), "--format", fmt, "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.is_file() and out.stat().st_size > 0 and result.stdout == ""


def test_report_output_creates_missing_folders(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "reports" / "a.html"
    result = gradwatch("report", str(runs / "a"), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.is_file() and result.stdout.strip() == str(out)


def test_output_that_cannot_be_written_is_one_line(runs: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a file, not a folder")
    result = gradwatch("check", str(runs / "a"), "-o", str(tmp_path / "file" / "gw.xml"))
    assert result.returncode == 2 and result.stderr.startswith("gradwatch: error: cannot write the check report")
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize(("args", "expected"), [
    (("check", "runs", "--format", "xml"),
     "gradwatch: error: Invalid value for '--format': 'xml' is not one of 'text', 'json', 'junit', 'github'; "
     "see 'gradwatch check --help'"),
    (("check",), "gradwatch: error: Missing argument 'RUNS...'; see 'gradwatch check --help'"),
    (("check", "runs", "--fail-on", "fatal"), "gradwatch: error: Invalid value for '--fail-on'"),
    (("report",), "gradwatch: error: Missing argument 'RUN'; see 'gradwatch report --help'"),
    (("demo", "--steps", "0"), "gradwatch: error: Invalid value for '--steps': 0 is not in the range x>=1"),
    (("dashboard", "--port", "http"), "gradwatch: error: Invalid value for '--port': 'http' is not a whole number"),
    (("ls", "--colour"), "gradwatch: error: No such option '--colour'; see 'gradwatch ls --help'"),
    (("lss",), "gradwatch: error: No such command 'lss'"),
    (("ls", "no/such/folder"), "gradwatch: error: no such folder: 'no/such/folder'; see 'gradwatch ls --help'"),
])
def test_usage_errors_are_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...], expected: str) -> None:
    result = gradwatch(*args, cwd=tmp_path)
    assert result.returncode == 2, result
    assert result.stderr.count("\n") == 1, result.stderr  # one line: no usage block, no "Try ... --help"
    assert result.stderr.startswith(expected), result.stderr
    assert "Usage:" not in result.stderr and "Traceback" not in result.stderr


def test_the_installed_console_script_reports_errors_the_same_way(tmp_path: Path) -> None:
    result = installed("check", "x", "--format", "xml", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("gradwatch: error: Invalid value for '--format'")


def test_python_dash_m_reports_errors_the_same_way(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "gradwatch", "check", "x", "--format", "xml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("gradwatch: error: Invalid value for '--format'")


def test_help_and_version_still_exit_0() -> None:
    assert gradwatch("--help").returncode == 0
    assert gradwatch("check", "--help").stdout.startswith("Usage: gradwatch check")
    assert gradwatch("--version").stdout.strip() == f"gradwatch, version {gw.__version__}"


def test_github_annotations_name_no_file_and_count_findings_in_words(runs: Path) -> None:
    result = gradwatch("check", str(runs), "--format", "github")
    assert result.returncode == 1
    annotations = [line for line in result.stdout.splitlines() if line.startswith("::")]
    assert annotations and all(line.startswith(("::error title=", "::warning title=")) for line in annotations)
    assert "gradwatch.sqlite" not in result.stdout
    assert f"PASS: {runs / 'a'}: 0 findings at or above error" in result.stdout
    assert f"FAIL: {runs / 'team' / 'b'}: 1 finding at or above error" in result.stdout
