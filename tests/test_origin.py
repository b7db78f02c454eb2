"""Non-finite origin: the module where a NaN/Inf was born, found by replaying the step."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import gradwatch as gw


class LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Normalize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)


class Radius(nn.Module):
    """Forward finite at 0 (sqrt(0) = 0), backward infinite: d sqrt(s)/ds at s = 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.pow(2).sum(-1, keepdim=True).sqrt()], dim=-1)


def train(model: nn.Module, run_dir: Path, bad_step: int, plant: object, steps: int = 8, **kw: object) -> gw.Run:
    gw.watch(model, run=run_dir, console=False, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.rand(16, 4, generator=gen) + 0.5
        y = torch.randn(16, 1, generator=gen)
        opt.zero_grad()
        if step == bad_step:
            plant(model, x)  # type: ignore[operator]
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)
    return gw.open_run(run_dir)


class Feature(nn.Module):
    """Linear -> ReLU(inplace) -> feature -> Dropout -> BatchNorm -> Linear, with positive first-layer
    weights so that a negative input row gives an all-zero ReLU row (the planted zero)."""

    def __init__(self, feature: nn.Module, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 3)
        self.act = nn.ReLU(inplace=True)
        self.feat = feature
        self.drop = nn.Dropout(0.1)
        self.bn = nn.BatchNorm1d(width)
        self.out = nn.Linear(width, 1)
        with torch.no_grad():
            self.inp.weight.abs_()
            self.inp.bias.fill_(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.drop(self.feat(self.act(self.inp(x))))))


def zero_row(model: nn.Module, x: torch.Tensor) -> None:
    x[2] = -1.0


def test_forward_origin_log_of_zero(run_dir: Path) -> None:
    torch.manual_seed(0)
    found = train(Feature(LogFeatures(), 3), run_dir, 5, zero_row).findings()
    row = found.iloc[0]
    assert (row.kind, row.step, row.layer, row.phase, row.severity, row.action) == (
        "nonfinite", 5, "feat", "forward", "error", "skip")
    assert row.data["origin"] == "replayed" and row.data["type"] == "LogFeatures"
    assert "forward pass of feat (LogFeatures)" in row.message
    assert (found.kind == "nonfinite").sum() == 1  # later findings (the loss diverging after it) are other kinds


def test_forward_origin_division_by_zero_norm(run_dir: Path) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.act = nn.ReLU()
            self.norm = Normalize()
            self.out = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.norm(self.act(self.inp(x))))

    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():
        model.inp.weight.abs_()
        model.inp.bias.zero_()

    def plant(m: nn.Module, x: torch.Tensor) -> None:
        x[2] = -1.0  # ReLU gives an all-zero row: 0 / 0

    row = train(model, run_dir, 4, plant).findings().iloc[0]
    assert (row.kind, row.step, row.layer, row.phase) == ("nonfinite", 4, "norm", "forward")


def test_backward_origin_sqrt_at_zero(run_dir: Path) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 3, bias=False)
            self.radius = Radius()
            self.out = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.radius(self.inp(x)))

    torch.manual_seed(0)

    def plant(m: nn.Module, x: torch.Tensor) -> None:
        x[1] = 0.0  # a zero row: sqrt(0) = 0 forward, 0 * inf = NaN backward

    run = train(Model(), run_dir, 6, plant)
    row = run.findings().iloc[0]
    assert (row.kind, row.step, row.layer, row.phase) == ("nonfinite", 6, "radius", "backward")
    assert "backward pass of radius (Radius)" in row.message
    assert row.data["loss"] is not None and row.data["nonfinite_grads"] > 0


def test_poisoned_batch_is_the_origin(run_dir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def plant(m: nn.Module, x: torch.Tensor) -> None:
        x[0, 1] = float("nan")

    row = train(model, run_dir, 3, plant).findings().iloc[0]
    assert (row.kind, row.step, row.layer, row.phase) == ("nonfinite", 3, None, "forward")
    assert "input batch" in row.message


def test_replay_restores_batchnorm_statistics_and_rng(run_dir: Path) -> None:
    """Replaying a step must not change training: BN running stats and the RNG stream are kept."""

    def run(watch: bool, path: Path) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 1))
        if watch:
            gw.watch(model, run=path, rules=None, console=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(5):
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            if step == 2:
                model[3].weight.grad[0, 0] = float("nan")  # forces a replay of this step
            if watch:
                gw.watcher(model).observe(loss=loss)
            opt.step()
            torch.rand(1)  # the loop's own use of the RNG after the step
        if watch:
            gw.unwatch(model)
        return {**{k: v.clone() for k, v in model.state_dict().items()}, "rng": torch.get_rng_state()}

    bare, watched = run(False, run_dir), run(True, run_dir)
    for key in bare:
        assert torch.equal(bare[key], watched[key]) or (bare[key].isnan() == watched[key].isnan()).all(), key
    assert torch.equal(bare["rng"], watched["rng"])


def test_origin_off_falls_back_to_attribution(run_dir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def plant(m: nn.Module, x: torch.Tensor) -> None:
        x[0, 1] = float("nan")

    row = train(model, run_dir, 3, plant, origin=False).findings().iloc[0]
    assert row.kind == "nonfinite" and row.data["origin"] == "attributed"
    assert "approximately" in row.message
