"""A program that keeps its layers in a plain Python list (issue 34; Hinton's forward-forward example, one
optimizer per layer): the refusal names the attribute and what would register it, and the same program with
``nn.ModuleList`` is watched with its layer-local losses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.errors import ConfigError


class Layer(nn.Linear):
    """A forward-forward layer: its own optimizer, trained by its own goodness loss."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.relu = nn.ReLU()
        self.opt = torch.optim.Adam(self.parameters(), lr=0.005)
        self.threshold = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return self.relu(super().forward(x))

    def train_step(self, pos: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g_pos, g_neg = self(pos).pow(2).mean(1), self(neg).pow(2).mean(1)
        loss = torch.log(1 + torch.exp(torch.cat([-g_pos + self.threshold, g_neg - self.threshold]))).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return self(pos).detach(), self(neg).detach()


class Net(nn.Module):
    def __init__(self, dims: list[int], container: str) -> None:
        super().__init__()
        layers = [Layer(dims[d], dims[d + 1]) for d in range(len(dims) - 1)]
        if container == "list":
            self.layers = layers
        elif container == "dict":
            self.layers = {f"l{i}": layer for i, layer in enumerate(layers)}
        else:
            self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize(("container", "register"), [("list", "nn.ModuleList"), ("dict", "nn.ModuleDict")])
def test_the_refusal_names_the_plain_container(tmp_path: Path, container: str, register: str) -> None:
    net = Net([20, 16, 16], container)
    with pytest.raises(ConfigError) as refused:
        gw.watch(net, run=tmp_path / "r")
    said = str(refused.value)
    assert "Net has no parameters" in said
    assert f"Net.layers is a plain {container} of 2 Layer modules" in said and register in said
    assert not (tmp_path / "r").exists()  # refused before anything was created
    if container == "list":
        assert "watch each layer" in said


def test_a_plain_list_of_parameters_names_parameter_list(tmp_path: Path) -> None:
    class Weights(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = [torch.randn(4, 4, requires_grad=True)]

    with pytest.raises(ConfigError, match=r"Weights\.weights is a plain list of 1 trainable tensor.*nn\.ParameterList"):
        gw.watch(Weights(), run=tmp_path / "r")


def test_a_frozen_model_is_still_refused_as_before(tmp_path: Path) -> None:
    model = nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(ConfigError, match="all are frozen"):
        gw.watch(model, run=tmp_path / "r")


def test_forward_forward_with_a_module_list_is_watched(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Net([20, 16, 16], "module_list")
    gw.watch(net, run=tmp_path / "r", overwrite=True, console=False)
    x = torch.randn(64, 20)
    pos, neg = x + 0.5, x[torch.randperm(64)] - 0.5
    for _ in range(30):
        h_pos, h_neg = pos, neg
        for layer in net.layers:  # each layer by its own loss and optimizer
            h_pos, h_neg = layer.train_step(h_pos, h_neg)
    gw.unwatch(net)
    with gw.open_run(tmp_path / "r") as run:
        assert run.status == "finished" and run.steps > 0
        findings = run.findings()
        assert findings[findings["severity"] != "info"].empty, findings.to_dict("records")
        norms = run.matrix("grad_norm")
        assert {"layers.0", "layers.1"} <= set(norms.columns)
        assert (norms[["layers.0", "layers.1"]].notna().sum() > 0).all()
