"""Prometheus exporter and Grafana dashboard: real runs, the real HTTP endpoint, the exposition format parsed back."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import urllib.request
from collections import OrderedDict
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.store.findings import KINDS, SEVERITIES, Finding

prometheus_client = pytest.importorskip("prometheus_client", reason="pip install 'gradwatch[prometheus]'")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gradwatch.integrations import prometheus  # noqa: E402

NAN_STEPS = (25, 26, 27)  # three NaN steps in a row: one nonfinite finding, folded repeats 3
BIG_STEP = 45
ACTIONS = ("halt", "rollback", "skip", "clip", "scale_lr", "warn")


@pytest.fixture(autouse=True)
def _stop_exporters() -> Iterator[None]:
    yield
    prometheus.shutdown()


# ------------------------------------------------------------------ helpers
class LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN for a negative input


def make_model() -> nn.Module:
    return nn.Sequential(OrderedDict([("features", LogFeatures()), ("hidden", nn.Linear(4, 16)),
                                      ("act", nn.Tanh()), ("out", nn.Linear(16, 1))]))


def loop(model: nn.Module, steps: int, *, start: int = 0) -> None:
    """A regression on log features; NaN inputs on NAN_STEPS, targets x1000 on BIG_STEP."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.rand(256, 4) + 0.5
    y = torch.log(x) @ torch.randn(4, 1)
    for step in range(start, start + steps):
        idx = torch.randint(0, len(x), (32,), generator=torch.Generator().manual_seed(step))
        xb, yb = x[idx].clone(), y[idx].clone()
        if step in NAN_STEPS:
            xb[0, 0] = -1.0
        if step == BIG_STEP:
            yb = yb * 1000
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()


def watch(model: nn.Module, run: Path, **options: Any) -> nn.Module:
    options.setdefault("prometheus", 0)
    return gw.watch(model, run=run, console=False, tensorboard=False, detectors={"exploding": {"warmup": 10}},
                    **options)


def exporter_of(run: str) -> prometheus.Exporter:
    return next(e for e in prometheus.exporters() if run in e.runs)


def scrape(url: str) -> dict[str, list[Any]]:
    """GET the metrics page and parse it: sample name -> samples."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    found = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {found}"
    return float(found[0])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------ the exporter on real runs
def test_scraped_metrics_match_the_store(tmp_path: Path) -> None:
    run_dir = tmp_path / "exp-prom"
    model = watch(make_model(), run_dir)
    url = exporter_of("exp-prom").url
    assert url is not None and re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url), "bound to this machine only"

    loop(model, 30)  # past the NaN steps, while the run is being written
    gw.watcher(model).flush()
    live = scrape(url)
    labels = {"run": "exp-prom", "model": "Sequential"}
    assert value(live, "gradwatch_steps_total", **labels) == gw.open_run(run_dir).steps
    assert value(live, "gradwatch_skipped_steps_total", **labels) == len(NAN_STEPS)

    loop(model, 30, start=30)
    gw.unwatch(model)
    run, final = gw.open_run(run_dir), scrape(url)  # a closed run keeps its final values
    scalars = run.scalars()
    assert value(final, "gradwatch_steps_total", **labels) == run.steps == 60
    assert value(final, "gradwatch_step", **labels) == 59
    assert value(final, "gradwatch_skipped_steps_total", **labels) == int(run.step_info()["skipped"].sum()) == 3
    assert value(final, "gradwatch_grad_norm", **labels) == pytest.approx(scalars["grad_norm"].iloc[-1], rel=1e-6)
    assert value(final, "gradwatch_loss", **labels) == pytest.approx(scalars["loss"].iloc[-1], rel=1e-6)
    assert value(final, "gradwatch_learning_rate", **labels) == pytest.approx(0.05)

    findings = run.findings()
    findings["repeats"] = [d.get("repeats", 1) for d in findings["data"]]
    nonfinite = findings[findings["kind"] == "nonfinite"]
    assert len(nonfinite) == 1 and nonfinite["repeats"].iloc[0] == 3, "the NaN steps fold into one finding"
    assert {"nonfinite", "exploding"} <= set(findings["kind"])
    by_kind = findings.groupby(["kind", "severity"])["repeats"].sum().to_dict()
    for kind in KINDS:  # every series exists (at 0 when nothing was found), each repeat counted once
        for severity in SEVERITIES:
            expected = by_kind.get((kind, severity), 0)
            assert value(final, "gradwatch_findings_total", kind=kind, severity=severity, **labels) == expected
    by_action = findings.groupby("action")["repeats"].sum().to_dict()
    assert by_action.get("skip") == 3 and by_action.get("clip", 0) >= 1
    for action in ACTIONS:
        assert value(final, "gradwatch_actions_total", action=action, **labels) == by_action.get(action, 0)
    assert "gradwatch_layer_grad_norm" not in final, "no per-layer series unless asked"
    assert {s.labels["run"] for samples in final.values() for s in samples} == {"exp-prom"}


class Branches(nn.Module):
    """Parallel linear branches scaled by fixed factors: their gradient norms keep a fixed order."""

    SCALES = (1e-6, 1.0, 2.0, 4.0, 8.0, 16.0)

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(8, 1) for _ in self.SCALES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(s * b(x) for s, b in zip(self.SCALES, self.branches))  # type: ignore[return-value]


def train_branches(run_dir: Path, steps: int, **options: Any) -> nn.Module:
    model = gw.watch(Branches(), run=run_dir, rules=None, console=False, tensorboard=False, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the same gradients' scale every step
    for _ in range(steps):
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    gw.watcher(model).flush()
    return model


def test_per_layer_series_are_capped_flagged_first_then_largest(tmp_path: Path) -> None:
    model = train_branches(tmp_path / "branches", 30, prometheus={"port": 0, "per_layer": True, "max_layers": 3})
    samples = scrape(exporter_of("branches").url or "")
    layers = {s.labels["layer"]: s.value for s in samples["gradwatch_layer_grad_norm"]}
    findings = gw.open_run(tmp_path / "branches").findings()
    assert set(findings["layer"][findings["kind"] == "vanishing"]) == {"branches.0"}, "the 1e-6 branch vanishes"
    assert set(layers) == {"branches.0", "branches.5", "branches.4"}, "the flagged layer, then the largest two"
    stored = gw.open_run(tmp_path / "branches").metrics("grad_norm", include_global=False)
    last = stored[stored["step"] == stored["step"].max()].set_index("layer")["value"]
    for layer, norm in layers.items():
        assert norm == pytest.approx(last[layer], rel=1e-6)
    gw.unwatch(model)


def test_per_layer_cap_without_findings(tmp_path: Path) -> None:
    model = train_branches(tmp_path / "cap", 5, prometheus={"port": 0, "per_layer": True, "max_layers": 2})
    samples = scrape(exporter_of("cap").url or "")
    assert {s.labels["layer"] for s in samples["gradwatch_layer_grad_norm"]} == {"branches.5", "branches.4"}
    gw.unwatch(model)


def test_rewritten_findings_count_each_repeat_once() -> None:
    registry = prometheus_client.CollectorRegistry()
    sink = prometheus.for_registry(registry).sink("folded", model="Net")
    first = Finding("exploding", "warning", 10, "fc", "big", action="clip", id=1)
    sink.write_findings([first])
    for repeats in (2, 5, 5):  # the same finding written again with its repeat count, and once unchanged
        sink.write_findings([Finding("exploding", "warning", 10, "fc", "big", action="clip", id=1,
                                     data={"repeats": repeats})])
    sink.write_findings([Finding("loss_spike", "warning", 12, None, "spike", action="warn", id=2)])
    sink.write_findings([Finding("exploding", "error", 30, None, "huge", action="halt", id=3, data={"repeats": 1})])
    text = prometheus_client.generate_latest(registry).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}

    def get(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"run": "folded", "model": "Net", **labels}.items())))]

    assert get("gradwatch_findings_total", kind="exploding", severity="warning") == 5
    assert get("gradwatch_findings_total", kind="exploding", severity="error") == 1
    assert get("gradwatch_findings_total", kind="loss_spike", severity="warning") == 1
    assert get("gradwatch_actions_total", action="clip") == 5
    assert get("gradwatch_actions_total", action="warn") == 1
    assert get("gradwatch_actions_total", action="halt") == 1
    sink.close("finished")


def test_runs_share_one_server_and_a_rerun_replaces_its_series(tmp_path: Path) -> None:
    port = free_port()
    a = watch(make_model(), tmp_path / "a", prometheus=port)
    b = watch(make_model(), tmp_path / "b", prometheus={"port": port, "addr": "127.0.0.1"})
    loop(a, 5)
    loop(b, 8)
    gw.unwatch(a)
    gw.unwatch(b)
    assert len(prometheus.exporters()) == 1, "one server per address and port"
    url = f"http://127.0.0.1:{port}/metrics"
    samples = scrape(url)
    assert value(samples, "gradwatch_steps_total", run="a") == 5
    assert value(samples, "gradwatch_steps_total", run="b") == 8
    again = watch(make_model(), tmp_path / "again" / "a", prometheus=port)  # same run name: starts afresh
    loop(again, 2)
    gw.unwatch(again)
    assert value(scrape(url), "gradwatch_steps_total", run="a") == 2


def test_an_existing_registry_is_used_without_a_server(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    model = watch(make_model(), tmp_path / "mine", prometheus={"registry": registry})
    loop(model, 4)
    gw.unwatch(model)
    assert [e.url for e in prometheus.exporters()] == [None], "no HTTP server was started"
    assert registry.get_sample_value("gradwatch_steps_total", {"run": "mine", "model": "Sequential"}) == 4
    assert gw.open_run(tmp_path / "mine").meta["options"]["prometheus"]["registry"] == "CollectorRegistry"


def test_export_a_recorded_run(tmp_path: Path) -> None:
    model = watch(make_model(), tmp_path / "recorded", prometheus=None)
    loop(model, 50)
    gw.unwatch(model)
    exporter = prometheus.serve(0)
    prometheus.export_run(tmp_path / "recorded", exporter)
    samples, run = scrape(exporter.url or ""), gw.open_run(tmp_path / "recorded")
    assert value(samples, "gradwatch_steps_total", run="recorded") == 50
    assert value(samples, "gradwatch_skipped_steps_total", run="recorded") == 3
    assert value(samples, "gradwatch_grad_norm", run="recorded") == pytest.approx(run.scalars()["grad_norm"].iloc[-1])
    assert value(samples, "gradwatch_findings_total", run="recorded", kind="nonfinite", severity="error") == 3


# ------------------------------------------------------------------ errors
def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(gw.ConfigError, match=f"port {port} on 127.0.0.1 is already in use"):
            watch(make_model(), tmp_path / "busy", prometheus=port)
    assert not (tmp_path / "busy" / "gradwatch.sqlite").exists(), "a port in use leaves no run behind"
    from gradwatch.watching import registry

    assert not registry._live, "nothing stays watched"


@pytest.mark.parametrize(("option", "message"), [
    ("9108", "must be True, a port number or a mapping"),
    (-1, "port must be an integer from 0 to 65535"),
    ({"port": 70000}, "port must be an integer from 0 to 65535"),
    ({"prot": 9108}, "unknown key 'prot'; valid keys are: port, addr, per_layer"),
    ({"per_layer": "yes"}, "per_layer must be True or False"),
    ({"max_layers": 0}, "max_layers must be a positive integer"),
    ({"addr": ""}, "addr must be a host name or IP address"),
    ({"registry": "default"}, "registry must be a prometheus_client CollectorRegistry"),
])
def test_invalid_options_are_refused_before_anything_is_written(tmp_path: Path, option: Any, message: str) -> None:
    with pytest.raises(gw.ConfigError, match=re.escape(message)):
        gw.watch(make_model(), run=tmp_path / "bad", prometheus=option)
    assert not (tmp_path / "bad").exists()


def test_config_file_turns_it_on_and_names_itself_in_errors(tmp_path: Path) -> None:
    good = tmp_path / "gradwatch.toml"
    good.write_text("[prometheus]\nport = 0\nper_layer = true\nmax_layers = 2\n")
    model = gw.watch(make_model(), run=tmp_path / "toml", rules=good, console=False, tensorboard=False)
    loop(model, 3)
    gw.watcher(model).flush()
    samples = scrape(exporter_of("toml").url or "")
    assert value(samples, "gradwatch_steps_total", run="toml") == 3  # flush wrote the third step too
    assert len(samples["gradwatch_layer_grad_norm"]) == 2
    gw.unwatch(model)
    bad = tmp_path / "bad.toml"
    bad.write_text('prometheus = "yes"\n')
    with pytest.raises(gw.ConfigError, match=r"bad\.toml: option prometheus must be True, a port number"):
        gw.watch(make_model(), run=tmp_path / "x", rules=bad)


def test_missing_prometheus_client_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "gradwatch.integrations.prometheus")
    with pytest.raises(gw.ConfigError, match=re.escape("pip install 'gradwatch[prometheus]'")):
        gw.watch(make_model(), run=tmp_path / "none", prometheus=9108)
    with pytest.raises(ImportError, match=re.escape("pip install 'gradwatch[prometheus]'")):
        import gradwatch.integrations.prometheus  # noqa: F401
    monkeypatch.undo()


@pytest.mark.slow  # a subprocess
def test_watching_without_the_option_never_imports_prometheus_client(tmp_path: Path) -> None:
    code = (
        "import sys, torch, gradwatch as gw\n"
        f"m = gw.watch(torch.nn.Linear(2, 1), run={str(tmp_path / 'light')!r}, console=False)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "m(torch.ones(1, 2)).sum().backward(); opt.step(); gw.unwatch(m)\n"
        "print('prometheus_client' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# ------------------------------------------------------------------ Grafana dashboard
def grafana_dashboard() -> dict[str, Any]:
    return json.loads((files("gradwatch.dashboards") / "grafana" / "gradwatch.json").read_text(encoding="utf-8"))


def test_grafana_dashboard_queries_only_exported_metrics(tmp_path: Path) -> None:
    model = watch(make_model(), tmp_path / "graf", prometheus={"port": 0, "per_layer": True})
    loop(model, 30)
    gw.unwatch(model)
    exported = set(scrape(exporter_of("graf").url or ""))

    dash = grafana_dashboard()
    assert dash["schemaVersion"] >= 36 and dash["uid"] == "gradwatch" and dash["id"] is None
    (source,) = dash["__inputs"]
    assert source["name"] == "DS_PROMETHEUS" and source["type"] == "datasource" and source["pluginId"] == "prometheus"
    datasource = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    (variable,) = dash["templating"]["list"]
    assert variable["name"] == "run" and variable["datasource"] == datasource
    assert variable["query"]["query"] == variable["definition"] == "label_values(gradwatch_step, run)"
    assert variable["multi"] and variable["includeAll"]

    referenced, ids = set(), set()
    for panel in dash["panels"]:
        assert panel["id"] not in ids
        ids.add(panel["id"])
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == datasource, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == datasource
            expr = target["expr"]
            assert '{run=~"$run"' in expr, f"{panel['title']}: every query follows the run variable"
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
            names = set(re.findall(r"\bgradwatch_[a-z_]+\b", expr))
            assert names, expr
            assert names <= exported, f"{panel['title']}: {names - exported} is not exported"
            referenced |= names
    families = {"gradwatch_grad_norm", "gradwatch_loss", "gradwatch_learning_rate", "gradwatch_step",
                "gradwatch_steps_total", "gradwatch_skipped_steps_total", "gradwatch_findings_total",
                "gradwatch_actions_total", "gradwatch_layer_grad_norm"}
    assert families <= exported
    assert referenced == families, "every exported metric has a panel"


def test_finished_runs_series_are_dropped_after_a_while(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = prometheus_client.CollectorRegistry()
    first = watch(make_model(), tmp_path / "first", prometheus={"registry": registry})
    loop(first, 3)
    gw.unwatch(first)
    second = watch(make_model(), tmp_path / "second", prometheus={"registry": registry})
    assert registry.get_sample_value("gradwatch_steps_total", {"run": "first", "model": "Sequential"}) == 3
    gw.unwatch(second)
    monkeypatch.setattr(prometheus, "FINISHED_SECONDS", 0.0)
    third = watch(make_model(), tmp_path / "third", prometheus={"registry": registry})
    runs = {s.labels["run"] for m in registry.collect() for s in m.samples}
    assert runs == {"third"}, "the finished runs' series are gone, their cardinality with them"
    gw.unwatch(third)
