"""gradwatch never breaks the loop it watches (issue 26, item 2).

nanoGPT's order — ``model = torch.compile(model)`` then ``gw.watch(model)`` — with a GradScaler:
the compiled graph returns the loss beside the logits, so the backward pass gives the logits no
gradient (autograd's None) and the hook on them must take that in its stride.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradwatch as gw

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:torch")


class Root(nn.Module):
    """``sqrt`` of a layer's activations; zeroed on the planted step: finite forward, Inf in backward."""

    planted = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(h * 0 if self.planted else h)


class TinyGPT(nn.Module):
    """nanoGPT's interface: ``model(idx, targets)`` returns ``(logits, loss)``, the loss computed inside."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.fc = nn.Linear(width, width)
        self.root = Root()
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        logits = self.head(self.root(F.relu(self.fc(self.wte(idx)))))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def _train(run: Path, *, compiled: bool, scaler: bool, planted_at: int | None = None,
           steps: int = 6) -> tuple[list[warnings.WarningMessage], TinyGPT]:
    torch.manual_seed(0)
    torch._dynamo.reset()
    base = TinyGPT()
    model = torch.compile(base, backend="aot_eager") if compiled else base
    model = gw.watch(model, run=run, rules=None, console=False)  # nanoGPT: compile first, then watch
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3)
    amp = torch.amp.GradScaler("cpu", enabled=scaler)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            idx = torch.randint(0, 32, (4, 8), generator=gen)
            base.root.planted = step == planted_at
            with torch.autocast("cpu", dtype=torch.float16, enabled=scaler):
                _, loss = model(idx, targets=idx)
            amp.scale(loss).backward()
            gw.watcher(model).observe(loss=loss)
            amp.step(opt)
            amp.update()
            opt.zero_grad(set_to_none=True)
        gw.unwatch(model)
    return [w for w in caught if issubclass(w.category, gw.GradwatchWarning)], base


@pytest.mark.slow  # compiles the model (aot_eager)
def test_nanogpt_order_with_a_gradscaler_trains_watched(tmp_path: Path) -> None:
    caught, _ = _train(tmp_path / "run", compiled=True, scaler=True)
    assert not [str(w.message) for w in caught if issubclass(w.category, gw.InternalWarning)]
    with gw.open_run(tmp_path / "run") as run:
        assert run.status == "finished" and run.steps == 6


@pytest.mark.slow  # compiles the model (aot_eager)
def test_a_nan_born_in_backward_is_named_alike_in_nanogpt_order_and_eager(tmp_path: Path) -> None:
    found = {}
    for compiled in (False, True):
        run = tmp_path / f"compiled{compiled}"
        caught, _ = _train(run, compiled=compiled, scaler=False, planted_at=3)
        assert not [str(w.message) for w in caught if issubclass(w.category, gw.InternalWarning)]
        with gw.open_run(run) as stored:
            rows = stored.findings()
        first = rows[rows["kind"] == "nonfinite"].iloc[0]
        found[compiled] = (int(first["step"]), first["layer"], first["phase"], first["data"]["root_cause"]["op"])
    assert found[False] == (3, "root", "backward", "aten::sqrt")
    assert found[True] == found[False], "the compiled model's NaN is named where the eager one's is"
