"""The mlflow sink against real MLflow tracking stores: a SQLite store, and a real ``mlflow server`` on loopback.

Everything the sink wrote is read back with ``MlflowClient`` and compared with the run's own store.

The scripts that run unattended (the example, the training against a server that never answers) are
started as the module begins, one after the other beside the test process, and so is the real server;
their tests check what they printed and wrote.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from mlflow.utils.validation import _validate_metric_name, _validate_tag_name
from torch import nn

import gradwatch as gw
from gradwatch.sinks import mlflow as mlflow_sink
from gradwatch.testing import SinkContract

from . import pool

ROOT = Path(__file__).resolve().parents[1]
STEPS, NAN_STEP = 25, 12


@dataclass
class Tracking:
    """A tracking store and a client reading it; one experiment per test (artifacts under ``root``)."""

    uri: str
    client: Any
    root: Path

    def experiment(self, name: str) -> str:
        return self.client.create_experiment(name, artifact_location=(self.root / "artifacts" / name).as_uri())

    def only_run(self, experiment: str) -> Any:
        runs = self.client.search_runs([experiment])
        assert len(runs) == 1, [r.info.run_id for r in runs]
        return runs[0]

    def history(self, run_id: str, key: str) -> dict[int, float]:
        return {m.step: m.value for m in self.client.get_metric_history(run_id, key)}

    def table(self, run_id: str, path: str = "gradwatch/findings.json") -> dict[str, Any]:
        local = self.client.download_artifacts(run_id, path, str(self.root / "downloads" / run_id))
        return json.loads(Path(local).read_text())


@pytest.fixture(scope="module")
def tracking(tmp_path_factory: pytest.TempPathFactory) -> Tracking:
    """A SQLite tracking store, created (MLflow's migrations) before any sink opens it."""
    root = tmp_path_factory.mktemp("mlflow")
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    client.search_experiments()
    return Tracking(f"sqlite:///{root / 'mlflow.db'}", client, root)


class Odd(nn.Module):
    """Layer names MLflow does not take as they are: ``(root)`` (a parameter of its own), a space, a slash."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.blocks = nn.ModuleDict({"in proj": nn.Linear(4, 16), "out/proj": nn.Linear(16, 1)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks["out/proj"](torch.tanh(self.blocks["in proj"](x))) * self.scale


def train(model: nn.Module, *, steps: int = STEPS, nan_at: int | None = NAN_STEP) -> None:
    torch.manual_seed(1)
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if step == nan_at:
            grad = next(model.parameters()).grad
            assert grad is not None
            grad[0] = math.nan
        gw.watcher(model).observe(loss=loss)
        opt.step()


def watched(tmp_path: Path, **options: Any) -> nn.Module:
    torch.manual_seed(0)
    model = Odd()
    gw.watch(model, run=tmp_path / "run", console=False, **options)
    return model


def check_against_the_store(tracking: Tracking, run_id: str, run_dir: Path, *, prefix: str = "gradwatch") -> None:
    """Every global and per-layer point in MLflow is the store's, at the store's step; the findings table is too."""
    with gw.open_run(run_dir) as run:
        scalars = run.scalars()
        metrics = run.metrics(include_global=False)
        findings = run.findings()
        layers = run.layers
    for name in ("grad_norm", "loss", "lr"):
        sent = tracking.history(run_id, f"{prefix}/global/{name}")
        assert sorted(sent) == list(range(STEPS))
        np.testing.assert_allclose([sent[s] for s in range(STEPS)], scalars[name].to_numpy(), rtol=1e-6)
    # 1 on the skipped step, 0 on every other: its latest value says the last step was not skipped
    assert tracking.history(run_id, f"{prefix}/global/skipped") == {s: float(s == NAN_STEP) for s in range(STEPS)}
    keys = dict(zip(layers, mlflow_sink.safe_names(layers, 200)))
    # a layer's NaN/Inf count: where not 0, then 0 on the next step written (its latest value says none now)
    counted = [tracking.history(run_id, f"{prefix}/grad_nonfinite/{keys[layer]}") for layer in layers]
    counted = [sent for sent in counted if sent]
    assert counted and all([s for s, v in sent.items() if v] == [NAN_STEP] and sent[max(sent)] == 0.0
                           and max(sent) > NAN_STEP for sent in counted)
    grad = metrics[metrics["metric"] == "grad_norm"]
    for layer in layers:
        sent = tracking.history(run_id, f"{prefix}/grad_norm/{keys[layer]}")
        stored = grad[(grad["layer"] == layer) & grad["step"].isin([0, 10, 20, NAN_STEP])]
        assert sorted(sent) == sorted(stored["step"]), layer  # sampled steps, and the NaN step
        np.testing.assert_allclose([sent[s] for s in stored["step"]], stored["value"].to_numpy(), rtol=1e-6)
    table = tracking.table(run_id, f"{prefix}/findings.json")
    assert table["columns"] == list(mlflow_sink.COLUMNS)
    columns = ["kind", "severity", "layer", "step", "action"]
    assert [row[:5] for row in table["data"]] == findings[columns].values.tolist()


# ----------------------------------------------------------------------------------- a new run, the active run
@pytest.mark.slow  # the tracking store: MLflow's SQLite migrations and imports take seconds
def test_a_run_goes_into_an_mlflow_run_the_sink_starts_and_ends(
    tracking: Tracking, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    experiment = tracking.experiment("new-run")
    model = watched(tmp_path, sinks={"mlflow": {"tracking_uri": tracking.uri, "experiment": "new-run"}})
    train(model)
    gw.unwatch(model)
    found = tracking.only_run(experiment)
    assert f"the mlflow sink started one ('run', id {found.info.run_id}, experiment {experiment}" in caplog.text
    assert (found.info.status, found.info.run_name) == ("FINISHED", "run")
    tags = {k: v for k, v in found.data.tags.items() if k.startswith("gradwatch.")}
    assert tags == {"gradwatch.run": str(tmp_path / "run"), "gradwatch.verdict": "fail", "gradwatch.worst": "error",
                    "gradwatch.status": "finished", "gradwatch.steps": str(STEPS),
                    "gradwatch.findings": json.dumps({"info": 0, "warning": 0, "error": 1})}
    with gw.open_run(tmp_path / "run") as run:
        assert run.layers == ["(root)", "blocks.in proj", "blocks.out/proj"]
    parts = {key.rpartition("/")[2] for key in found.data.metrics if key.startswith("gradwatch/grad_norm/")}
    assert parts == {"_root_", "blocks.in_proj", "blocks.out_proj"}
    check_against_the_store(tracking, found.info.run_id, tmp_path / "run")


@pytest.mark.slow  # the tracking store: MLflow's SQLite migrations and imports take seconds
def test_the_active_run_takes_the_run_and_stays_open_named_in_pyproject(
    tracking: Tracking, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    experiment = tracking.experiment("active-run")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking.uri)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[tool.gradwatch]\nsinks = ["mlflow"]\n')
    with mlflow.start_run(experiment_id=experiment) as active:
        mlflow.log_metric("accuracy", 0.5, step=3)  # the user's own, beside gradwatch's
        model = watched(tmp_path)
        train(model)
        gw.unwatch(model)
        assert tracking.client.get_run(active.info.run_id).info.status == "RUNNING", "the user's run, left open"
    found = tracking.only_run(experiment)
    assert found.info.run_id == active.info.run_id and found.info.status == "FINISHED"
    assert found.data.metrics["accuracy"] == 0.5 and found.data.tags["gradwatch.verdict"] == "fail"
    assert "started one" not in caplog.text
    check_against_the_store(tracking, found.info.run_id, tmp_path / "run")


@pytest.mark.slow  # the tracking store: MLflow's SQLite migrations and imports take seconds
def test_a_config_file_names_the_settings(tracking: Tracking, tmp_path: Path) -> None:
    experiment = tracking.experiment("settings")
    config = tmp_path / "gradwatch.toml"
    config.write_text(textwrap.dedent(f"""
        [sinks.mlflow]
        tracking_uri = {json.dumps(tracking.uri)}
        experiment = "settings"
        run_name = "named"
        layer_metrics = ["grad_norm"]
        prefix = "models/odd"
    """))
    model = watched(tmp_path, rules=str(config))
    train(model, nan_at=None)
    gw.unwatch(model)
    found = tracking.only_run(experiment)
    assert found.info.run_name == "named"
    assert found.data.tags["models.odd.verdict"] == "pass" and found.data.tags["models.odd.worst"] == "none"
    per_layer = {key.rsplit("/", 1)[0] for key in found.data.metrics if "/global/" not in key}
    assert per_layer == {"models/odd/grad_norm"}
    assert sorted(tracking.history(found.info.run_id, "models/odd/global/grad_norm")) == list(range(STEPS))


@pytest.mark.slow  # the tracking store: MLflow's SQLite migrations and imports take seconds
def test_a_step_with_more_points_than_one_log_batch_takes_is_sent_whole(tracking: Tracking, tmp_path: Path) -> None:
    experiment = tracking.experiment("wide")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(300)])  # 300 layers x 6 statistics on a sampled step
    gw.watch(model, run=tmp_path / "run", console=False, tensorboard=False, rules=None,
             sinks={"mlflow": {"tracking_uri": tracking.uri, "experiment": "wide"}})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(4, 1)).sum().backward()
        opt.step()
    gw.unwatch(model)
    found = tracking.only_run(experiment)
    with gw.open_run(tmp_path / "run") as run:
        stored = run.metrics(steps=slice(0, 1), include_global=False).dropna(subset=["value"])
    stored = stored[(stored["metric"] != "grad_nonfinite") | (stored["value"] != 0)]
    sent = [key for key in found.data.metrics if "/global/" not in key]
    assert len(stored) > mlflow_sink.METRICS_PER_CALL
    assert len(sent) == len(stored)
    assert tracking.history(found.info.run_id, "gradwatch/act_norm/299") == {0: pytest.approx(
        stored[(stored["layer"] == "299") & (stored["metric"] == "act_norm")]["value"].item(), rel=1e-6)}


# ------------------------------------------------------------------------------------------------------ keys
def test_layer_names_become_distinct_keys_mlflow_takes() -> None:
    names = ["blocks.0.attn", "(root)", "in proj", "in_proj", "in_proj_2", "out/proj", "..", ".", "", "ünï",
             "x" * 400, "x" * 399 + "y"]
    parts = mlflow_sink.safe_names(names, 200)
    assert parts[:8] == ["blocks.0.attn", "_root_", "in_proj", "in_proj_2", "in_proj_2_2", "out_proj", "__", "_"]
    assert parts[8:10] == ["__2", "_n_"]  # "" is "_", taken by ".": "_" then "_2"; "ünï" keeps its ASCII
    assert len(set(parts)) == len(parts), "distinct"
    assert mlflow_sink.safe_names(names, 200) == parts, "deterministic"
    assert all(len(p) <= 200 for p in parts) and parts[10] != parts[11]
    for part in parts:
        _validate_metric_name(f"gradwatch/grad_norm/{part}")
        _validate_tag_name(f"gradwatch.{part}")


# ------------------------------------------------------------------------------------------- errors, settings
def test_without_mlflow_watch_fails_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what an environment without the package imports
    with pytest.raises(gw.ConfigError) as raised:
        gw.watch(nn.Linear(2, 2), run=tmp_path / "run", sinks=["mlflow"])
    assert "\n" not in str(raised.value)
    assert str(raised.value).endswith("the mlflow sink needs the mlflow package, which is not installed: "
                                      "pip install 'gradwatch[mlflow]'")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("settings, wrong", [
    ({"timeout": "5"}, "setting timeout must be a number of seconds"),
    ({"backlog": 0}, "setting backlog must be a positive integer"),
    ({"prefix": "a//b"}, "setting prefix must be a key prefix"),
    ({"prefix": "a/../b"}, "setting prefix must be a key prefix"),
    ({"layer_metrics": "grad_norm"}, "setting layer_metrics must be a list of metric names"),
    ({"run_id": ""}, "setting run_id must be a non-empty string"),
    ({"experment": "x"}, "unexpected keyword argument 'experment'"),
])
def test_wrong_settings_fail_watch(tmp_path: Path, settings: dict[str, Any], wrong: str) -> None:
    with pytest.raises(gw.ConfigError, match=f"sink plugin 'mlflow' failed to start: .*{wrong}"):
        gw.watch(nn.Linear(2, 2), run=tmp_path / "run", sinks={"mlflow": settings})
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # the tracking store: MLflow's SQLite migrations and imports take seconds
def test_a_sink_whose_calls_fail_is_disabled_and_training_goes_on(
    tracking: Tracking, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = watched(tmp_path, sinks={"mlflow": {"tracking_uri": tracking.uri, "run_id": "0" * 32}})  # no such run
    with caplog.at_level(logging.ERROR, logger="gradwatch"):
        train(model)
        gw.unwatch(model)
    assert "MLflow sink failed and is disabled for this run" in caplog.text
    assert "sending to MLflow at sqlite" in caplog.text and "nothing more is sent to MLflow" in caplog.text
    with gw.open_run(tmp_path / "run") as run:
        assert (run.steps, run.status) == (STEPS, "finished")


HUNG = """
import sys, warnings
import torch
from torch import nn
import gradwatch as gw

warnings.simplefilter("always")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
gw.watch(model, run="run", console=False, flush_seconds=0.05,
         sinks={"mlflow": {"tracking_uri": sys.argv[1], "backlog": 40, "timeout": 0.5}})
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(60):
    opt.zero_grad()
    loss = model(torch.randn(16, 4)).pow(2).mean()
    loss.backward()
    gw.watcher(model).observe(loss=loss)
    opt.step()
    if step % 10 == 0:
        gw.watcher(model).flush()
gw.unwatch(model)
print("trained", flush=True)
"""


def _never_answered(cwd: Path) -> tuple[str, subprocess.CompletedProcess[str]]:
    """HUNG trained against a tracking server that never answers: its URI, and the completed process."""
    with socket.socket() as hole:  # accepts connections (the kernel does) and never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(64)
        uri = f"http://127.0.0.1:{hole.getsockname()[1]}"
        script = cwd / "hung.py"
        script.write_text(HUNG)
        # the timeout only guards the test suite against a hang: MLflow alone would wait minutes per call
        return uri, subprocess.run([sys.executable, str(script), uri], cwd=cwd, capture_output=True, text=True,
                                   timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _example(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "examples" / "mlflow_example.py")], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


#: the scripts run unattended, by test
UNATTENDED = {"test_a_tracking_server_that_never_answers_does_not_hold_training": _never_answered,
              "test_the_example_runs_as_written": _example}
#: what ``ran`` gives: by test, its script's outcome to come, and its folder
Ran = dict[str, tuple[Future[Any], Path]]


@pytest.fixture(scope="module")
def ran(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ran]:
    """The unattended scripts of the tests this session runs, started one after the other as the module
    begins: their outcomes to come, and their folders."""
    names = pool.tested(request)
    with ThreadPoolExecutor(1) as runner:
        started = {}
        for name, script in UNATTENDED.items():
            if name in names:
                cwd = tmp_path_factory.mktemp(name[:40])
                started[name] = (runner.submit(script, cwd), cwd)
        yield started
        for future, _ in started.values():
            future.cancel()  # a session stopped early (-x) runs no script it no longer tests


@pytest.mark.slow  # a Python process that imports torch and mlflow
def test_a_tracking_server_that_never_answers_does_not_hold_training(ran: Ran) -> None:
    future, tmp_path = ran["test_a_tracking_server_that_never_answers_does_not_hold_training"]
    uri, done = future.result()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "trained"
    assert f"the MLflow tracking server at {uri} is not keeping up" in done.stderr
    assert f"the MLflow tracking server at {uri} did not answer within 0.5 s" in done.stderr
    assert "as the run 'run' closed: " in done.stderr
    with gw.open_run(tmp_path / "run") as run:
        assert (run.steps, run.status) == (60, "finished")


# ------------------------------------------------------------------------------------------ a real server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def starting_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[tuple[subprocess.Popen[bytes], str, Path] | None]:
    """``mlflow server`` on loopback (SQLite store, artifacts served by it), started as the module begins when
    this session runs a test of it (its process, URI and folder), stopped after the module."""
    if "test_a_real_mlflow_server_gets_the_run" not in pool.tested(request):
        yield None
        return
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    with (root / "server.log").open("w") as log:
        process = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
                                    str(port), "--workers", "1", "--backend-store-uri",
                                    f"sqlite:///{root / 'db.sqlite'}", "--artifacts-destination",
                                    str(root / "artifacts")],
                                   cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield process, f"http://127.0.0.1:{port}", root
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module", autouse=True)
def _started_as_the_module_begins(ran: Ran, starting_server: Any) -> None:
    """The unattended scripts and the real server start with the module's first test."""


@pytest.fixture(scope="module")
def server(starting_server: tuple[subprocess.Popen[bytes], str, Path] | None) -> str:
    """The real server's URI, once it answers."""
    assert starting_server is not None
    process, uri, root = starting_server
    deadline = time.monotonic() + 180  # a loaded machine takes tens of seconds to start it
    while True:
        assert process.poll() is None, (root / "server.log").read_text()
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    return uri
        except OSError:
            pass
        assert time.monotonic() < deadline, "mlflow server did not start:\n" + (root / "server.log").read_text()
        time.sleep(0.5)


@pytest.mark.slow  # starts a real mlflow server
def test_a_real_mlflow_server_gets_the_run(server: str, tmp_path: Path) -> None:
    remote = Tracking(server, MlflowClient(server), tmp_path)
    experiment = remote.client.create_experiment("served")  # artifacts: the server's own, uploaded through it
    model = watched(tmp_path, sinks={"mlflow": {"tracking_uri": server, "experiment": "served"}})
    train(model)
    gw.unwatch(model)
    found = remote.only_run(experiment)
    assert found.info.status == "FINISHED" and found.info.artifact_uri.startswith("mlflow-artifacts:")
    assert (found.data.tags["gradwatch.verdict"], found.data.tags["gradwatch.worst"]) == ("fail", "error")
    check_against_the_store(remote, found.info.run_id, tmp_path / "run")


# --------------------------------------------------------------------------------------------- the contract
class TestMLflowSinkContract(SinkContract):
    @pytest.fixture(autouse=True)
    def _store(self, tracking: Tracking) -> None:
        self.tracking = tracking

    def make(self, run_dir: Path) -> Any:
        run_dir.mkdir(parents=True)
        self.sink = mlflow_sink.MLflow(run_dir, tracking_uri=self.tracking.uri)
        return self.sink

    def steps(self, run_dir: Path) -> list[int]:
        assert self.sink.run_id is not None
        return sorted(self.tracking.history(self.sink.run_id, "gradwatch/global/grad_norm"))


# ----------------------------------------------------------------------------------------------- the example
@pytest.mark.slow  # runs the example as a script
def test_the_example_runs_as_written(ran: Ran) -> None:
    future, tmp_path = ran["test_the_example_runs_as_written"]
    done = future.result()
    assert done.returncode == 0, done.stderr
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("gradwatch-example")
    assert experiment is not None, "the example made no experiment"
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.data.tags["gradwatch.verdict"] == "fail" and found.data.tags["gradwatch.worst"] == "error"
    assert f"MLflow run {found.info.run_id}: verdict fail" in done.stdout
    history = client.get_metric_history(found.info.run_id, "gradwatch/global/grad_norm")
    assert [m.step for m in history] == list(range(100))
