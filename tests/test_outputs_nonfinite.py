"""Every output writes non-finite numbers (issue 26, item 1): the CI gate never crashes on the run it exists for.

A NaN/Inf is what gradwatch exists to find, so every number of a finding can be one. Here: a real
detect-only run with a NaN batch through the CLI (all formats), the report and the dashboard's API;
then a property over every finding kind (from the detectors' registry) and every numeric field of
its data (from real findings, ``tests/data/finding_data.json``), each drawn from floats including
NaN/Inf, through every output: ``check`` (text, json, junit, github), the report, the dashboard's
API, Prometheus and TensorBoard. JSON is parsed strictly and read back by the documented scheme
(:mod:`gradwatch.encoding`).
"""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util
from torch import nn

import gradwatch as gw
from gradwatch import actions, detectors, encoding
from gradwatch.cli import cli
from gradwatch.cli import report as _registers_report  # noqa: F401
from gradwatch.cli.check import judge_run, render_github, render_json, render_junit, render_text
from gradwatch.dashboards.server import create_app
from gradwatch.report import items as report_items
from gradwatch.report import render
from gradwatch.sinks.tensorboard import TensorBoard
from gradwatch.store.findings import KINDS, SEVERITIES, Finding
from gradwatch.store.reader import open_run
from gradwatch.store.records import LAYER, Layout, StepRecord
from gradwatch.store.writer import StoreWriter, create_store

from . import pool

NAN_STEP = 5
#: every finding kind: the detectors' registry, and the kinds made elsewhere (replicas, plugins' list)
ALL_KINDS = sorted(set(detectors.REGISTRY) | set(KINDS))
#: real findings' data of every kind (harvested from the suite's runs), in gradwatch's strict JSON
SHAPES: dict[str, list[dict[str, Any]]] = encoding.restore(
    json.loads((Path(__file__).parent / "data" / "finding_data.json").read_text(encoding="utf-8")))["kinds"]
API = ("summary", "curves", "findings", "flow", "heatmap", "progress")


def _refuse(constant: str) -> Any:
    raise ValueError(f"non-strict JSON constant {constant}")


def strict(text: str) -> Any:
    """JSON parsed strictly: a NaN/Infinity token fails."""
    return json.loads(text, parse_constant=_refuse)


def same(a: Any, b: Any) -> bool:
    """Equal as data, NaN equal to NaN."""
    return json.dumps(a, sort_keys=True, allow_nan=True) == json.dumps(b, sort_keys=True, allow_nan=True)


def nonfinite_paths(value: Any, path: str = "") -> list[str]:
    """Where ``value`` holds a non-finite number."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in nonfinite_paths(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in nonfinite_paths(v, f"{path}[{i}]")]
    return [path] if encoding.nonfinite_text(value) is not None else []


def embedded_json(page: str) -> list[Any]:
    """Every JSON block the report embeds, parsed strictly."""
    blocks = re.findall(r'<script type="application/json"[^>]*>(.*?)</script>', page, re.S)
    assert blocks
    return [strict(b) for b in blocks]


def dashboard_api(root: Path, run_id: str, layer: str) -> dict[str, Any]:
    """Every JSON endpoint of the dashboard on one run, parsed strictly (each must answer 200)."""
    client = TestClient(create_app(root), base_url="http://127.0.0.1")
    out = {"runs": client.get("/api/runs")}
    out.update({name: client.get(f"/api/run/{name}", params={"run": run_id}) for name in API})
    out["layer"] = client.get("/api/run/layer", params={"run": run_id, "layer": layer})
    for name, response in out.items():
        assert response.status_code == 200, (name, response.text[:300])
    return {name: strict(response.text) for name, response in out.items()}


# ----------------------------------------------------------------------------- the scheme
def test_the_scheme_as_documented() -> None:
    value = {"loss": math.nan, "root_cause": {"grew": [{"param": "0.weight", "from": 1.5, "to": math.nan,
                                                        "ratio": math.inf}]},
             "values": [1.5, -math.inf, [2.0, math.nan]], "steps": 3}
    text = encoding.dumps(value)
    assert strict(text) == {
        "loss": None, "loss_nonfinite": "nan",
        "root_cause": {"grew": [{"param": "0.weight", "from": 1.5, "to": None, "to_nonfinite": "nan",
                                 "ratio": None, "ratio_nonfinite": "inf"}]},
        "values": [1.5, None, [2.0, None]], "values_nonfinite": {"1": "-inf", "2/1": "nan"}, "steps": 3}
    assert same(encoding.restore(strict(text)), value)
    assert strict(encoding.dumps([math.nan, {"x": math.inf}])) == [None, {"x": None, "x_nonfinite": "inf"}]
    assert strict(encoding.dumps({"z": [math.nan]}, beside=False)) == {"z": [None]}  # chart data: a gap
    assert [encoding.text(v) for v in (math.nan, math.inf, -math.inf, np.float32("nan"), 0.5, None)] == [
        "nan", "inf", "-inf", "nan", "0.5", "-"]


KEYS = st.text(alphabet="abcdefgh_", min_size=1, max_size=6).filter(lambda k: not k.endswith(encoding.SUFFIX))
NUMBERS = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf]), st.floats(), st.integers(-2**60, 2**60))
TREES = st.recursive(st.one_of(NUMBERS, st.none(), st.booleans(), st.text(max_size=5)),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
                     max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(TREES)
def test_any_value_is_strict_json_and_reads_back(value: Any) -> None:
    text = encoding.dumps({"v": value})
    assert same(encoding.restore(strict(text)), {"v": value})
    strict(encoding.dumps(value))  # under no field a NaN/Inf is null alone, strict all the same


# ------------------------------------------------------------- a real detect-only NaN run
@pytest.fixture(scope="module")
def nan_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CI gate's own case: rules=None (detect only), one NaN in the input batch at step 5."""
    path = tmp_path_factory.mktemp("nonfinite") / "nan"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    gw.watch(model, run=str(path), rules=None, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(12):
        x = torch.randn(16, 4)
        if step == NAN_STEP:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)
    return path


@pytest.mark.slow
def test_check_json_on_a_detect_only_nan_run(nan_run: Path) -> None:
    with open_run(nan_run) as run:
        stored = run.findings()
    assert nonfinite_paths(list(stored["data"])), "the run's findings hold NaN/Inf (else this tests nothing)"
    done = subprocess.run([sys.executable, "-m", "gradwatch", "check", str(nan_run), "--format", "json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    doc = strict(done.stdout)
    assert doc["verdict"] == "fail" and doc["steps"] == 12
    first = doc["findings"][0]
    assert (first["kind"], first["step"], first["layer"], first["phase"]) == ("nonfinite", NAN_STEP, None, "forward")
    assert first["samples"]["indices"] == [0] and first["root_cause"]["cause"] == "data"
    assert len(doc["findings"]) == len(stored)
    for out, (_, row) in zip(doc["findings"], stored.iterrows()):  # read back the documented way: the stored numbers
        back = encoding.restore(out)
        assert (back["kind"], back["step"]) == (row.kind, row.step)
        for key in ("root_cause", "samples", "replay_ms"):
            assert same(back.get(key), row.data.get(key)), key


@pytest.mark.slow
def test_every_format_and_reader_on_a_detect_only_nan_run(nan_run: Path) -> None:
    runner = CliRunner()
    text = runner.invoke(cli, ["check", str(nan_run)], env={"COLUMNS": "200"})
    assert text.exit_code == 1 and "Traceback" not in text.output
    assert re.search(rf"│ {NAN_STEP}\s+│ error\s+│ nonfinite", text.output) and "FAIL" in text.output
    junit = runner.invoke(cli, ["check", str(nan_run), "--format", "junit"])
    assert junit.exit_code == 1
    failure = ET.fromstring(junit.output.split("\n", 1)[1]).find(".//testcase[@name='nonfinite']/failure")
    assert failure is not None and failure.get("message", "").startswith(f"step {NAN_STEP}, the input batch: ")
    github = runner.invoke(cli, ["check", str(nan_run), "--format", "github"])
    assert github.exit_code == 1 and github.output.startswith("::error title=gradwatch nonfinite at the input "
                                                              f"batch%2C step {NAN_STEP}")
    listed = runner.invoke(cli, ["ls", str(nan_run.parent), "--format", "json"])
    assert listed.exit_code == 0 and strict(listed.output)[0]["findings"]["error"] >= 1
    report = nan_run.parent / "report.html"
    assert runner.invoke(cli, ["report", str(nan_run), "-o", str(report)]).exit_code == 0
    page = report.read_text(encoding="utf-8")
    embedded_json(page)
    assert "the input batch" in page
    api = dashboard_api(nan_run.parent, "nan", "0")
    listed_first = sorted(api["findings"]["findings"], key=lambda f: f["step"])[0]
    assert (listed_first["kind"], listed_first["step"], listed_first["where"]) == ("nonfinite", NAN_STEP,
                                                                                    "the input batch")
    assert api["curves"]["curves"]["loss"]["values"][NAN_STEP] is None  # a chart's gap


# --------------------------------------------- every kind, every numeric field, drawn from floats with NaN/Inf
NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf])
FLOATS = st.one_of(NONFINITE, st.floats())
EXTRA = st.dictionaries(KEYS.map(lambda k: "x_" + k), st.recursive(
    FLOATS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3), max_leaves=6),
    max_size=2)


def drawn(shape: Any) -> st.SearchStrategy[Any]:
    """``shape`` (a real finding's data) with every number drawn from floats including NaN/Inf."""
    if isinstance(shape, dict):
        return st.fixed_dictionaries({k: drawn(v) for k, v in shape.items()})
    if isinstance(shape, list):
        return st.tuples(*(drawn(v) for v in shape)).map(list)
    if isinstance(shape, float):
        return FLOATS
    if isinstance(shape, int) and not isinstance(shape, bool):  # a count, a step or an index: itself, or NaN/Inf
        return st.one_of(st.just(shape), NONFINITE)
    return st.just(shape)


@st.composite
def findings_of(draw: st.DrawFn, kind: str) -> list[Finding]:
    """One to three findings of ``kind``: real data shapes, numbers drawn, unknown numeric fields added."""
    out = []
    for i in range(draw(st.integers(1, 3))):
        data = {**draw(st.sampled_from(SHAPES[kind]).flatmap(drawn)), **draw(EXTRA)}
        out.append(Finding(kind, draw(st.sampled_from(SEVERITIES)), draw(st.integers(0, 7)),
                           draw(st.sampled_from([None, *LAYERS])), f"{kind} finding {i}",
                           value=draw(FLOATS), phase=draw(st.sampled_from([None, "forward", "backward"])),
                           action=draw(st.sampled_from([None, *actions.REGISTRY])), data=data, id=i + 1))
    return sorted(out, key=lambda f: (f.step, f.id))  # the store's order


LAYERS = ("blocks.0", "blocks.1")


def synthetic_run(path: Path, findings: list[Finding]) -> None:
    """A run of 8 steps (NaN loss and gradient norms from step 4) holding ``findings``, written by the store."""
    layout = Layout(version=0, layers=LAYERS, layer_types=("Linear",) * 2, layer_numel=(10, 10), params=(),
                    param_numel=(), owners=(), leaves=(0, 1))
    writer = StoreWriter(create_store(path, {"model": "Synthetic", "parameters": 20, "created": 1.7e9, "pid": -1},
                                      overwrite=True))
    records = []
    for step in range(8):
        bad = math.nan if step >= 4 else 1.0 / (step + 1)
        grad = np.array([bad, math.inf if step >= 4 else 0.5], dtype=np.float32)
        records.append(StepRecord(step=step, time=1.7e9 + step, layout=layout, logged=True, sampled=True,
                                  vectors={(LAYER, "grad_norm"): grad, (LAYER, "update_ratio"): grad * 1e-3},
                                  scalars={"grad_norm": bad, "loss": bad, "lr": 0.1}))
    writer.write(records)
    writer.write_findings(findings)
    writer.close("finished")


def check_every_output(path: Path, findings: list[Finding]) -> None:
    """Every output renders ``findings`` of the run at ``path``; JSON is strict and reads back to them."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gradwatch.integrations import prometheus

    with open_run(path) as run:
        stored = run.findings()
        shown = report_items.items(run, stored)
    assert [len(nonfinite_paths(d)) for d in stored["data"]] == [len(nonfinite_paths(f.data)) for f in findings]
    checked = [judge_run(str(path), "warning", None)]
    assert checked[0].error is None
    buf = io.StringIO()
    render_text(checked, buf)
    assert all(f.kind in buf.getvalue() for f in findings if f.severity != "info") and "None" not in buf.getvalue()
    doc = strict(render_json(checked))
    for out, f in zip(doc["findings"], findings):
        back = encoding.restore(out)
        assert (back["kind"], back["step"], back["layer"]) == (f.kind, f.step, f.layer)
        for key in ("root_cause", "samples"):
            assert same(back.get(key), f.data[key] if isinstance(f.data.get(key), dict) else None), key
    assert ET.fromstring(render_junit(checked).split("\n", 1)[1]).tag == "testsuites"
    github = render_github(checked)
    assert all(f.message in github for f in findings if f.severity != "info") and "None" not in github
    for item, f in zip(shown, findings):  # the report's evidence: the string forms, never "None"
        evidence = dict(item.evidence)
        for key, value in f.data.items():
            label = key.replace("_", " ")
            if label in evidence and encoding.nonfinite_text(value):
                assert evidence[label] == encoding.nonfinite_text(value)
    page = render(path)
    embedded_json(page)
    assert all(f.kind in page for f in findings)
    api = dashboard_api(path.parent, path.name, LAYERS[0])
    assert sorted(f["kind"] for f in api["findings"]["findings"]) == sorted(f.kind for f in findings)
    exporter = prometheus.for_registry(CollectorRegistry())
    try:
        prometheus.export_run(path, exporter)
        families = {m.name: m for m in text_string_to_metric_families(generate_latest(exporter.registry).decode())}
        counted = sum(s.value for s in families["gradwatch_findings"].samples
                      if s.name.endswith("_total") and s.labels["run"] == path.name)
        assert counted >= len(findings) and math.isnan(
            next(s.value for s in families["gradwatch_loss"].samples if s.labels["run"] == path.name))
    finally:
        exporter.close()
    board = TensorBoard(path)
    board.write_findings(findings)
    board.close("finished")
    events = EventAccumulator(str(path), size_guidance={"tensors": 0})
    events.Reload()
    texts = [tensor_util.make_ndarray(e.tensor_proto).item().decode() for e in events.Tensors("findings")]
    assert [f.message in text for f, text in zip(findings, texts)] == [True] * len(findings)


def every_output_of(kind: str) -> None:
    """The property below for one kind: drawn findings of ``kind`` through every output."""

    @settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(findings_of(kind))
    def prop(findings: list[Finding]) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "run"
            synthetic_run(path, findings)
            check_every_output(path, findings)

    prop()


@pytest.fixture(scope="module")
def every_output(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[Any]]]:
    """The kinds this session tests, each property run given to the tests' pool as the module starts
    (``tests/pool.py``: two processes beside this one), its outcome to come."""
    futures = {kind: pool.submit(every_output_of, kind) for kind in pool.chosen(request, "kind") if SHAPES.get(kind)}
    yield futures
    for future in futures.values():
        future.cancel()  # a session stopped early (-x) runs no property it no longer tests


@pytest.mark.slow
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_every_output_renders_every_kind_with_nonfinite_numbers(kind: str, every_output: dict[str, Future[Any]]
                                                                ) -> None:
    assert SHAPES.get(kind), f"no real data of {kind!r} in tests/data/finding_data.json: add a finding of it"
    pool.result(every_output[kind])  # a falsifying example is raised here, with its traceback


def test_the_data_of_real_findings_names_every_kind() -> None:
    missing = [k for k in ALL_KINDS if not SHAPES.get(k)]
    assert not missing, f"tests/data/finding_data.json has no real finding data of {missing}: add some"
    assert any(nonfinite_paths(d) for d in SHAPES["nonfinite"])  # stored real NaNs read back by the scheme
