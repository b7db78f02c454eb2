"""Plugins through entry points: examples/plugin_package installed for real (pip --target), and a
distribution of broken plugins that must never break the built-ins."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch import plugins
from gradwatch.actions import Action
from gradwatch.detectors import Detector
from gradwatch.report import render
from gradwatch.rules import DEFAULT_RULES
from gradwatch.testing import ActionContract, DetectorContract, SinkContract

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plugin_package"
MODULE = "gradwatch_example_plugins"


@pytest.fixture(scope="module")
def example_plugins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """examples/plugin_package installed into a folder put on sys.path (as site-packages is)."""
    root = tmp_path_factory.mktemp("plugins")
    source, target = root / "src", root / "site"
    shutil.copytree(EXAMPLE, source)
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                    "--quiet", "--target", str(target), str(source)], check=True, capture_output=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(target))
        yield target
    sys.modules.pop(MODULE, None)


BROKEN = '''
from dataclasses import dataclass
from gradwatch.actions import Action
from gradwatch.detectors import Detector
from gradwatch.report import render

@dataclass
class Explodes(Detector):
    """Raises at step 3."""
    kind = "explodes"
    def check(self, record):
        if record.step == 3:
            raise RuntimeError("plugin bug")
        return []

@dataclass
class WrongKind(Detector):
    kind = "something_else"
    def check(self, record):
        return []

@dataclass
class BadFindings(Detector):
    kind = "bad_findings"
    def check(self, record):
        return "not a list"

@dataclass
class BadData(Detector):
    kind = "bad_data"
    def check(self, record):
        return [self.finding(record, "warning", None, "data the store cannot keep", data={(1, 2): "a tuple key"})]

class ExplodingAction(Action):
    name = "explodes"
    def apply(self, rule, finding, control):
        raise RuntimeError("action bug")

class BadInitAction(Action):
    name = "bad_init_action"
    def __init__(self):
        raise RuntimeError("no webhook configured")

class ExplodingSink:
    def __init__(self, run_dir):
        pass
    def write(self, records):
        raise OSError("sink bug")
    def close(self, status):
        pass

class BadInit:
    def __init__(self, run_dir, **settings):
        raise TypeError("unexpected setting")
    def write(self, records):
        pass
    def close(self, status):
        pass
'''

BROKEN_ENTRY_POINTS = '''
[gradwatch.detectors]
cannot_import = broken_plugins_missing:Nope
explodes = broken_plugins:Explodes
wrong_kind = broken_plugins:WrongKind
bad_findings = broken_plugins:BadFindings
bad_data = broken_plugins:BadData

[gradwatch.actions]
explodes = broken_plugins:ExplodingAction
bad_init_action = broken_plugins:BadInitAction

[gradwatch.sinks]
explodes = broken_plugins:ExplodingSink
bad_init = broken_plugins:BadInit
'''


@pytest.fixture
def broken_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An installed distribution (a .dist-info folder on sys.path) whose plugins are all broken."""
    site = tmp_path / "site"
    info = site / "broken_plugins-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugins\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(BROKEN_ENTRY_POINTS)
    (site / "broken_plugins.py").write_text(textwrap.dedent(BROKEN))
    monkeypatch.syspath_prepend(str(site))
    yield site
    sys.modules.pop("broken_plugins", None)


def regression() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(128, 8)
    return model, x, x @ torch.randn(8, 1)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int, lr: float = 0.05,
          nan_at: tuple[int, ...] = ()) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if step in nan_at:
            next(model.parameters()).grad[0, 0] = math.nan
        gw.watcher(model).observe(loss=loss)
        opt.step()


# ------------------------------------------------------------------ the example package, for real
@pytest.mark.usefixtures("example_plugins")
class TestLossPlateauContract(DetectorContract):
    @property
    def detector(self) -> Any:  # type: ignore[override]
        return plugins.load("detector", "loss_plateau", Detector)


@pytest.mark.usefixtures("example_plugins")
class TestAppendJsonContract(ActionContract):
    @property
    def action(self) -> Any:  # type: ignore[override]
        return plugins.load("action", "append_json", Action)

    def rule_params(self, tmp_path: Path) -> dict[str, Any]:
        return {"path": str(tmp_path / "alerts.jsonl")}


@pytest.mark.usefixtures("example_plugins")
class TestJsonLinesContract(SinkContract):
    def make(self, run_dir: Path) -> Any:
        return plugins.load("sink", "jsonl")(run_dir)

    def steps(self, run_dir: Path) -> list[int]:
        return [json.loads(line)["step"] for line in (run_dir / "steps.jsonl").read_text().splitlines()]


@pytest.mark.slow  # trains with the example plugin package
def test_the_example_plugins_run_by_name_beside_the_built_ins(example_plugins: Path, tmp_path: Path) -> None:
    alerts, run = tmp_path / "alerts.jsonl", tmp_path / "run"
    model, x, y = regression()
    gw.watch(model, run=run, console=False, detectors={"loss_plateau": {"patience": 5}},
             rules=[gw.Rule(when="loss_plateau", do="append_json", path=str(alerts)), *DEFAULT_RULES],
             sinks={"jsonl": {"filename": Path("steps.jsonl")}})  # any object: the run's metadata keeps text
    train(model, x, y, steps=12, lr=0.0, nan_at=(8,))  # lr 0: the loss never improves
    gw.unwatch(model)
    with gw.open_run(run) as stored:
        found = stored.findings()
        assert stored.meta["options"]["sinks"] == {"jsonl": {"filename": "steps.jsonl"}}
    rows = [(r.step, r.kind, r.action) for r in found.itertuples()]
    assert rows == [(5, "loss_plateau", "append_json"), (8, "nonfinite", "skip")]
    assert found["data"].iloc[0]["outcome"] == {"appended_to": str(alerts)}
    assert [json.loads(line)["step"] for line in alerts.read_text().splitlines()] == [5]
    lines = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(12))
    assert [line["step"] for line in lines if line["skipped"]] == [8]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())

    # the CLI knows the plugin's kind: check fails on it, JUnit has a case for it; re-judged by its settings
    env = _env(str(example_plugins))
    command = [sys.executable, "-m", "gradwatch", "check", str(run), "--fail-on", "warning", "--format"]
    out = subprocess.run([*command, "json"], capture_output=True, text=True, env=env)
    assert out.returncode == 1, out.stderr
    assert [f["kind"] for f in json.loads(out.stdout)["findings"]] == ["loss_plateau", "nonfinite"]
    junit = ElementTree.fromstring(subprocess.run([*command, "junit"], capture_output=True, text=True, env=env).stdout)
    cases = {case.get("name"): case for case in junit.iter("testcase")}
    assert cases["loss_plateau"].find("failure") is not None
    rules = tmp_path / "rules.toml"
    rules.write_text("[detectors.loss_plateau]\npatience = 3\n")
    out = subprocess.run([*command, "json", "--rules", str(rules)], capture_output=True, text=True, env=env)
    assert [(f["kind"], f["step"]) for f in json.loads(out.stdout)["findings"]][0] == ("loss_plateau", 3)
    page = render(run)  # the report explains the plugin's finding with its hint
    assert "Loss plateau" in page and "lower the learning rate, or stop" in page


def _env(path: str) -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])}


def test_rules_and_options_list_installed_plugins_among_the_choices(example_plugins: Path) -> None:
    with pytest.raises(gw.ConfigError, match=r"valid kinds are: .*loss_plateau"):
        gw.Rule(when="loss_plateu", do="warn")
    with pytest.raises(gw.ConfigError, match=r"valid actions are: .*append_json"):
        gw.Rule(when="*", do="append_jsn")
    with pytest.raises(gw.ConfigError, match="action 'append_json' needs field 'path'"):
        gw.Rule(when="*", do="append_json")
    with pytest.raises(gw.ConfigError, match="field 'path' must be a non-empty string"):
        gw.Rule(when="*", do="append_json", path=3)
    with pytest.raises(gw.ConfigError, match=r"valid detectors are: .*loss_plateau"):
        gw.watch(nn.Linear(2, 2), run="unused", detectors={"loss_plato": {}})
    with pytest.raises(gw.ConfigError, match="setting 'patience' must be a non-negative int"):
        gw.watch(nn.Linear(2, 2), run="unused", detectors={"loss_plateau": {"patience": "5"}})
    missing = r"no sink named 'jsonline' is installed .*; installed sink plugins: (.*, )?jsonl(, .*)?$"  # and built-ins
    with pytest.raises(gw.ConfigError, match=missing):
        gw.watch(nn.Linear(2, 2), run="unused", sinks=["jsonline"])
    for bad in (5, "jsonl", {"jsonl": 3}, ["jsonl", "jsonl"]):
        with pytest.raises(gw.ConfigError, match="option sinks"):
            gw.watch(nn.Linear(2, 2), run="unused", sinks=bad)
    assert not Path("unused").exists()


# ------------------------------------------------------------------ broken plugins
def test_an_installed_broken_plugin_cannot_affect_a_run_that_does_not_name_it(
    broken_plugins: Path, tmp_path: Path
) -> None:
    model, x, y = regression()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gw.watch(model, run=tmp_path / "run", console=False)
        train(model, x, y, steps=8, nan_at=(4,))
        gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        assert [(r.step, r.kind, r.action) for r in run.findings().itertuples()] == [(4, "nonfinite", "skip")]
    assert "broken_plugins" not in sys.modules


@pytest.mark.parametrize(("settings", "message"), [
    ({"detectors": {"cannot_import": {}}},
     r"detector plugin 'cannot_import' \(broken_plugins_missing:Nope, from broken-plugins 1.0\) failed to load: "
     r"ModuleNotFoundError"),
    ({"detectors": {"wrong_kind": {}}}, r"detector plugin 'wrong_kind' must be a @dataclass subclass .* kind"),
    ({"sinks": ["bad_init"]}, r"sink plugin 'bad_init' failed to start: TypeError: unexpected setting"),
    ({"rules": [{"when": "nonfinite", "do": "bad_init_action"}]},
     r"action plugin 'bad_init_action' failed to build: RuntimeError: no webhook configured"),
])
def test_a_named_plugin_that_cannot_start_is_one_clear_error_before_training(
    broken_plugins: Path, tmp_path: Path, settings: dict[str, Any], message: str
) -> None:
    model = nn.Linear(2, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(gw.ConfigError, match=message):
        gw.watch(model, run=tmp_path / "run", console=False, **settings)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_a_detector_plugin_that_raises_is_disabled_and_the_built_ins_go_on(
    broken_plugins: Path, tmp_path: Path
) -> None:
    model, x, y = regression()
    gw.watch(model, run=tmp_path / "run", console=False,
             detectors={"explodes": {}, "bad_findings": {}, "bad_data": {}})
    with pytest.warns(gw.PluginWarning) as caught:
        train(model, x, y, steps=10, nan_at=(6,))
    gw.unwatch(model)
    messages = sorted(str(w.message) for w in caught if issubclass(w.category, gw.PluginWarning))
    assert len(messages) == 3
    assert "detector plugin 'bad_data' failed at step 0 (TypeError: keys must be" in messages[0]
    assert "detector plugin 'bad_findings' failed at step 0 (TypeError: check() must return a list" in messages[1]
    assert "detector plugin 'explodes' failed at step 3 (RuntimeError: plugin bug)" in messages[2]
    with gw.open_run(tmp_path / "run") as run:
        assert [(r.step, r.kind, r.action) for r in run.findings().itertuples()] == [(6, "nonfinite", "skip")]
        assert run.status == "finished"
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_an_action_plugin_that_raises_is_disabled_and_training_goes_on(broken_plugins: Path, tmp_path: Path) -> None:
    model, x, y = regression()
    gw.watch(model, run=tmp_path / "run", console=False, rules=[gw.Rule(when="nonfinite", do="explodes")])
    with pytest.warns(gw.PluginWarning, match="action plugin 'explodes' failed at step 3") as caught:
        train(model, x, y, steps=10, nan_at=(3,))  # the NaN reaches the weights: findings every step from 3
    gw.unwatch(model)
    assert len([w for w in caught if issubclass(w.category, gw.PluginWarning)]) == 1  # disabled after the first
    with gw.open_run(tmp_path / "run") as run:
        assert run.status == "finished"
        assert run.steps == 10
        found = run.findings()
    assert (found["step"].iloc[0], found["action"].iloc[0]) == (3, "explodes")


def test_a_sink_plugin_that_raises_is_disabled_and_the_store_is_whole(
    broken_plugins: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, x, y = regression()
    gw.watch(model, run=tmp_path / "run", console=False, sinks=["explodes"])
    train(model, x, y, steps=10)
    gw.unwatch(model)
    assert "ExplodingSink sink failed and is disabled" in caplog.text
    with gw.open_run(tmp_path / "run") as run:
        assert run.steps == 10
        assert run.status == "finished"


def test_plugins_are_named_in_a_config_file_like_the_built_ins(example_plugins: Path, tmp_path: Path) -> None:
    alerts = tmp_path / "alerts.jsonl"
    config = tmp_path / "gradwatch.toml"
    config.write_text(textwrap.dedent(f"""
        sinks = ["jsonl"]

        [detectors.loss_plateau]
        patience = 4

        [[rules]]
        when = "loss_plateau"
        do = "append_json"
        path = {json.dumps(str(alerts))}
    """))
    model, x, y = regression()
    gw.watch(model, run=tmp_path / "run", console=False, rules=str(config))
    train(model, x, y, steps=8, lr=0.0)
    gw.unwatch(model)
    assert [json.loads(line)["step"] for line in alerts.read_text().splitlines()] == [4]
    assert len((tmp_path / "run" / "steps.jsonl").read_text().splitlines()) == 8
    config.write_text('[[rules]]\nwhen = "loss_plateau"\ndo = "append_json"\n')
    with pytest.raises(gw.ConfigError, match=r"gradwatch.toml: rules\[0\]: action 'append_json' needs field 'path'"):
        gw.watch(nn.Linear(2, 2), run=tmp_path / "other", rules=str(config))
