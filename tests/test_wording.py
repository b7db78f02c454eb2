"""Sentences gradwatch writes read right: counts agree with their nouns, nn.Sequential's numeric layer
names are quoted (gradwatch.wording, used by the detectors and the doctor)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.wording import layer, listed, place, plural


@pytest.mark.parametrize(("n", "noun", "nouns", "expected"), [
    (0, "layer", None, "0 layers"), (1, "layer", None, "1 layer"), (2, "layer", None, "2 layers"),
    (17091, "gradient element", None, "17,091 gradient elements"), (1, "batch", "batches", "1 batch"),
    (3, "batch", "batches", "3 batches"),
])
def test_plural(n: int, noun: str, nouns: str | None, expected: str) -> None:
    assert plural(n, noun, nouns) == expected


@pytest.mark.parametrize(("name", "type_", "expected"), [
    ("0", "Linear", "'0' (Linear)"), ("3.weight", None, "'3.weight'"), ("encoder.layers.3.linear1", "Linear",
                                                                         "encoder.layers.3.linear1 (Linear)"),
    ("fc1", None, "fc1"), ("(root)", "Linear", "(root) (Linear)"), (None, None, "the model"),
])
def test_layer_names_in_sentences(name: str | None, type_: str | None, expected: str) -> None:
    assert layer(name, type_) == expected


def test_layers_listed_are_written_as_one_layer_is() -> None:
    assert listed(["fc1", "fc2"]) == "fc1, fc2"
    assert listed(["0", "2", "4"]) == "'0', '2', '4'"
    assert listed([str(i) for i in range(0, 20, 2)]) == "'0', '2', '4' … '16', '18'"


@pytest.mark.parametrize(("name", "phase", "source", "expected"), [
    ("fc1", "backward", None, "fc1 (backward)"), ("fc1", None, "input", "fc1"), (None, "forward", "input",
                                                                                 "the input batch"),
    (None, None, "loss", "the loss"), (None, "forward", None, "global (forward)"), (None, None, None, "global"),
])
def test_a_finding_is_placed_in_one_wording(name: str | None, phase: str | None, source: str | None,
                                            expected: str) -> None:
    assert place(name, phase, source) == expected


def test_every_detector_quotes_a_sequential_layer_alike(tmp_path: Path) -> None:
    """A learning rate too high, then saturated Tanh layers: each message names '2' and '1' quoted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    gw.watch(model, run=tmp_path / "run", console=False, rules=None)
    opt = torch.optim.Adam(model.parameters(), lr=3.0)
    x = torch.randn(256, 4)
    for _ in range(40):
        i = torch.randint(0, 256, (32,))
        loss = (model(x[i]) - x[i].sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        found = run.findings()
    kinds = set(found["kind"])
    assert {"learning_rate", "saturation"} <= kinds, found[["step", "kind", "message"]]
    for message in found["message"]:
        assert not re.search(r"(?<![\w'.])\d+(?: \(\w+\)|,| by)", message.split(" at step")[0]), message
    assert any("learning rate too high for '2' (Linear)" in m for m in found["message"])


def _train(model: nn.Module, run: Path, steps: int, lr: float, poison: int | None = None, **options: object) -> gw.Run:
    gw.watch(model, run=run, console=False, rules=None, **options)  # type: ignore[arg-type]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x = torch.randn(8, 4)
        if step == poison:
            x[0, 0] = float("nan")
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    gw.unwatch(model)
    return gw.open_run(run)


def test_a_nan_in_one_layer_reads_in_the_singular(tmp_path: Path) -> None:
    found = _train(nn.Sequential(nn.Linear(4, 1)), tmp_path / "run", steps=2, lr=0.01, poison=1).findings()
    (message,) = found.loc[found["kind"] == "nonfinite", "message"]
    assert "5 gradient elements in 1 layer are NaN/Inf" in message, message


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # log of a negative number: NaN born here


def test_a_nan_attributed_to_a_sequential_child_names_it_quoted(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), Log(), nn.Linear(8, 1))
    found = _train(model, tmp_path / "run", steps=2, lr=0.01, origin=False).findings()  # no replay: attributed
    (message,) = found.loc[found["kind"] == "nonfinite", "message"].head(1)
    assert "pass of '1' (Log) (approximately" in message, message
    assert "gradient elements in 2 layers are NaN/Inf" in message, message


def test_a_nan_born_in_a_sequential_child_names_it_quoted(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), Log(), nn.Linear(8, 1))
    found = _train(model, tmp_path / "run", steps=2, lr=0.01).findings()  # replayed: the root cause's words
    (message,) = found.loc[found["kind"] == "nonfinite", "message"].head(1)
    assert "forward pass of '1' (Log)" in message, message
