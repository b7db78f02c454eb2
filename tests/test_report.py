"""``gradwatch report``: the HTML report of real runs (planted NaN, explosion, rollback, halt), parsed back."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from collections import OrderedDict
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import gradwatch as gw
from gradwatch.cli import cli
from gradwatch.cli import report as _registers_report  # noqa: F401
from gradwatch.errors import GradwatchError
from gradwatch.report import data as report_data
from gradwatch.report import items as report_items
from gradwatch.report import render, write
from gradwatch.report.remedies import explain
from gradwatch.store.findings import Finding
from gradwatch.store.records import LAYER, Layout, StepRecord
from gradwatch.store.writer import StoreWriter, create_store

NAN_STEP, BIG_STEP = 25, 40
XSS_LAYER = "<img src=x onerror=alert(1)>"
XSS_RUN = ("<script>alert(1)<", "script>")  # a run directory whose path reads <script>alert(1)</script>


# ------------------------------------------------------------------ runs
class LogFeatures(nn.Module):
    """log of the input: NaN for a negative input (the planted trouble)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def make_model(odd_layer: bool = False) -> nn.Module:
    layers: list[tuple[str, nn.Module]] = [("features", LogFeatures()), ("hidden", nn.Linear(4, 16)),
                                           ("act", nn.Tanh())]
    if odd_layer:
        layers.append((XSS_LAYER, nn.Linear(16, 16)))
    layers.append(("out", nn.Linear(16, 1)))
    return nn.Sequential(OrderedDict(layers))


def train(path: Path, *, steps: int = 50, nan_step: int | None = None, big_step: int | None = None,
          rules: Any = "default", odd_layer: bool = False, **options: Any) -> Path:
    """A small regression on log-features; ``nan_step`` feeds a negative input (log -> NaN, found in
    ``features``), ``big_step`` multiplies the targets by 1000 (exploding gradient and loss spike)."""
    torch.manual_seed(0)
    model = gw.watch(make_model(odd_layer), run=path, rules=rules, console=False, tensorboard=False,
                     detectors={"exploding": {"warmup": 10}}, **options)
    loop(model, steps, nan_step, big_step)
    gw.unwatch(model)
    return path


def loop(model: nn.Module, steps: int, nan_step: int | None = None, big_step: int | None = None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.rand(256, 4) + 0.5
    y = torch.log(x) @ torch.randn(4, 1)
    for step in range(steps):
        idx = torch.randint(0, len(x), (32,), generator=torch.Generator().manual_seed(step))
        xb, yb = x[idx].clone(), y[idx].clone()
        if step == nan_step:
            xb[0, 0] = -1.0
        if step == big_step:
            yb = yb * 1000
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        try:
            opt.step()
        except gw.TrainingHalted:
            return


def synthetic(path: Path, layers: int, steps: int, *, spike: tuple[int, int], sample_every: int = 10) -> Path:
    """A large run written straight through the store writer (no training): a vanishing slope over
    the layers, one huge gradient at ``spike`` = (step, layer)."""
    names = tuple(f"blocks.{i}.linear" for i in range(layers))
    layout = Layout(version=0, layers=names, layer_types=("Linear",) * layers, layer_numel=(100,) * layers,
                    params=(), param_numel=(), owners=(), leaves=tuple(range(layers)))
    writer = StoreWriter(create_store(path, {"model": "Synthetic", "parameters": 100 * layers,
                                             "created": 1.7e9, "pid": -1}, overwrite=True))
    rng = np.random.default_rng(0)
    level = np.logspace(-6, 0, layers).astype(np.float32)
    records = []
    for step in range(steps):
        grad = level * rng.uniform(0.5, 1.5, layers).astype(np.float32)
        if step == spike[0]:
            grad[spike[1]] = 1e4
        vectors = {(LAYER, "grad_norm"): grad}
        if step % sample_every == 0:
            vectors[(LAYER, "act_norm")] = rng.uniform(1, 10, layers).astype(np.float32)
            vectors[(LAYER, "update_ratio")] = level * 1e-3
        records.append(StepRecord(step=step, time=1.7e9 + step, layout=layout, vectors=vectors, logged=True,
                                  sampled=step % sample_every == 0,
                                  scalars={"grad_norm": float(np.linalg.norm(grad)), "loss": 1 / (1 + step)}))
    writer.write(records)
    writer.write_findings([Finding("exploding", "warning", spike[0], names[spike[1]], "a spike", action="clip",
                                   data={"grad_norm": 1e4, "hint": "clip it"}, id=1)])
    writer.close("finished")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("report-runs")
    return {
        "trouble": train(root / "trouble", nan_step=NAN_STEP, big_step=BIG_STEP),
        "warnings": train(root / "warnings", big_step=BIG_STEP),
        "rollback": train(root / "rollback", steps=40, nan_step=NAN_STEP, snapshot_every=5,
                          rules=[gw.Rule(when="nonfinite", do="rollback", skip_batches=1)]),
        "halted": train(root / "halted", steps=40, nan_step=NAN_STEP, rules=[gw.Rule(when="nonfinite", do="halt")]),
        "healthy": train(root.joinpath(*XSS_RUN), steps=30, odd_layer=True),
    }


@pytest.fixture(scope="module")
def pages(runs: dict[str, Path]) -> dict[str, str]:
    return {name: render(path) for name, path in runs.items()}


def narrow(path: Path, low: float, high: float, *, steps: int = 40) -> Path:
    """A run written straight through the store writer whose gradient norms span ``low`` to ``high``
    (global norm: rising geometrically over the steps; three layers: ``low``, between, ``high``)."""
    names = ("a", "b", "c")
    layout = Layout(version=0, layers=names, layer_types=("Linear",) * 3, layer_numel=(10,) * 3, params=(),
                    param_numel=(), owners=(), leaves=(0, 1, 2))
    writer = StoreWriter(create_store(path, {"model": "Narrow", "parameters": 30, "created": 1.7e9, "pid": -1},
                                      overwrite=True))
    grads = np.geomspace(low, high, steps)
    writer.write([StepRecord(step=step, time=1.7e9 + step, layout=layout, logged=True, sampled=False,
                             vectors={(LAYER, "grad_norm"): np.geomspace(low, high, 3).astype(np.float32)},
                             scalars={"grad_norm": float(grads[step]), "loss": 0.5 - step / 1000})
                  for step in range(steps)])
    writer.close("finished")
    return path


# ------------------------------------------------------------------ parsing
class Page(HTMLParser):
    """The parts of a report the tests read: elements by id and class, data attributes, scripts, text."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.scripts: list[tuple[dict[str, str], str]] = []
        self.text: list[str] = []
        self._script: dict[str, str] | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {k: v or "" for k, v in attrs}
        self.elements.append((tag, attributes))
        if tag == "script":
            self._script = attributes

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._script = None

    def handle_data(self, data: str) -> None:
        if self._script is not None:
            self.scripts.append((self._script, data))
        else:
            self.text.append(data)

    def by_class(self, name: str) -> list[dict[str, str]]:
        return [a for _, a in self.elements if name in a.get("class", "").split()]

    def by_id(self, name: str) -> dict[str, str]:
        (found,) = [a for _, a in self.elements if a.get("id") == name]
        return found

    def figure(self, name: str) -> dict[str, Any]:
        (text,) = [body for attrs, body in self.scripts if attrs.get("id") == f"fig-{name}-data"]
        return json.loads(text)

    @property
    def all_text(self) -> str:
        return " ".join(" ".join(self.text).split())


def array(value: Any) -> np.ndarray:
    """A plotly array: a list, or a base64 typed array ``{"dtype": ..., "bdata": ...}``."""
    if isinstance(value, dict):
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
    return np.asarray(value)


def store_findings(path: Path) -> list[tuple[str, int, str]]:
    with gw.open_run(path) as run:
        found = run.findings()
    return [(k, int(s), layer if isinstance(layer, str) else "") for k, s, layer in
            zip(found["kind"], found["step"], found["layer"])]


# ------------------------------------------------------------------ content
def test_verdict_banner_and_counts(runs: dict[str, Path], pages: dict[str, str]) -> None:
    expected = {"trouble": "errors", "warnings": "warnings", "rollback": "errors", "halted": "halted",
                "healthy": "healthy"}
    for name, state in expected.items():
        page = Page(pages[name])
        assert page.by_id("verdict")["data-state"] == state, name
        assert f'<body class="state-{state}">' in pages[name]
    trouble = Page(pages["trouble"]).all_text
    assert "1 error; the first: nonfinite in features (forward) at step 25 (action: skip)" in trouble
    assert "No warnings or errors in 30 steps" in Page(pages["healthy"]).all_text
    halted = Page(pages["halted"]).all_text
    assert "Training was halted at step 25: nonfinite in features" in halted
    with gw.open_run(runs["trouble"]) as run:
        assert run.verdict is not None
        counts = run.findings()["severity"].value_counts().to_dict()
    for severity, word in (("error", "errors"), ("warning", "warnings")):
        assert f"{counts.get(severity, 0)} {word}" in trouble


def test_run_summary_facts(pages: dict[str, str]) -> None:
    text = Page(pages["trouble"]).all_text
    for fact in ("model Sequential", "steps 50", "status finished", "rules default", "learning rate 0.05",
                 "skipped steps 1", "duration"):
        assert fact in text, fact
    assert "parameters 97" in text  # 4*16+16 + 16+1


def test_findings_listed_match_the_store(runs: dict[str, Path], pages: dict[str, str]) -> None:
    for name in ("trouble", "warnings", "rollback", "halted", "healthy"):
        page = Page(pages[name])
        rows = [(a["data-kind"], int(a["data-step"]), a["data-layer"]) for a in page.by_class("finding-row")]
        assert rows == store_findings(runs[name]), name
        cards = [(a["data-kind"], int(a["data-step"]), a["data-layer"]) for a in page.by_class("finding")]
        assert sorted(cards) == sorted(rows), f"{name}: every finding is explained"
    trouble = store_findings(runs["trouble"])
    assert ("nonfinite", NAN_STEP, "features") in trouble
    assert ("exploding", BIG_STEP, "out") in trouble and ("loss_spike", BIG_STEP, "") in trouble
    assert Page(pages["healthy"]).by_class("finding-row") == []
    assert "No findings" in Page(pages["healthy"]).all_text


def test_remedies_and_hints_per_kind(runs: dict[str, Path], pages: dict[str, str]) -> None:
    page = Page(pages["trouble"])
    text = page.all_text
    with gw.open_run(runs["trouble"]) as run:
        found = run.findings()
    kinds = set(found["kind"])
    assert {"nonfinite", "exploding", "loss_spike"} <= kinds
    listed = {a["data-kind"] for a in page.by_class("remedy-list")}
    assert listed == kinds
    for kind in kinds:
        for remedy in explain(kind).remedies:
            assert " ".join(remedy.split()) in text, (kind, remedy)
    for hint in {d["hint"] for d in found["data"]}:
        assert " ".join(hint.split()) in text
    assert "division by zero" in text and "log(0)" in text and "fp16" in text  # the NaN culprits
    assert "warmup" in text and "Clip the gradient norm" in text


def test_actions_and_evidence(runs: dict[str, Path], pages: dict[str, str]) -> None:
    page = Page(pages["trouble"])
    text = page.all_text
    assert "the step was skipped: weights and optimizer state unchanged" in text
    assert "gradients clipped to norm" in text
    assert "origin replayed (LogFeatures)" in text
    assert len(page.by_class("spark")) == len(store_findings(runs["trouble"])), "a sparkline per finding"
    assert "grad_norm of out, steps 8–48" in text or "steps 8–48" in text
    timeline = page.figure("timeline")
    skipped = [t for t in timeline["data"] if t.get("name") == "skipped step"]
    assert skipped and NAN_STEP in array(skipped[0]["x"]).tolist()
    markers = {t["name"]: t for t in timeline["data"] if t.get("name") in ("error", "warning", "info")}
    error_steps = array(markers["error"]["x"]).tolist()
    assert NAN_STEP in error_steps and "x" in markers["error"]["marker"]["symbol"]  # skip: a cross
    assert "diamond" in markers["warning"]["marker"]["symbol"]  # clip: a diamond


def test_rollback_points_back_to_the_restored_step(runs: dict[str, Path], pages: dict[str, str]) -> None:
    with gw.open_run(runs["rollback"]) as run:
        found = run.findings()
    (rolled,) = [d["outcome"] for a, d in zip(found["action"], found["data"]) if a == "rollback"]
    restored = rolled["restored_step"]
    assert restored < NAN_STEP
    page = Page(pages["rollback"])
    assert f"rolled back to the snapshot of step {restored}" in page.all_text
    notes = [a for a in page.figure("timeline")["layout"]["annotations"] if a.get("text") == f"rollback → {restored}"]
    assert notes, "the rollback is drawn on the timeline"
    arrows = [a for a in page.figure("timeline")["layout"]["annotations"] if a.get("showarrow")]
    assert [(a["ax"], a["x"]) for a in arrows] == [(NAN_STEP, restored)]


def test_gradient_flow_and_heatmaps(runs: dict[str, Path], pages: dict[str, str]) -> None:
    page = Page(pages["trouble"])
    flow = page.figure("flow")
    names = [t["name"] for t in flow["data"]]
    assert names[0] == "first (step 0)" and names[-1] == "last (step 49)"
    assert any(n.startswith(("first error", "largest global norm")) for n in names)
    assert flow["layout"]["yaxis"]["type"] == "log"
    ticks = flow["layout"]["xaxis"]["ticktext"]
    assert ticks == ["hidden", "out"], "layers with gradients, in model order"
    heats = [a["data-figure"] for _, a in page.elements if a.get("role") == "tab"]
    assert heats[0] == "fig-heat-grad_norm"
    assert {"fig-heat-act_norm", "fig-heat-update_ratio", "fig-heat-act_zero_frac"} <= set(heats)
    grad = page.figure("heat-grad_norm")["data"][0]
    assert list(grad["y"]) == ["hidden", "out"] and len(array(grad["x"])) == 50


def test_layer_table(pages: dict[str, str]) -> None:
    page = Page(pages["trouble"])
    rows = [a["data-layer"] for a in page.by_class("layer-row")]
    assert rows == ["features", "hidden", "act", "out"]
    assert page.by_id("layer-table")["class"] == "sortable"
    # four layers in the table, two in the gradient flow: the page says which have none, and why
    assert page.figure("flow")["layout"]["xaxis"]["ticktext"] == ["hidden", "out"]
    assert page.by_id("layers-note")["class"] == "note"
    assert ("features (LogFeatures) and act (Tanh) have no parameters, so no gradient of their own: the gradient "
            "flow leaves them out.") in page.all_text
    flags = [a for a in page.by_class("flag")]
    assert any("nonfinite" in a["class"] for a in flags)


def test_names_are_escaped_everywhere(runs: dict[str, Path], pages: dict[str, str]) -> None:
    html = pages["healthy"]
    assert "<script>alert(1)</script>" in str(runs["healthy"])
    assert "<script>alert(1)" not in html and "</script>alert" not in html
    assert XSS_LAYER not in html and "<img" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    page = Page(html)
    assert not [tag for tag, _ in page.elements if tag in ("img", "iframe", "object", "embed")]
    scripts = [attrs for tag, attrs in page.elements if tag == "script"]
    bundle = {"type": "application/octet-stream", "id": "plotly-bundle"}
    assert all(a == {} or (a.get("type") == "application/json" and a.get("id", "").startswith("fig-"))
               or {k: a.get(k) for k in bundle} == bundle for a in scripts), scripts
    assert len([a for a in scripts if a == {}]) == 2, "plotly.js's decoder and the page's own script, nothing else"
    for attrs, body in page.scripts:
        if attrs.get("id") == "plotly-bundle":
            assert re.fullmatch(r"[A-Za-z0-9+/=]+", body), "base64, nothing else"
        elif attrs:
            assert "<" not in body and json.loads(body)
    flow = page.figure("flow")
    assert "&lt;img src=x onerror=alert(1)&gt;" in flow["layout"]["xaxis"]["ticktext"]
    layers = [a["data-layer"] for a in page.by_class("layer-row")]
    assert XSS_LAYER in layers, "the attribute holds the real name, escaped in the markup"


def test_running_run_gives_a_report(tmp_path: Path) -> None:
    model = gw.watch(make_model(), run=tmp_path / "live", console=False, tensorboard=False)
    try:
        loop(model, 12)
        gw.watcher(model).flush()
        page = Page(render(tmp_path / "live"))
        assert "running" in [t.strip() for t in page.text]
        assert "still being written" in page.all_text
        assert page.by_id("verdict")["data-state"] == "healthy"
    finally:
        gw.unwatch(model)


def test_empty_run_gives_a_report(tmp_path: Path) -> None:
    model = gw.watch(make_model(), run=tmp_path / "empty", console=False, tensorboard=False)
    gw.unwatch(model)
    page = Page(render(tmp_path / "empty"))
    assert page.by_id("verdict")["data-state"] == "healthy"
    assert "No findings" in page.all_text


def test_bounded_at_scale(tmp_path: Path) -> None:
    path = synthetic(tmp_path / "big", layers=260, steps=2500, spike=(1777, 123))
    with gw.open_run(path) as run:
        report = report_data.collect(run)
    assert len(report.grad.steps) <= report_data.MAX_POINTS  # type: ignore[union-attr]
    assert float(np.nanmax(report.grad.values)) >= 1e4, "the spike survives downsampling"  # type: ignore[union-attr]
    for heat in report.heats:
        assert heat.z.shape == (len(heat.layers), len(heat.steps))
        assert len(heat.layers) <= report_data.MAX_ROWS and len(heat.steps) <= report_data.MAX_COLUMNS
    grad = report.heats[0]
    assert grad.metric == "grad_norm" and "blocks.123.linear" in grad.layers, "a layer with a finding is kept"
    assert "Showing 200 of 260 layers" in grad.note
    assert float(np.nanmax(grad.z)) == pytest.approx(4.0), "the spike survives in the heatmap"
    assert len(report.layers) == 260 and report.layers[123].grad_max == pytest.approx(1e4)
    html = render(path)
    assert len(html) < 8_000_000


# ------------------------------------------------------------------ command line
def gradwatch(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), prog_name="gradwatch")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_cli_writes_the_default_file_and_o(runs: dict[str, Path], tmp_path: Path) -> None:
    code, out, err = gradwatch("report", str(runs["warnings"]))
    assert code == 0, err
    target = runs["warnings"] / "report.html"
    assert out.strip() == str(target) and target.is_file()
    assert Page(target.read_text(encoding="utf-8")).by_id("verdict")["data-state"] == "warnings"
    other = tmp_path / "bug-attachment.html"
    code, out, _ = gradwatch("report", str(runs["warnings"]), "-o", str(other))
    assert code == 0 and out.strip() == str(other) and other.stat().st_size > 1_000_000
    assert leftovers(runs["warnings"]) == [] and leftovers(tmp_path) == []


def test_cli_unreadable_run_is_one_line_exit_2(tmp_path: Path) -> None:
    done = subprocess.run(["gradwatch", "report", str(tmp_path / "missing")], capture_output=True, text=True,
                          timeout=120, env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"})
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and done.stderr.strip().count("\n") == 0
    assert done.stderr.startswith("gradwatch: error: no run at")
    (tmp_path / "not-a-run").mkdir()
    code, _, err = gradwatch("report", str(tmp_path / "not-a-run"))
    assert code == 2 and "is not a gradwatch run" in err and err.strip().count("\n") == 0


def test_cli_unwritable_output_is_one_line_exit_2(runs: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a file where a folder would be")  # missing folders are created; this cannot be
    code, _, err = gradwatch("report", str(runs["warnings"]), "-o", str(tmp_path / "file" / "such" / "dir.html"))
    assert code == 2 and err.startswith("gradwatch: error: cannot write the report") and err.count("\n") == 1


def test_write_is_atomic(runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "report.html"
    target.write_text("old report", encoding="utf-8")

    def broken(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(GradwatchError, match="No space left on device"):
        write(runs["warnings"], target)
    assert target.read_text(encoding="utf-8") == "old report", "never half-written"
    assert leftovers(tmp_path) == []
    monkeypatch.undo()
    assert write(runs["warnings"], target) == target
    assert target.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert leftovers(tmp_path) == []
    assert oct(target.stat().st_mode & 0o777) != oct(0o600), "readable like any file, not mkstemp's 0600"


def test_start_here_gives_each_findings_own_remedy(tmp_path: Path) -> None:
    """A parameter group at learning rate 0: the first remedy of the kind (build the optimizer from
    model.parameters()) is for another cause; the finding's own hint is what to try."""
    import re

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    run_dir = tmp_path / "run"
    gw.watch(model, run=run_dir, console=False)
    opt = torch.optim.SGD([{"params": model[2].parameters()}, {"params": model[0].parameters(), "lr": 0.0}], lr=0.01)
    for _ in range(12):
        x = torch.randn(32, 8)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1]).backward()
        opt.step()
    gw.unwatch(model)
    (row,) = gw.open_run(run_dir).findings().itertuples()
    assert (row.kind, row.data["reason"]) == ("unoptimized_parameter", "zero_update")
    start = re.search(r"<h4>Start here</h4>(.*?)</ol>", render(run_dir), re.S)
    assert start is not None
    assert "Try: if it is meant to be frozen" in start.group(1) and "Build the optimizer" not in start.group(1)


def test_a_nan_born_outside_the_layers_is_placed_in_the_input_batch_or_the_loss(tmp_path: Path) -> None:
    """'Start here' and the headline say where a layer-less NaN/Inf was born, not "global"."""
    torch.manual_seed(0)
    model = gw.watch(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), run=tmp_path / "run", console=False)
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
        (item,) = report_items.items(run, run.findings())
    assert (item.kind, item.layer, item.where) == ("nonfinite", None, "the input batch")


# ------------------------------------------------------------------ log axes
PLAIN = {"type": "log", "tickformat": "~g"}
POWERS = {"type": "log", "exponentformat": "power", "minorloglabels": "complete"}


def log_axes(figure: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tick options of a figure's log-scale y axes, by title."""
    return {axis["title"]["text"]: {k: v for k, v in axis.items() if k in {*PLAIN, *POWERS}}
            for key, axis in figure["layout"].items() if key.startswith("yaxis") and axis.get("type") == "log"}


def test_log_axes_label_every_tick_with_its_value(tmp_path: Path) -> None:
    """plotly's default labels a tick between powers of ten by its first digit (0.4 reads "4", 20 "2")."""
    from gradwatch.report.figures import log_axis

    assert log_axis([0.3, 0.4, 5.0]) == PLAIN
    assert log_axis([np.nan, 0.0, -1.0], [np.inf]) == PLAIN  # nothing drawable
    assert log_axis([1e-7, 0.5]) == POWERS == log_axis([0.5], [2e5])
    page = Page(render(narrow(tmp_path / "narrow", 0.25, 3.0)))
    assert log_axes(page.figure("timeline")) == log_axes(page.figure("flow")) == {"grad norm": PLAIN}
    wide = Page(render(synthetic(tmp_path / "wide", 8, 30, spike=(20, 3))))
    assert log_axes(wide.figure("flow")) == {"grad norm": POWERS}  # layers from 1e-6 to 1
    assert log_axes(wide.figure("timeline")) == {"grad norm": PLAIN}  # the global norm: 0.55 to 1e4


def test_the_layers_without_a_gradient_are_named() -> None:
    from gradwatch.report.text import without_gradients

    assert without_gradients([("0", "Linear", 10, True), ("1", "ReLU", 0, False), ("2", "Linear", 5, True)]) == (
        "'1' (ReLU) has no parameters, so no gradient of its own: the gradient flow leaves it out.")
    assert without_gradients([("fc", "Linear", 10, True)]) == ""
    frozen = without_gradients([("embed", "Embedding", 100, False), ("head", "Linear", 10, True)])
    assert frozen == ("embed (Embedding) has parameters but no finite gradient norm recorded (frozen, not used in "
                      "the loss, or NaN/Inf throughout): the gradient flow leaves it out.")
    many = without_gradients([(f"blocks.{i}.act", "GELU", 0, False) for i in range(12)])
    assert many.startswith("blocks.0.act (GELU), blocks.1.act (GELU), ") and " and 4 more have no parameters" in many
