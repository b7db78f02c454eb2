"""The wandb sink, with the real wandb package in offline mode: what it wrote is read back from the run's own
transaction log (tests/wandb_offline.py), nothing leaves the machine.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import wandb
from torch import nn

import gradwatch as gw
from gradwatch.sinks import wandb as wandb_sink
from gradwatch.store import verdict
from gradwatch.store.findings import Finding
from gradwatch.testing import SinkContract
from tests.wandb_offline import OfflineRun
from tests.wandb_offline import offline_runs as read_runs

from . import pool

ROOT = Path(__file__).resolve().parents[1]
STEPS, NAN_STEP = 40, 25


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B in offline mode, writing under ``tmp_path/wandb``; every run finished and wandb torn down after."""
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                        "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true"}.items():
        monkeypatch.setenv(name, value)
    wandb.teardown()  # wandb reads its environment once per setup: this test's settings, not a former one's
    yield tmp_path
    if wandb.run is not None:
        wandb.run.finish()
    wandb.teardown()


class LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN for a negative input


def model_and_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(LogFeatures(), nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.rand(256, 4) + 0.5
    return model, x, torch.log(x) @ torch.randn(4, 1)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, nan_at: int | None = NAN_STEP,
          run: Any = None) -> None:
    """STEPS steps of SGD, a NaN planted in the batch of step ``nan_at``; ``run``: the user logs too."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        xb = x[torch.randint(0, len(x), (16,), generator=gen)].clone()
        if step == nan_at:
            xb[0, 0] = -1.0
        loss = nn.functional.mse_loss(model(xb), y[:16])
        optimizer.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        optimizer.step()
        if run is not None:
            run.log({"train/step": step, "train/loss": loss.item()})


def offline_runs(root: Path) -> list[OfflineRun]:
    """The offline runs under ``root``, once wandb's service has written all of them (it is torn down)."""
    wandb.teardown()
    return read_runs(root)


def values_steps(values: dict[tuple[int, str, str], float]) -> set[int]:
    return {step for step, _, _ in values}


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-9, abs=0)


def gradwatch_rows(found: OfflineRun) -> list[dict[str, Any]]:
    return [row for row in found.rows if "gradwatch/global/grad_norm" in row]


def layer_values(found: OfflineRun) -> dict[tuple[int, str, str], float]:
    """``{(step, layer, metric): value}`` of every per-layer key gradwatch wrote."""
    out = {}
    for row in found.rows:
        for key, value in row.items():
            parts = key.split("/", 2)
            if parts[0] == "gradwatch" and len(parts) == 3 and parts[1] not in ("global", "findings"):
                out[(row["gradwatch/step"], parts[2], parts[1])] = value
    return out


# ------------------------------------------------------------------------------------------ into a user's run
@pytest.mark.slow  # starts wandb's service (seconds on a loaded machine)
def test_a_users_run_gets_every_step_the_sampled_layers_the_findings_the_verdict_and_one_alert(
        offline: Path) -> None:
    model, x, y = model_and_data()
    run = wandb.init(project="gradwatch-tests")
    run.define_metric("train/*", step_metric="train/step")
    gw.watch(model, run=offline / "run", console=False, sinks=["wandb"])
    train(model, x, y, run=run)
    gw.watcher(model).close()
    assert wandb.run is run, "the user's run is left open for the user"
    run.log({"train/step": STEPS, "train/loss": 0.0})  # and still takes the user's rows
    run.finish()

    (found,) = offline_runs(offline)
    stored = gw.open_run(offline / "run")
    # gradwatch's steps merged into the user's rows (one per writer batch, the NaN step first), each with its
    # global series as the store has them, against gradwatch's own step axis
    rows = gradwatch_rows(found)
    steps = [row["gradwatch/step"] for row in rows]
    assert steps == sorted(set(steps)) and set(steps) <= set(range(STEPS)) and NAN_STEP in steps
    scalars = stored.scalars()
    for name in ("grad_norm", "loss", "lr"):
        for row in rows:
            assert same(row[f"gradwatch/global/{name}"], float(scalars.loc[row["gradwatch/step"], name])), name
    assert all(row["gradwatch/global/skipped"] == (row["gradwatch/step"] == NAN_STEP) for row in rows)
    assert math.isnan(rows[steps.index(NAN_STEP)]["gradwatch/global/grad_norm"])
    (axis,) = [m for m in found.metrics if m.glob_name == "gradwatch/*"]
    assert axis.step_metric == "gradwatch/step"
    # gradwatch never advanced W&B's own row counter: one row per log of the user's, each with the user's step
    assert [row["_step"] for row in found.rows] == list(range(STEPS + 1))
    assert [row["train/step"] for row in found.rows] == list(range(STEPS + 1))

    # per-layer statistics: on sampled steps (and the NaN step), each as the store has it
    info = stored.step_info()
    sampled = set(info.loc[info["sampled"], "step"])
    values = layer_values(found)
    assert NAN_STEP in values_steps(values) and values_steps(values) <= sampled | {NAN_STEP}
    metrics = stored.metrics()
    layers = {(int(r.step), r.layer, r.metric): float(r.value) for r in metrics.itertuples() if r.layer is not None}
    assert all(same(value, layers[key]) for key, value in values.items())  # a NaN gradient is a NaN there too
    assert {key for key, value in layers.items() if key[0] in values_steps(values) and not math.isnan(value)
            and not (key[2] == "grad_nonfinite" and value == 0)} <= set(values)
    assert {metric for _, _, metric in values} >= {"grad_norm", "grad_max", "param_norm", "update_ratio",
                                                   "act_norm", "act_zero_frac", "grad_nonfinite"}
    assert {layer for _, layer, _ in values} == set(stored.layers)

    # every finding as a row of the findings table
    findings = stored.findings()
    table = found.table("gradwatch/findings")
    assert [(r["kind"], r["severity"], r["layer"], r["step"], r["action"], r["message"]) for r in table] == [
        (f.kind, f.severity, f.layer, int(f.step), f.action, f.message) for f in findings.itertuples()]
    assert ("nonfinite", "error", NAN_STEP, "skip") in [(r["kind"], r["severity"], r["step"], r["action"])
                                                        for r in table]

    # the verdict in the summary, as gradwatch's own verdict file counts it
    own = verdict.read(offline / "run")
    assert own is not None
    assert {k: found.summary[f"gradwatch/{k}"] for k in ("verdict", "status", "steps", "worst", "counts", "run")} == {
        "verdict": "fail", "status": "finished", "steps": STEPS, "worst": "error", "counts": own["findings"],
        "run": str(offline / "run")}
    # one alert for the error, none for the rest
    assert [(a.title, a.level) for a in found.alerts] == [("gradwatch: nonfinite", "ERROR")]
    assert f"step {NAN_STEP}" in found.alerts[0].text and "Action: skip." in found.alerts[0].text
    assert found.exit_code == 0


# ----------------------------------------------------------------------- from a config file, a run of its own
@pytest.mark.slow  # starts wandb's service (seconds on a loaded machine)
def test_named_in_pyproject_it_starts_a_run_says_so_and_finishes_it(
        offline: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    (offline / "pyproject.toml").write_text(
        '[tool.gradwatch]\nconsole = false\n\n[tool.gradwatch.sinks.wandb]\nlayer_metrics = ["grad_norm"]\n'
        'init = { project = "from-pyproject", tags = ["nightly"] }\n', encoding="utf-8")
    monkeypatch.chdir(offline)
    model, x, y = model_and_data()
    assert wandb.run is None
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        gw.watch(model, run=offline / "healthy")
    (said,) = [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()]
    assert "no W&B run was active, so the wandb sink started one (healthy, offline, in " in said
    started = wandb.run
    assert started is not None and started.project == "from-pyproject" and started.tags == ("nightly",)
    train(model, x, y, nan_at=None)
    gw.watcher(model).close()
    assert wandb.run is None, "the run the sink started ends with the gradwatch run"

    (found,) = offline_runs(offline)
    assert [row["gradwatch/step"] for row in gradwatch_rows(found)] == list(range(STEPS))
    assert {metric for _, _, metric in layer_values(found)} == {"grad_norm"}  # layer_metrics
    assert found.summary["gradwatch/verdict"] == "pass" and found.summary["gradwatch/worst"] == "none"
    assert "gradwatch/findings" not in found.summary and found.alerts == []
    assert found.exit_code == 0


@pytest.mark.slow  # starts wandb's service (seconds on a loaded machine)
def test_a_run_of_its_own_has_every_step_as_w_and_bs_step_and_latest_values_that_say_the_latest_step(
        offline: Path) -> None:
    model, x, y = model_and_data()
    gw.watch(model, run=offline / "run", console=False, sinks={"wandb": {"init": {"project": "p"}}})
    train(model, x, y)
    gw.watcher(model).close()
    (found,) = offline_runs(offline)
    # W&B's own step is the training step: one row each, never one of gradwatch's own beside it
    assert [row["_step"] for row in found.rows] == [row["gradwatch/step"] for row in found.rows] == list(range(STEPS))
    assert found.series("gradwatch/global/skipped") == {s: float(s == NAN_STEP) for s in range(STEPS)}
    assert found.summary["gradwatch/global/skipped"] == 0  # the latest step was not skipped
    # a layer's NaN/Inf count: where not 0, then 0 on the next step written; its summary says none now
    counted = [found.series(key) for key in {k for row in found.rows for k in row if "/grad_nonfinite/" in k}]
    assert counted and all([s for s, v in sent.items() if v] == [NAN_STEP] and sent[max(sent)] == 0
                           and max(sent) > NAN_STEP for sent in counted)
    assert all(found.summary[key] == 0 for key in found.summary if "/grad_nonfinite/" in key)
    assert not any(key.startswith(("gradients/", "parameters/")) for row in found.rows for key in row)  # off


@pytest.mark.slow  # starts wandb's service (seconds on a loaded machine)
def test_rows_of_the_users_in_the_run_the_sink_started_are_all_kept_and_counted_alone(offline: Path) -> None:
    """Lightning's WandbLogger (or a wandb.log of the user's) logs into the run gradwatch started: it is then
    written as the user's run, and no row of the user's is dropped behind a step of gradwatch's."""
    model, x, y = model_and_data()
    gw.watch(model, run=offline / "run", console=False, sinks={"wandb": {"init": {"project": "p"}}})
    train(model, x, y, run=wandb.run)  # the user's rows, one per step, into the run the sink started
    gw.watcher(model).close()
    (found,) = offline_runs(offline)
    assert [row["train/step"] for row in found.rows if "train/step" in row] == list(range(STEPS))
    assert [row["_step"] for row in found.rows] == list(range(len(found.rows))) and len(found.rows) <= STEPS + 1
    steps = [row["gradwatch/step"] for row in gradwatch_rows(found)]
    assert steps == sorted(set(steps)) and NAN_STEP in steps


@pytest.mark.slow  # starts wandb's service (seconds on a loaded machine)
def test_wandb_histograms_on_sampled_steps_named_as_wandb_watch_names_them(offline: Path) -> None:
    model, x, y = model_and_data()
    gw.watch(model, run=offline / "run", console=False, tensorboard=False, wandb_histograms=True,
             sinks={"wandb": {"init": {"project": "p"}}})
    train(model, x, y, nan_at=None)
    gw.watcher(model).close()
    (found,) = offline_runs(offline)
    sampled = set(range(0, STEPS, 10))
    params = dict(model.named_parameters())
    for kind in ("gradients", "parameters"):
        for name, p in params.items():
            key = f"{kind}/{name}"  # a histogram, as wandb.watch logs one: {_type, bins, values}
            assert set(found.series(f"{key}/_type", step="_step").values()) == {"histogram"}, key
            values, bins = found.series(f"{key}/values", step="_step"), found.series(f"{key}/bins", step="_step")
            assert set(values) == set(bins) == sampled, key  # the sampled steps, at W&B's step = the training step
            for step in sampled:
                assert len(bins[step]) == len(values[step]) + 1 == 65 and bins[step] == sorted(bins[step])
                assert sum(values[step]) == p.numel()  # every element once
    # a histogram spans the values as they were: the first layer's weights at step 0 are the seeded init's
    torch.manual_seed(0)
    first = nn.Linear(4, 16).weight
    bins = found.series("parameters/1.weight/bins", step="_step")[0]
    assert (bins[0], bins[-1]) == pytest.approx((first.min().item(), first.max().item()), rel=1e-5)


@pytest.mark.slow  # starts wandb's service (seconds on a loaded machine)
def test_a_run_that_did_not_finish_fails_and_its_own_wandb_run_exits_nonzero(offline: Path) -> None:
    model, x, y = model_and_data()
    gw.watch(model, run=offline / "run", console=False, sinks={"wandb": {"init": {"project": "p"}}})
    train(model, x, y, nan_at=None)
    gw.watcher(model).close("crashed")
    (found,) = offline_runs(offline)
    assert (found.summary["gradwatch/verdict"], found.summary["gradwatch/status"]) == ("fail", "crashed")
    assert found.exit_code == 1


# ------------------------------------------------------------------------------ alerts, table, settings
def finding(kind: str, step: int, id: int, severity: str = "error", **data: Any) -> Finding:
    return Finding(kind, severity, step, "1", f"{kind} at {step}", value=1.0, action="skip", data=data, id=id)


@pytest.mark.slow  # starts wandb's service (seconds on a loaded machine)
def test_alerts_are_rate_limited_per_kind_and_count_what_they_held_back(
        offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(wandb_sink, "now", lambda: clock[0])
    run = wandb.init()
    sink = wandb_sink.Wandb(offline / "run", alert_every=600, table_every=60)
    sent = [(0, finding("nonfinite", 3, 1)), (10, finding("nonfinite", 4, 2)),   # held back: within 600 s
            (20, finding("exploding", 5, 3)), (30, finding("vanishing", 6, 4, "warning")),
            (40, dataclasses.replace(finding("nonfinite", 3, 1), data={"repeats": 3})),  # an update: no alert
            (700, finding("nonfinite", 9, 5)), (710, finding("nonfinite", 10, 6))]
    for at, f in sent:
        clock[0] = at
        sink.write_findings([f])
        run.log({"t": at})  # the user's row, into which a table logged at ``at`` went (commit=False)
    sink.close("finished")
    run.finish()

    (found,) = offline_runs(offline)
    assert [(a.title, a.text.split(": ", 1)[0]) for a in found.alerts] == [
        ("gradwatch: nonfinite", "run, step 3, layer 1"), ("gradwatch: exploding", "run, step 5, layer 1"),
        ("gradwatch: nonfinite", "run, step 9, layer 1")]
    assert found.alerts[2].text.endswith("(1 more nonfinite error(s) since the last alert.)")
    assert found.alerts[0].wait_duration == 600_000  # W&B's own throttle by title agrees
    # the table: logged at once (t=0), not again within table_every, then at t=700, and at the close for t=710's
    # (into the row W&B commits as the run finishes); never a row of its own
    versions = [row.get("t") for row in found.rows if "gradwatch/findings/path" in row]
    assert versions == [0, 700, None]
    assert [row["_step"] for row in found.rows] == list(range(len(sent) + 1))
    table = found.table("gradwatch/findings")
    assert [(r["kind"], r["step"], r["repeats"]) for r in table] == [
        ("nonfinite", 3, 3), ("nonfinite", 4, 1), ("exploding", 5, 1), ("vanishing", 6, 1), ("nonfinite", 9, 1),
        ("nonfinite", 10, 1)]
    assert found.summary["gradwatch/counts"] == {"info": 0, "warning": 1, "error": 7}


@pytest.mark.slow  # starts wandb's service (seconds on a loaded machine)
def test_two_models_in_one_wandb_run_by_prefix(offline: Path) -> None:
    run = wandb.init()
    models = []
    for prefix in ("encoder", "decoder"):
        model, x, y = model_and_data()
        gw.watch(model, run=offline / prefix, console=False, tensorboard=False,
                 sinks={"wandb": {"prefix": prefix, "alerts": False}})
        models.append((model, x, y))
    for model, x, y in models:
        train(model, x, y)
        gw.watcher(model).close()
    run.finish()
    (found,) = offline_runs(offline)
    for prefix in ("encoder", "decoder"):  # in the user's run: steps of each model merged into its rows
        steps = [r[f"{prefix}/step"] for r in found.rows if f"{prefix}/global/loss" in r]
        assert steps == sorted(set(steps)) and NAN_STEP in steps and set(steps) <= set(range(STEPS))
        assert found.summary[f"{prefix}/verdict"] == "fail"
        assert any(m.glob_name == f"{prefix}/*" and m.step_metric == f"{prefix}/step" for m in found.metrics)
    assert found.alerts == []
    assert not any(key.startswith("gradwatch/") for row in found.rows for key in row)


@pytest.mark.parametrize(("settings", "said"), [
    ({"alert_every": -1}, "its setting alert_every must be a number of seconds, 0 or more, got -1"),
    ({"table_every": "1m"}, "its setting table_every must be a number of seconds, 0 or more, got '1m'"),
    ({"layer_metrics": "grad_norm"}, "its setting layer_metrics must be a list of metric names"),
    ({"prefix": "*"}, "its setting prefix must be a non-empty key prefix without '*'"),
    ({"init": ["project"]}, "its setting init must be a table of wandb.init keyword arguments"),
    ({"projekt": "x"}, "TypeError: Wandb.__init__() got an unexpected keyword argument 'projekt'"),
])
def test_a_bad_setting_is_one_config_error_before_anything_starts(
        settings: dict[str, Any], said: str, offline: Path) -> None:
    with pytest.raises(gw.ConfigError) as raised:
        gw.watch(nn.Linear(2, 1), run=offline / "run", sinks={"wandb": settings})
    assert str(raised.value).startswith(f"sink plugin 'wandb' failed to start: {said}")
    assert wandb.run is None and not (offline / "run").exists() and not (offline / "wandb").exists()


def test_without_the_wandb_package_gw_watch_says_how_to_install_it(
        offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` finds when it is not installed
    with pytest.raises(gw.ConfigError) as raised:
        gw.watch(nn.Linear(2, 1), run=offline / "run", sinks=["wandb"])
    assert str(raised.value) == ("sink plugin 'wandb' failed to start: it needs the wandb package, which is not "
                                 "installed: pip install 'gradwatch[wandb]'")
    assert not (offline / "run").exists()


@pytest.mark.slow  # starts wandb's service (seconds on a loaded machine)
def test_a_wandb_run_finished_before_gradwatch_closes_is_told_once_and_training_goes_on(
        offline: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, x, y = model_and_data()
    run = wandb.init()
    gw.watch(model, run=offline / "run", console=False, sinks=["wandb"], flush_seconds=60)
    train(model, x, y)
    run.finish()  # before the watcher closed: its queued steps, findings and verdict have nowhere to go
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        gw.watcher(model).close()
    said = [r for r in caplog.records if r.name == "gradwatch"]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and not said[0].exc_info
    assert "was finished before the gradwatch run" in said[0].getMessage()
    assert "Close the watcher (gw.watcher(model).close()) before wandb.finish()" in said[0].getMessage()
    assert gw.open_run(offline / "run").steps == STEPS  # the run store has it all


# ------------------------------------------------------------------------------------------ the contract
class TestWandbSink(SinkContract):
    @pytest.fixture(autouse=True)
    def _offline(self, offline: Path) -> None:
        return None

    def make(self, run_dir: Path) -> Any:
        run_dir.mkdir(parents=True)
        return wandb_sink.Wandb(run_dir, init={"dir": str(run_dir)})

    def steps(self, run_dir: Path) -> list[int]:
        (found,) = offline_runs(run_dir)
        return [row["gradwatch/step"] for row in gradwatch_rows(found)]


# ------------------------------------------------------------------------------------------ the example
def _example(where: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # the example's own default: offline
    return subprocess.run([sys.executable, str(ROOT / "examples" / "wandb_example.py"), "--steps", "150"],
                          cwd=where, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def example(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Future[subprocess.CompletedProcess[str]], Path] | None]:
    """The example, started as the module begins (beside the test process) when this session runs its test:
    its process to come, and its folder."""
    if "test_the_wandb_example_runs_as_written" not in pool.tested(request):
        yield None
        return
    where = tmp_path_factory.mktemp("example")
    with ThreadPoolExecutor(1) as runner:
        future = runner.submit(_example, where)
        yield future, where
        future.cancel()  # a session stopped early (-x) runs no example it no longer tests


@pytest.fixture(scope="module", autouse=True)
def _example_begins(example: Any) -> None:
    """Start the example with the module's first test."""


@pytest.mark.slow  # runs the example in its own process
def test_the_wandb_example_runs_as_written(example: tuple[Future[subprocess.CompletedProcess[str]], Path] | None
                                           ) -> None:
    assert example is not None
    future, tmp_path = example
    done = future.result()
    assert done.returncode == 0, done.stderr
    assert "verdict: fail | status: finished" in done.stdout
    (found,) = offline_runs(tmp_path)
    steps = [r["gradwatch/step"] for r in gradwatch_rows(found)]  # merged into the user's rows, the NaN step first
    assert steps == sorted(set(steps)) and 100 in steps and set(steps) <= set(range(150))
    # the user's rows are W&B's steps 0..149; gradwatch's last step, merged after the user's last row, is the one
    # row W&B commits as the run finishes
    assert [r["train/step"] for r in found.rows if "train/step" in r] == list(range(150))
    assert [r["_step"] for r in found.rows] == list(range(len(found.rows))) and len(found.rows) <= 151
    assert [(r["kind"], r["step"], r["action"]) for r in found.table("gradwatch/findings")][0] == (
        "nonfinite", 100, "skip")
    assert [a.title for a in found.alerts] == ["gradwatch: nonfinite"]
    assert gw.open_run(tmp_path / "runs" / "wandb").steps == 150
    assert found.summary["gradwatch/verdict"] == "fail"


# ------------------------------------------------------------------------------------------ the benchmark
@pytest.mark.slow  # trains every variant of the benchmark
def test_the_cost_benchmark_measures_every_variant(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A smoke run of benchmarks/wandb_cost.py (its figures are docs/integrations.md's, not asserted here)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gradwatch_wandb_cost", ROOT / "benchmarks" / "wandb_cost.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    out = bench.main(["--workloads", "mlp", "--rounds", "1", "--steps", "3", "--json", str(offline / "cost.json")])
    (report,) = out["reports"]
    assert set(report["variants"]) == set(bench.VARIANTS)
    assert all(row["steps"] == 3 and row["ms_per_step"] > 0 for row in report["variants"].values())
    assert "ratio_cpu_vs_wandb_watch" in report and (offline / "cost.json").is_file()
    assert "floor_ratio_cpu_vs_wandb_watch" in report  # the floor (minimal) against wandb.watch, too
