"""Reparametrised weights (``torch.nn.utils.parametrize``): weight_norm, spectral_norm, a custom
parametrization and a ``torch.ao.pruning`` sparsifier's mask.

A parametrized ``Linear`` is one layer: it owns its originals, it is a leaf whose output is an activation,
and a NaN/Inf born while computing its weight is its own. The modules computing the weight (their outputs
are weights, not units) are no layers: a 99%-sparse mask is not "dead units".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.pruning import WeightNormSparsifier
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import gradwatch as gw
from gradwatch.doctor import diagnose
from gradwatch.step.layout import discover


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


class UnitRows(nn.Module):
    """Rows of unit norm: a row of zeros is 0/0 = NaN in the forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=1, keepdim=True)


class SignedRoot(nn.Module):
    """x * sqrt|x|: finite forward; its gradient at an exact 0 is 0 * inf = NaN in the backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.abs().sqrt()


class Net(nn.Module):
    """Every kind of parametrization, one per layer; ``sparse`` is pruned to 99.5% by a sparsifier."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = weight_norm(nn.Linear(16, 64))
        self.sym = nn.Linear(64, 64)
        parametrize.register_parametrization(self.sym, "weight", Symmetric())
        self.sparse = nn.Linear(64, 256)
        self.sn = spectral_norm(nn.Linear(256, 32))
        self.out = nn.Linear(32, 4)
        sparsifier = WeightNormSparsifier(sparsity_level=0.995, sparse_block_shape=(1, 4), zeros_per_block=4)
        sparsifier.prepare(self, config=[{"tensor_fqn": "sparse.weight"}])
        sparsifier.step()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        x = F.gelu(self.sym(x)) / 8
        x = F.relu(self.sparse(x))
        return self.out(F.gelu(self.sn(x)))


PARAMETRIZED = ["inp", "sym", "sparse", "sn"]


def test_a_parametrized_module_is_one_leaf_layer_that_owns_its_originals() -> None:
    model = Net()
    layout = discover(model, version=1).layout
    assert layout.layers == ("inp", "sym", "sparse", "sn", "out")
    assert layout.layer_types[:4] == ("ParametrizedLinear",) * 4
    assert [layout.layers[i] for i in layout.leaves] == list(layout.layers)
    assert layout.params == tuple(n for n, _ in model.named_parameters())  # the names torch gives them
    owned = {layout.params[p]: layout.layers[i] for i, p in layout.owners}
    assert owned["inp.parametrizations.weight.original0"] == owned["inp.parametrizations.weight.original1"] == "inp"
    assert owned["sparse.parametrizations.weight.original"] == owned["sparse.bias"] == "sparse"
    assert layout.layer_numel[2] == 64 * 256 + 256


def test_a_model_without_parametrizations_keeps_its_layout() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 2)))
    layout = discover(model, version=1).layout
    assert layout.layers == ("0", "1.0", "1.1")
    assert layout.leaves == (0, 1, 2)
    assert layout.owners == ((0, 0), (0, 1), (2, 2), (2, 3))


def _train(model: nn.Module, run_dir: Path, steps: int, plant: object = None, at: int = -1) -> gw.Run:
    gw.watch(model, run=run_dir, console=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    x_all = torch.randn(1024, model.width, generator=gen)  # type: ignore[arg-type]
    y_all = (x_all[:, 0] > 0).long() + (x_all[:, 1] > 0).long()
    for step in range(steps):
        i = torch.randint(0, 1024, (32,), generator=gen)
        if step == at:
            plant(model)  # type: ignore[operator]
        loss = F.cross_entropy(model(x_all[i]), y_all[i])
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)
    return gw.open_run(run_dir)


def test_healthy_training_of_parametrized_layers_is_quiet_and_measures_their_outputs(run_dir: Path) -> None:
    model = Net()
    model.width = 16  # type: ignore[assignment]
    run = _train(model, run_dir, steps=30)
    assert run.findings().empty, run.findings()[["kind", "layer", "message"]].to_string()  # the mask: "dead units"
    assert float((model.sparse.weight == 0).float().mean()) > 0.99
    losses = [r.scalars["loss"] for r in run.records()]
    assert np.mean(losses[-5:]) < np.mean(losses[:5])  # it trains
    sampled = [r for r in run.records() if r.sampled]
    assert len(sampled) >= 3
    for record in sampled:
        acts = record.vector("act_norm")
        zeros = record.vector("act_zero_frac")
        assert acts is not None and zeros is not None
        for name in PARAMETRIZED:  # the parametrized layers' real outputs, never measured before
            i = record.layout.layers.index(name)
            assert np.isfinite(acts[i]) and acts[i] > 0, (name, acts[i])
            assert zeros[i] < 0.5, (name, zeros[i])


class Mid(nn.Module):
    """Linear -> GELU -> Linear (parametrized by ``mid``) -> GELU -> Linear."""

    width = 20

    def __init__(self, mid: nn.Module | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(20, 32)
        self.mid = nn.Linear(32, 32)
        if mid is not None:
            parametrize.register_parametrization(self.mid, "weight", mid)
        self.out = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.mid(F.gelu(self.inp(x)))))


def _nonfinite(run: gw.Run) -> object:
    found = run.findings()
    found = found[found.kind == "nonfinite"]
    assert len(found) == 1, found[["kind", "layer", "step", "message"]].to_string()
    return found.iloc[0]


def test_nan_born_in_a_parametrization_forward_names_the_parametrized_layer(run_dir: Path) -> None:
    def zero_row(model: nn.Module) -> None:
        with torch.no_grad():
            model.mid.parametrizations.weight.original[3] = 0.0

    row = _nonfinite(_train(Mid(UnitRows()), run_dir, steps=8, plant=zero_row, at=5))
    assert (row.step, row.layer, row.phase, row.data["origin"], row.data["type"]) == (
        5, "mid", "forward", "replayed", "ParametrizedLinear")
    assert "in the forward pass of mid (ParametrizedLinear)" in row.message
    assert "`aten::div`" in row.message and "parametrizations" not in row.message


def test_nan_born_in_a_parametrization_backward_names_the_parametrized_layer(run_dir: Path) -> None:
    def exact_zero(model: nn.Module) -> None:
        with torch.no_grad():
            model.mid.parametrizations.weight.original[3, 5] = 0.0

    row = _nonfinite(_train(Mid(SignedRoot()), run_dir, steps=8, plant=exact_zero, at=5))
    assert (row.step, row.layer, row.phase, row.data["type"]) == (5, "mid", "backward", "ParametrizedLinear")
    assert "in the backward pass of mid (ParametrizedLinear)" in row.message


def test_nan_weights_of_a_parametrized_layer_name_it(run_dir: Path) -> None:
    def inf_weight(model: nn.Module) -> None:
        with torch.no_grad():
            model.mid.parametrizations.weight.original[0, 0] = float("inf")

    row = _nonfinite(_train(Mid(Symmetric()), run_dir, steps=8, plant=inf_weight, at=5))
    assert (row.step, row.layer) == (5, "mid")
    assert "in layer mid is NaN/Inf (mid.parametrizations.weight.original)" in row.message


@pytest.mark.parametrize("parametrized", [False, True], ids=["plain", "parametrized"])
def test_an_unreplayed_nan_in_a_parametrized_layer_is_attributed_to_it(run_dir: Path, parametrized: bool) -> None:
    """The loop drops the NaN batch itself: the step cannot be replayed, and the attribution by the
    layers' activations names the layer whose output went NaN first (the next layer, before)."""
    model = Mid(Symmetric() if parametrized else None)
    gw.watch(model, run=run_dir, console=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(12):
        x, y = torch.randn(16, 20, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        hook = model.mid.register_forward_hook(lambda m, i, o: o * float("nan")) if step == 10 else None
        loss = F.cross_entropy(model(x), y)
        if hook is not None:
            hook.remove()
        if not torch.isfinite(loss):
            continue
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)
    row = _nonfinite(gw.open_run(run_dir))
    assert row.layer == "mid" and "forward pass of mid" in row.message


def test_zeros_carried_through_a_parametrized_linear_blame_the_layer_that_made_them(run_dir: Path) -> None:
    class Dead(nn.Module):
        width = 20

        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(20, 32)
            self.mid = weight_norm(nn.Linear(32, 32, bias=False))
            self.out = nn.Linear(32, 3)
            with torch.no_grad():
                self.inp.bias.fill_(-100.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.mid(F.relu(self.inp(x)))))

    found = _train(Dead(), run_dir, steps=12).findings()
    dead = found[found.kind == "dead_units"]
    assert list(dead.layer) == ["inp"], found[["kind", "layer", "message"]].to_string()
    assert "zeroed by the ReLU applied after it" in dead.iloc[0].message


def test_the_doctor_names_parametrized_layers() -> None:
    model = Mid(UnitRows())
    x, y = torch.randn(64, 20), torch.randint(0, 3, (64,))
    flow = {r.name: r for r in diagnose(model, (x, y), F.cross_entropy)}["gradient_flow"]
    assert list(flow.data["norms"]) == ["inp", "mid", "out"]
    with torch.no_grad():
        model.mid.parametrizations.weight.original[3] = 0.0
    acts = {r.name: r for r in diagnose(model, (x, y), F.cross_entropy)}["activations"]
    assert acts.status == "fail" and acts.data["first_nonfinite"] == "mid"
    assert "mid (ParametrizedLinear), whose inputs were finite" in acts.evidence
