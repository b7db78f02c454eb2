"""Statistics of float64, complex and mixed models, at the edges of float32, of structured outputs, and one
statistic that fails on one layer: watched end to end, read as the user reads them (issue 34).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.step import stats


class Exp(nn.Module):
    """A naive softmax's numerator: its output reaches ~1e26 (finite)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.exp()


class Spectral(nn.Module):
    """An FNO-style layer: complex weights applied to the first Fourier modes through torch.fft."""

    def __init__(self, channels: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.randn(channels, channels, modes, dtype=torch.cfloat) / channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.fft.rfft(x)
        out = torch.zeros_like(f)
        out[..., :self.modes] = torch.einsum("bim,iom->bom", f[..., :self.modes], self.weight)
        return torch.fft.irfft(out, n=x.shape[-1])


@dataclass
class Pair:
    value: torch.Tensor
    gate: torch.Tensor


class Structured(nn.Module):
    """A leaf whose output is a dataclass of tensors."""

    def forward(self, x: torch.Tensor) -> Pair:
        return Pair(torch.tanh(x), torch.sigmoid(x))


class PairHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.split, self.out = Structured(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pair = self.split(x)
        return self.out(pair.value * pair.gate)


def _train(model: nn.Module, run: Path, steps: int = 25, *, scale: float = 1.0, dtype: torch.dtype = torch.float32,
           cast: bool = False, loss_of=None) -> tuple[list[float], gw.Run]:
    gw.watch(model, run=run, overwrite=True)
    if cast:
        model.double()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 / scale)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 4, dtype=dtype)
        out = model(x)
        loss = loss_of(out, x) if loss_of is not None else (out - x.sum(1, keepdim=True)).pow(2).mean() * scale
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=float(loss))
        opt.step()
        losses.append(float(loss))
    gw.watcher(model).close()
    return losses, gw.open_run(run)


def _quiet(run: gw.Run) -> None:
    findings = run.findings()
    assert run.status == "finished"
    assert not len(findings) or set(findings["severity"]) <= {"info"}, findings[["kind", "step", "message"]]


def _metric(run: gw.Run, metric: str, layer: str) -> np.ndarray:
    m = run.metrics()
    return m[(m["metric"] == metric) & (m["layer"] == layer)]["value"].to_numpy()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_float64_model_is_watched_whether_cast_before_or_after_watch(tmp_path: Path, when: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    if when == "before":
        model.double()
    _, run = _train(model, tmp_path / "run", dtype=torch.float64, cast=when == "after")
    _quiet(run)
    assert run.steps == 25
    assert np.isfinite(_metric(run, "act_norm", "1")).all() and len(_metric(run, "act_norm", "1")) >= 2
    assert (_metric(run, "grad_norm", "2") > 0).all()


def test_a_float64_head_on_a_float32_body_is_watched(tmp_path: Path) -> None:
    torch.manual_seed(0)
    body, head = nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Linear(8, 1).double()
    model = nn.Sequential(body, head)
    model.forward = lambda x: head(body(x).double())  # type: ignore[method-assign]
    _, run = _train(model, tmp_path / "run")
    _quiet(run)
    assert run.steps == 25
    assert (_metric(run, "grad_norm", "1") > 0).all() and (_metric(run, "grad_norm", "0.0") > 0).all()


def test_complex_parameters_and_activations_are_measured_as_magnitudes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    spectral = Spectral(1, 5)

    class FNO(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lift, self.spectral, self.proj = nn.Linear(4, 16), spectral, nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(self.spectral(self.lift(x).unsqueeze(1)).squeeze(1))

    model = FNO()
    _, run = _train(model, tmp_path / "run")
    _quiet(run)
    assert run.steps == 25
    assert (_metric(run, "grad_norm", "spectral") > 0).all() and (_metric(run, "param_norm", "spectral") > 0).all()
    ratio = _metric(run, "update_ratio", "spectral")
    assert len(ratio) and np.isfinite(ratio).all() and (ratio > 0).all()


def test_a_complex_linear_layer_is_watched(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, dtype=torch.cfloat), nn.Linear(8, 1, dtype=torch.cfloat))
    _, run = _train(model, tmp_path / "run", dtype=torch.cfloat, loss_of=lambda out, x: (out.abs() - 1).pow(2).mean())
    _quiet(run)
    assert (_metric(run, "act_norm", "0") > 0).all() and (_metric(run, "grad_max", "1") > 0).all()


def test_gradients_near_1e_30_are_not_recorded_as_zero(tmp_path: Path) -> None:
    torch.manual_seed(0)
    _, run = _train(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), tmp_path / "run", scale=1e-30)
    norms = _metric(run, "grad_norm", "0")
    assert len(norms) == 25 and (norms > 1e-32).all() and (norms < 1e-27).all()
    findings = run.findings()
    assert not any("exactly zero" in m for m in findings["message"]) if len(findings) else True


def test_gradients_near_1e30_are_finite_and_raise_no_explosion(tmp_path: Path) -> None:
    torch.manual_seed(0)
    _, run = _train(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), tmp_path / "run", scale=1e30)
    _quiet(run)
    m = run.metrics()
    total = m[(m["metric"] == "grad_norm") & m["layer"].isna()]["value"].to_numpy()
    assert np.isfinite(total).all() and (total > 1e29).all()


@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, 1e19), (torch.bfloat16, 1e36)])
def test_huge_weights_have_a_finite_norm_and_a_non_zero_update_ratio(tmp_path: Path, dtype: torch.dtype,
                                                                      scale: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False)).to(dtype)
    with torch.no_grad():
        model[0].weight.mul_(scale)
    gw.watch(model, run=tmp_path / "run", overwrite=True, sample_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(3):
        loss = model(torch.randn(8, 64, dtype=dtype)).float().div(scale).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        model[0].weight.grad.copy_(model[0].weight.detach())  # weight decay alone: each step shrinks them by 1%
        opt.step()
    gw.watcher(model).close()
    run = gw.open_run(tmp_path / "run")
    weights, ratio = _metric(run, "param_norm", "0"), _metric(run, "update_ratio", "0")
    assert np.isfinite(weights).all() and (weights > scale).all()
    assert len(ratio) == 3 and np.isfinite(ratio).all() and ratio == pytest.approx(1e-2, rel=0.1)


def test_a_naive_softmax_whose_exp_is_finite_is_neither_nonfinite_nor_skipped(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Exp())
    with torch.no_grad():
        model[0].bias.fill_(60.0)  # exp reaches ~1e26, finite
    target = torch.softmax(torch.randn(8), 0)
    losses, run = _train(model, tmp_path / "run", steps=21,
                         loss_of=lambda out, x: (out / out.sum(-1, keepdim=True) - target).pow(2).sum(-1).mean())
    assert run.status == "finished"
    findings = run.findings()
    assert not len(findings) or not set(findings["kind"]) & {"nonfinite", "exploding"}
    assert run.steps == 21 and (not len(findings) or not findings["action"].isin(["skip"]).any())
    act = _metric(run, "act_norm", "1")
    assert len(act) >= 2 and np.isfinite(act).all() and (act > 1e25).all()  # left out at step 0, scaled after


def test_a_leaf_that_returns_a_dataclass_is_measured(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), PairHead())
    _, run = _train(model, tmp_path / "run")
    _quiet(run)
    act = _metric(run, "act_norm", "1.split")
    assert len(act) >= 2 and np.isfinite(act).all() and (act > 0).all()


def test_one_statistic_that_fails_on_one_layer_is_left_out_and_said_once(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 1))

    def loop(model: nn.Module) -> list[float]:
        torch.manual_seed(1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        out = []
        for _ in range(25):
            x = torch.randn(16, 4)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(float(loss))
        return out

    bare = loop(build())
    real = stats.activation_stats

    def failing(out: torch.Tensor, bounds, scaled=False):  # type: ignore[no-untyped-def]
        if out.shape[-1] == 5:  # the third Linear's outputs (and the ReLU after it)
            raise RuntimeError("no kernel for this layout")
        return real(out, bounds, scaled)

    monkeypatch.setattr("gradwatch.step.activations.activation_stats", failing)
    monkeypatch.setattr("gradwatch.step.activations.BATCHED", 0)  # every call reduced on its own
    model = build()
    gw.watch(model, run=tmp_path / "run", overwrite=True)
    watched = loop(model)
    gw.watcher(model).close()
    assert watched == bare  # training bit-identical
    run = gw.open_run(tmp_path / "run")
    assert run.status == "finished" and run.steps == 25
    findings = run.findings()
    said = findings[findings["kind"] == "unmeasured"]
    assert set(said["layer"]) == {"2", "3"} and set(said["severity"]) == {"info"} and (said["step"] == 0).all()
    assert all("no kernel for this layout" in m for m in said["message"])
    assert not len(_metric(run, "act_norm", "2")) and len(_metric(run, "act_norm", "0")) >= 2
    assert (_metric(run, "grad_norm", "2") > 0).all() and len(_metric(run, "grad_norm", "2")) == 25
