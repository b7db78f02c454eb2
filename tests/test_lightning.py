"""gradwatch.integrations.lightning: a real lightning.pytorch Trainer on CPU, a few steps each."""

from __future__ import annotations

import copy
import csv
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch as gw
from tests.test_check import gradwatch

pytestmark = pytest.mark.slow  # real Lightning Trainer runs

pl = pytest.importorskip("lightning.pytorch")
from gradwatch.integrations.lightning import GradWatchCallback  # noqa: E402

BATCH = 4


class Log(nn.Module):
    """log of the input features: a batch with a negative value gives NaN here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Net(pl.LightningModule):
    def __init__(self, lr: float = 0.05, fail_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(Log(), nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lr = lr
        self.fail_at = fail_at
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at:
            raise RuntimeError("the data pipeline broke")
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def loader(n_batches: int = 16, nan_batch: int | None = None) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n_batches * BATCH, 4, generator=g) + 0.5
    y = torch.randn(n_batches * BATCH, 1, generator=g)
    if nan_batch is not None:
        x[nan_batch * BATCH, 0] = -1.0  # log(-1) = NaN, born in net.0
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def trainer(callbacks: list[Any], max_steps: int = 10, **kwargs: Any) -> Any:
    kwargs.setdefault("logger", False)
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kwargs)


class Spy(pl.Callback):
    """Independent reference numbers, taken by a second callback at the same moment as gradwatch."""

    def __init__(self, watch_step: int | None = None) -> None:
        self.norms: list[float] = []
        self.watch_step = watch_step
        self.before: dict[str, torch.Tensor] | None = None
        self.after: dict[str, torch.Tensor] | None = None
        self.weights: list[torch.Tensor] = []  # net.1.weight after each batch

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.watch_step:
            self.before = copy.deepcopy(pl_module.state_dict())

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.weights.append(pl_module.net[1].weight.detach().clone())
        if batch_idx == self.watch_step:
            self.after = copy.deepcopy(pl_module.state_dict())


def same(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> bool:
    assert a is not None and b is not None
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_healthy_run_records_every_step_and_feeds_the_logger(tmp_path: Path) -> None:
    spy = Spy()  # listed first: it sees the gradients before gradwatch acts on them
    callback = GradWatchCallback(run=tmp_path / "run", console=False)
    logger = pl.loggers.CSVLogger(tmp_path / "logs", name="", version="")
    module = Net()
    fit = trainer([spy, callback], max_steps=12, logger=logger, log_every_n_steps=1)
    fit.fit(module, loader())
    run = gw.open_run(tmp_path / "run")
    assert run.status == "finished" and run.steps == fit.global_step == 12
    assert run.findings().empty, "no warning or error on healthy training"
    assert run.layers == ["net.0", "net.1", "net.2", "net.3"]
    _, norms = run.series("grad_norm")
    assert norms == pytest.approx(spy.norms, rel=1e-5)
    _, losses = run.series("loss")
    assert losses == pytest.approx(module.losses, rel=1e-6)
    assert run.series("lr")[1] == pytest.approx([0.05] * 12)
    assert not run.metrics("act_norm").empty, "the module's forward is hooked: activation statistics too"
    with open(tmp_path / "logs" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("gradwatch/grad_norm")]
    assert [float(r["gradwatch/grad_norm"]) for r in rows] == pytest.approx(spy.norms, rel=1e-5)
    assert {r["gradwatch/errors"] for r in rows} == {"0.0"}


def test_a_nan_batch_is_found_at_its_step_and_layer_and_skipped(tmp_path: Path) -> None:
    spy = Spy(watch_step=5)
    callback = GradWatchCallback(run=tmp_path / "run", console=False)  # default rules: nonfinite -> skip
    module = Net()
    fit = trainer([spy, callback], max_steps=10)
    fit.fit(module, loader(nan_batch=5))
    assert same(spy.before, spy.after), "the NaN step changed nothing"
    assert all(torch.isfinite(p).all() for p in module.parameters())
    run = gw.open_run(tmp_path / "run")
    assert run.status == "finished" and run.steps == fit.global_step == 10
    found = run.findings()
    assert list(found.kind) == ["nonfinite"] and list(found.step) == [5]
    assert list(found.layer) == ["net.0"] and list(found.phase) == ["forward"] and list(found.action) == ["skip"]
    assert run.skipped_steps().tolist() == [5]
    assert fit.callback_metrics["gradwatch/errors"] == 1


def test_a_halt_stops_the_trainer_without_an_exception(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spy = Spy(watch_step=3)
    callback = GradWatchCallback(run=tmp_path / "run", rules=[gw.Rule(when="nonfinite", do="halt")], console=False)
    fit = trainer([spy, callback], max_steps=10)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        fit.fit(Net(), loader(nan_batch=3))  # returns normally
    assert fit.should_stop and fit.global_step == 4, "stopped after the halted step"
    assert same(spy.before, spy.after), "the halted step applied nothing"
    assert "gradwatch halted training at step 3" in caplog.text
    run = gw.open_run(tmp_path / "run")
    assert run.status == "halted" and run.steps == 4
    assert run.verdict is not None and run.verdict["halted"]["step"] == 3
    assert list(run.findings().action) == ["halt"]
    assert callback.watcher is not None and callback.watcher.closed


def test_a_rollback_restores_the_snapshot_and_leaves_out_the_next_batches(tmp_path: Path) -> None:
    class Scheduled(Net):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
            scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    spy = Spy(watch_step=4)  # snapshots are taken before the update of steps 0, 2, 4
    rules = [gw.Rule(when="nonfinite", do="rollback", skip_batches=1)]
    callback = GradWatchCallback(run=tmp_path / "run", rules=rules, snapshot_every=2, console=False)
    fit = trainer([spy, callback], max_steps=10)
    fit.fit(Scheduled(), loader(nan_batch=6))
    assert spy.before is not None
    assert torch.equal(spy.weights[6], spy.before["net.1.weight"]), "rolled back to the snapshot before step 4"
    assert torch.equal(spy.weights[7], spy.weights[6]), "the batch after it is left out"
    assert not torch.equal(spy.weights[8], spy.weights[7])
    run = gw.open_run(tmp_path / "run")
    assert run.status == "finished" and run.steps == fit.global_step == 10
    found = run.findings()
    assert list(found.kind) == ["nonfinite"] and list(found.action) == ["rollback"] and list(found.step) == [6]
    assert run.skipped_steps().tolist() == [6, 7]
    steps, lrs = run.series("lr")
    assert steps.tolist() == list(range(10))
    assert lrs[:7] == pytest.approx([0.05 * 0.9**s for s in range(7)])
    assert lrs[7] == pytest.approx(lrs[5]), "the LR scheduler was restored to step 4, then stepped once"


def test_an_exception_closes_the_run_as_crashed(tmp_path: Path) -> None:
    callback = GradWatchCallback(run=tmp_path / "run", console=False)
    with pytest.raises(RuntimeError, match="data pipeline"):
        trainer([callback]).fit(Net(fail_at=4), loader())
    run = gw.open_run(tmp_path / "run")
    assert run.status == "crashed" and run.steps == 4
    assert run.ended == {"status": "crashed", "exception": "RuntimeError: the data pipeline broke"}, \
        "the exception is told, as a plain loop's crash tells it"


def test_gradient_accumulation_counts_optimizer_steps_and_the_unnormalised_loss(tmp_path: Path) -> None:
    callback = GradWatchCallback(run=tmp_path / "run", console=False)
    module = Net()
    fit = trainer([callback], max_steps=4, accumulate_grad_batches=2)
    fit.fit(module, loader())
    run = gw.open_run(tmp_path / "run")
    assert run.steps == fit.global_step == 4
    pairs = torch.tensor(module.losses).reshape(4, 2).mean(dim=1)
    assert run.series("loss")[1] == pytest.approx(pairs.tolist(), rel=1e-6), "the mean micro-batch loss"


def test_bf16_autocast_trains_cleanly(tmp_path: Path) -> None:
    callback = GradWatchCallback(run=tmp_path / "run", console=False)
    fit = trainer([callback], max_steps=6, precision="bf16-mixed")
    fit.fit(Net(), loader())
    run = gw.open_run(tmp_path / "run")
    assert run.steps == fit.global_step == 6 and run.findings().empty


def test_a_grad_scaler_overflow_is_a_skipped_step_not_a_nan_error(tmp_path: Path) -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    callback = GradWatchCallback(run=tmp_path / "run", console=False)
    module = Net()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # overflows until it has backed off to 2**16
    fit = trainer([callback], max_steps=10, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    fit.fit(module, loader())
    run = gw.open_run(tmp_path / "run")
    assert run.steps == fit.global_step == 10
    skipped = run.skipped_steps().tolist()
    assert skipped and skipped == list(range(len(skipped))) and len(skipped) < 10
    found = run.findings()
    assert list(found.kind) == ["amp_overflow"] and list(found.severity) == ["info"], "not a nonfinite error"
    assert run.series("loss")[1] == pytest.approx(module.losses, rel=1e-6), "the loss before the scaler scaled it"


def test_the_standalone_pytorch_lightning_package_works_too(tmp_path: Path) -> None:
    ptl = pytest.importorskip("pytorch_lightning")

    class Small(ptl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = GradWatchCallback(run=tmp_path / "run", console=False)
    fit = ptl.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    fit.fit(Small(), loader())
    run = gw.open_run(tmp_path / "run")
    assert run.status == "finished" and run.steps == fit.global_step == 5 and run.findings().empty


def test_bad_settings_fail_when_the_callback_is_built(tmp_path: Path) -> None:
    with pytest.raises(gw.ConfigError, match="log_every"):
        GradWatchCallback(run=tmp_path / "run", log_every=0)
    with pytest.raises(gw.ConfigError):
        GradWatchCallback(rules=[{"when": "exploding", "do": "explode"}])
    with pytest.raises(gw.ConfigError, match="no_such_option"):
        GradWatchCallback(no_such_option=True)
    assert not (tmp_path / "run").exists()


def test_the_logger_counts_findings_as_check_does_with_repeats_apart(tmp_path: Path) -> None:
    """Issue 35, item 4: five NaN batches in a row are one stored ``nonfinite`` error repeated five times;
    ``gradwatch/errors`` said 5 (every occurrence) where ``check`` reports 1."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(30 * BATCH, 4, generator=g) + 0.5, torch.randn(30 * BATCH, 1, generator=g)
    for batch in (3, 4, 5, 6, 7):
        x[batch * BATCH, 0] = -1.0  # log(-1) = NaN in net.0: skipped by the default rules, each step
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    logger = pl.loggers.CSVLogger(tmp_path / "logs", name="", version="")
    trainer([GradWatchCallback(run=tmp_path / "run", console=False)], max_steps=20, logger=logger,
            log_every_n_steps=1).fit(Net(), data)
    checked = json.loads(gradwatch("check", str(tmp_path / "run"), "--format", "json").stdout)
    nonfinite = [f for f in checked["findings"] if f["kind"] == "nonfinite"]
    assert [(f["step"], f["severity"], f["repeats"]) for f in nonfinite] == [(3, "error", 5)]
    with open(tmp_path / "logs" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("gradwatch/errors")]
    assert len(rows) == 20
    by_step = {int(r["step"]): r for r in rows}
    assert by_step[3]["gradwatch/errors"] == by_step[7]["gradwatch/errors"] == "1.0"
    assert [by_step[s]["gradwatch/repeats"] for s in range(2, 9)] == ["0.0", "0.0", "1.0", "2.0", "3.0", "4.0", "4.0"]
    last = rows[-1]  # at the end, what check counts
    for severity, series in (("error", "errors"), ("warning", "warnings")):
        assert float(last[f"gradwatch/{series}"]) == sum(f["severity"] == severity for f in checked["findings"])
    assert float(last["gradwatch/repeats"]) == sum(f["repeats"] - 1 for f in checked["findings"]
                                                  if f["severity"] != "info")


def test_per_layer_norms_go_to_the_logger_on_the_sampled_steps(tmp_path: Path) -> None:
    """Issue 35, item 8: ``gradwatch/grad_norm/<layer>`` on each sampled step, at that step, whatever the
    Trainer's ``log_every_n_steps`` (a value logged on some steps only would be repeated on its flush steps)."""
    def fit(name: str, every: int = 50, **kwargs: Any) -> tuple[list[dict[str, str]], Any]:
        logger = pl.loggers.CSVLogger(tmp_path / name, name="", version="")
        trainer([GradWatchCallback(run=tmp_path / name / "run", console=False, **kwargs)], max_steps=25,
                logger=logger, log_every_n_steps=every).fit(Net(), loader(32))  # 50: Lightning's default
        logged = tmp_path / name / "metrics.csv"  # none while nothing was logged
        rows = list(csv.DictReader(logged.open())) if logged.exists() else []
        return rows, gw.open_run(tmp_path / name / "run")

    rows, run = fit("default")
    layered = [r for r in rows if any(k.startswith("gradwatch/grad_norm/") and v for k, v in r.items())]
    assert [int(r["step"]) for r in layered] == [0, 10, 20], "the sampled steps, each at its own step"
    stored = run.metrics("grad_norm").query("layer == layer")  # per layer (the global norm has no layer)
    for r in layered:
        at = stored[stored.step == int(r["step"])]
        expected = {f"gradwatch/grad_norm/{row.layer}": row.value for row in at.itertuples()}
        assert set(expected) == {"gradwatch/grad_norm/net.1", "gradwatch/grad_norm/net.3"}  # the layers with weights
        assert {k: float(r[k]) for k in expected} == pytest.approx(expected, rel=1e-6)
    assert not any(k.startswith("gradwatch/param_norm/") for k in rows[0]), "grad_norm only, by default"

    rows, run = fit("chosen", layer_metrics=["grad_norm", "param_norm"], sample_every=5)
    param = [r for r in rows if r.get("gradwatch/param_norm/net.1")]
    assert [int(r["step"]) for r in param] == [0, 5, 10, 15, 20]
    stored = run.metrics("param_norm").query("layer == 'net.1'").set_index("step").value
    assert [float(r["gradwatch/param_norm/net.1"]) for r in param] == pytest.approx(stored.tolist(), rel=1e-6)

    rows, _ = fit("off", every=1, layer_metrics=None)
    assert len(rows) == 25 and not any(k.startswith("gradwatch/grad_norm/") for r in rows for k in r)
    with pytest.raises(gw.ConfigError, match="update_ratio"):
        GradWatchCallback(run=tmp_path / "bad", layer_metrics=["update_ratio"])
