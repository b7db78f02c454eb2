"""The CLI's one-line errors read cleanly (a suggestion in parentheses, no stray punctuation, a mistyped
command answered with the closest one, a number that is not one said plainly), and a finding is placed
in the same words by ``check`` and by the report."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import gradwatch as gw
from gradwatch.cli import cli
from gradwatch.judging.gate import Item as Checked
from gradwatch.report import items as report_items


def _error(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), prog_name="gradwatch")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradwatch: error: "), result.output
    return lines[0]


def test_a_mistyped_option_is_answered_in_parentheses() -> None:
    line = _error("check", "runs", "--fail-of", "error")
    assert line == ("gradwatch: error: No such option '--fail-of' (did you mean '--fail-on'?); "
                    "see 'gradwatch check --help'")
    assert "?;" not in line and ".;" not in line


@pytest.mark.parametrize(("typed", "meant"), [("chek", "check"), ("dashbord", "dashboard"), ("reprot", "report"),
                                              ("dem", "demo")])
def test_a_mistyped_command_is_answered_with_the_closest(typed: str, meant: str) -> None:
    assert _error(typed) == (f"gradwatch: error: No such command '{typed}' (did you mean '{meant}'?); "
                             "see 'gradwatch --help'")


def test_a_command_like_none_suggests_nothing() -> None:
    assert _error("zzzz") == "gradwatch: error: No such command 'zzzz'; see 'gradwatch --help'"


@pytest.mark.parametrize(("args", "said"), [
    (("dashboard", "--port", "abc"), "Invalid value for '--port': 'abc' is not a whole number; "
                                     "see 'gradwatch dashboard --help'"),
    (("demo", "--steps", "1.5"), "Invalid value for '--steps': '1.5' is not a whole number; "
                                 "see 'gradwatch demo --help'"),
    (("doctor", "x:y", "--lr", "fast"), "Invalid value for '--lr': 'fast' is not a number; "
                                        "see 'gradwatch doctor --help'"),
])
def test_a_number_that_is_not_one_is_said_plainly(args: tuple[str, ...], said: str) -> None:
    line = _error(*args)
    assert line == f"gradwatch: error: {said}" and "range" not in line


def test_check_and_the_report_place_a_finding_alike(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = gw.watch(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), run=tmp_path / "run",
                     console=False, rules=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        x = torch.randn(16, 4)
        if step == 3:
            x[2, 1] = float("nan")
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        findings = run.findings()
        item = next(i for i in report_items.items(run, findings) if i.step == 3)
    checked = next(Checked.from_row(row) for row in findings.itertuples() if row.step == 3)
    assert item.where == checked.where() == "the input batch"
    github = CliRunner().invoke(cli, ["check", str(tmp_path / "run"), "--format", "github"])
    assert github.output.startswith("::error title=gradwatch nonfinite at the input batch%2C step 3 ")
    assert "(global)" not in github.output
