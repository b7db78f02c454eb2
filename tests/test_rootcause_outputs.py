"""A root cause is shown everywhere a finding is (issue 18, item 5): console, store, check JSON, report, dashboard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import gradwatch as gw
from gradwatch.cli import check as _registers_check  # noqa: F401
from gradwatch.cli import cli
from gradwatch.dashboards import data as dashboard
from gradwatch.judging import gate
from gradwatch.report.render import render
from gradwatch.rootcause import words

CODE = "return torch.log(x.clamp(max=8.0) - 1.0)"


class Feature(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x.clamp(max=8.0) - 1.0)


def train(run_dir: Path, console: bool) -> None:
    model = nn.Sequential(nn.Linear(4, 4), Feature(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.fill_(2.0)
    gw.watch(model, run=run_dir, console=console)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(4):
        x, y = torch.rand(6, 4), torch.randn(6, 1)
        if step == 2:
            x[4, 1] = -2.0  # 2 - 2 - 1 = -1: log of a negative value
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        gw.watcher(model).observe(loss=loss, sample_ids=[f"row-{step}-{i}" for i in range(6)])
        opt.step()
    gw.unwatch(model)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rootcause") / "run"
    train(path, console=False)
    return path


FACT = "1 of the input's 24 values is negative (min -1)"


def test_console_prints_the_op_line_fact_cause_and_samples(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train(tmp_path / "run", console=True)
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "gradwatch error step 2 nonfinite 1: NaN born in `aten::log` at test_rootcause_outputs.py:" in err
    assert f"`{CODE}` in the forward pass of '1' (Feature) at step 2: {FACT}; cause: model" in err
    assert "samples to blame: sample 4 (id 'row-2-4')" in err


def test_store_keeps_the_root_cause_and_the_samples(run: Path) -> None:
    row = gw.open_run(run).findings().iloc[0]
    root, samples = row.data["root_cause"], row.data["samples"]
    assert (root["op"], root["code"], root["fact"], root["cause"]) == ("aten::log", CODE, FACT, "model")
    assert (samples["indices"], samples["ids"]) == ([4], ["row-2-4"])
    assert row.data["replay_ms"] > 0


def test_check_json_has_the_new_fields(run: Path) -> None:
    res = CliRunner().invoke(cli, ["check", str(run), "--format", "json"], prog_name="gradwatch")
    finding = json.loads(res.stdout)["findings"][0]
    assert finding["root_cause"]["op"] == "aten::log" and finding["root_cause"]["line"] > 0
    assert finding["root_cause"]["code"] == CODE and finding["root_cause"]["cause"] == "model"
    assert finding["samples"]["indices"] == [4] and finding["samples"]["ids"] == ["row-2-4"]
    assert finding["replay_ms"] > 0
    plain = gate.Item(kind="vanishing", severity="warning", step=1, layer="a", phase=None, message="m", action=None)
    assert set(plain.to_json()) == {"kind", "severity", "step", "layer", "phase", "message", "action", "repeats"}


def test_report_shows_the_line_the_fact_and_the_samples_values(run: Path) -> None:
    html = render(run)
    assert "<dt>op</dt><dd>aten::log (forward) in &#39;1&#39;</dd>" in html
    assert f"<dt>code</dt><dd><code>{CODE}</code></dd>" in html
    assert f"<dt>input fact</dt><dd>{FACT.replace(chr(39), '&#39;')}</dd>" in html
    blamed = "sample 4 (id &#39;row-2-4&#39;), by rows of the op&#39;s output that are NaN/Inf"
    assert f"<dt>samples</dt><dd>{blamed}" in html
    assert "<dt>sample values</dt><dd>sample 4 (id &#39;row-2-4&#39;): 4 values, range [" in html
    assert "<dt>replay</dt><dd>" in html


def test_dashboard_lists_the_root_cause_rows(run: Path) -> None:
    found = dashboard.findings(gw.open_run(run))["findings"][0]
    rows = dict((k, v) for k, v in found["root_cause"] if k != "sample values")
    assert rows["op"] == "aten::log (forward) in '1'" and rows["code"] == CODE and rows["input fact"] == FACT
    assert rows["cause"].startswith("model: reproducible in float64 with a finite batch")
    assert rows["line"].startswith("test_rootcause_outputs.py:")


def test_rows_of_a_finding_without_a_root_cause_are_empty() -> None:
    assert words.rows({"hint": "x", "repeats": 2}) == []
    spread = words.rows({"samples": {"indices": [], "how": "per-sample gradient norm (torch.func)", "spread": True}})
    assert spread == [("samples", "none to blame: the per-sample gradient norm (torch.func) is spread over the batch")]


def test_check_rules_rejudges_with_the_root_cause_found_during_training(run: Path, tmp_path: Path) -> None:
    rules = tmp_path / "gradwatch.toml"
    rules.write_text('[[rules]]\nwhen = "nonfinite"\ndo = "halt"\n', encoding="utf-8")
    res = CliRunner().invoke(cli, ["check", str(run), "--rules", str(rules), "--format", "json"], prog_name="gradwatch")
    rejudged = json.loads(res.stdout)["findings"][0]
    recorded = gw.open_run(run).findings().iloc[0]
    assert rejudged["action"] == "halt" and rejudged["message"] == recorded.message
    assert rejudged["root_cause"] == recorded.data["root_cause"] and rejudged["samples"] == recorded.data["samples"]
