"""After a non-finite update was applied (issue 26, item 6): the weights hold NaN/Inf, and every
later step is NaN/Inf from its first op. gradwatch says so once, naming the step whose update put
them there, instead of a misleading root cause ("model, reproducible with a finite batch") at
every later step; a new stretch of poisoned weights, or anything else, is still news.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import gradwatch as gw
from gradwatch.cli import cli
from gradwatch.cli.rejudge import rejudge


def train(run_dir: Path, steps: int, *, nan_batch: tuple[int, ...] = (), nan_weight: int | None = None,
          restore: int | None = None, **kw: object) -> None:
    """SGD regression; a NaN in the batch at each step of ``nan_batch``; a NaN written into a weight
    by hand (outside an optimizer step) before step ``nan_weight``; the initial weights copied back
    by hand before step ``restore``.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    gw.watch(model, run=run_dir, overwrite=True, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(32, 8, generator=gen)
        y = x.sum(1, keepdim=True)
        if step in nan_batch:
            x[3, 2] = float("nan")
        with torch.no_grad():
            if step == nan_weight:
                model[0].weight[0, 0] = float("nan")
            if step == restore:
                model.load_state_dict(initial)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)


def said(err: str) -> str:
    return " ".join(err.split())  # rich wraps long lines


@pytest.fixture(scope="module")
def detect_only(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A NaN batch at step 10 under detect-only rules, and 150 steps: beyond the cooldown of 100;
    the run and what the console printed.
    """
    run_dir = tmp_path_factory.mktemp("weights") / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        train(run_dir, 150, nan_batch=(10,), rules=None)
    return run_dir, said(err.getvalue())


def test_detect_only_nan_batch_says_once_that_step_10s_update_poisoned_the_weights(
        detect_only: tuple[Path, str]) -> None:
    run_dir, err = detect_only
    found = gw.open_run(run_dir).findings()
    rows = [(f.step, f.kind, f.layer, f.data["root_cause"]["cause"]) for f in found.itertuples()]
    assert rows == [(10, "nonfinite", None, "data"), (11, "nonfinite", "0", "weights")]
    weights = found.iloc[1]
    root = weights.data["root_cause"]
    assert root["poisoned_at"] == 10 and root["params"][:2] == ["0.weight", "0.bias"]
    assert weights.data["repeats"] == 139 and weights.data["last_step"] == 149, "one finding for the stretch"
    assert weights.message.startswith(
        "The weights hold NaN/Inf at step 11: step 10's update applied non-finite gradients (that step's finding "
        "has their cause), and 4 parameters in layers '0', '2' are NaN/Inf ('0.weight', '0.bias', '2.weight' and "
        "1 more); every step from here on is NaN/Inf until the weights are restored; cause: weights;")
    assert "rollback" in weights.data["hint"] and weights.data["source"] == "weights"
    # the console says it once, and never blames the model
    assert err.count("The weights hold NaN/Inf") == 1 and "step 10's update applied non-finite gradients" in err
    assert "cause: model" not in err and "reproducible" not in err
    assert err.count("gradwatch error") == 2


def test_check_text_and_json_name_step_10_as_the_poisoning_update(detect_only: tuple[Path, str]) -> None:
    run_dir, _ = detect_only
    # a table as wide as the run's path needs, whatever the temporary folder's length (rich reads COLUMNS)
    text = CliRunner().invoke(cli, ["check", str(run_dir)], prog_name="gradwatch", env={"COLUMNS": "400"})
    assert text.exit_code == 1
    out = said(text.output)
    assert "│ 11 (x139) │ error │ nonfinite │ 0 (forward) │ warn │ The weights hold NaN/Inf at step 11: step 10's " \
           "update applied non-finite gradients" in out
    assert "cause: model" not in out
    res = CliRunner().invoke(cli, ["check", str(run_dir), "--format", "json"], prog_name="gradwatch")
    findings = json.loads(res.stdout)["findings"]
    assert [(f["step"], f["layer"], f["root_cause"]["cause"]) for f in findings] == [
        (10, None, "data"), (11, "0", "weights")]
    assert findings[1]["root_cause"]["poisoned_at"] == 10 and findings[1]["repeats"] == 139


def test_rejudging_the_run_keeps_one_finding_for_the_poisoned_weights(detect_only: tuple[Path, str]) -> None:
    run_dir, _ = detect_only
    recorded = gw.open_run(run_dir).findings()
    again = rejudge(gw.open_run(run_dir))
    assert list(again.step) == [10, 11] and list(again.layer.fillna("global")) == ["global", "0"]
    assert again.iloc[1].message == recorded.iloc[1].message and again.iloc[1].data["repeats"] == 139


def test_weights_written_outside_a_step_then_restored_then_poisoned_by_an_update(tmp_path: Path) -> None:
    """Each stretch of poisoned weights is one finding of its own, with what put the NaN there."""
    train(tmp_path / "run", 40, nan_weight=5, restore=12, nan_batch=(20,), rules=None, console=False)
    found = gw.open_run(tmp_path / "run").findings()
    rows = [(f.step, f.layer, f.data["root_cause"]["cause"], f.data["root_cause"].get("poisoned_at"),
             f.data.get("repeats", 1)) for f in found.itertuples()]
    assert rows == [(5, "0", "weights", None, 7), (20, None, "data", None, 1), (21, "0", "weights", 20, 19)]
    assert "no step gradwatch saw before applied non-finite gradients (NaN/Inf before watching began, or written " \
           "outside an optimizer step)" in found.iloc[0].message


def test_a_skipped_non_finite_step_is_not_blamed_for_weights_poisoned_later(tmp_path: Path) -> None:
    """The default rules skip step 10's update: the NaN written by hand at step 20 is not its doing."""
    train(tmp_path / "run", 25, nan_batch=(10,), nan_weight=20, console=False)
    found = gw.open_run(tmp_path / "run").findings()
    rows = [(f.step, f.data["root_cause"]["cause"], f.action) for f in found.itertuples()]
    assert rows == [(10, "data", "skip"), (20, "weights", "skip")]
    assert found.iloc[1].data["root_cause"]["poisoned_at"] is None
