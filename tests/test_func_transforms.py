"""``torch.func`` transforms over a watched model (issue 34): ``vmap(grad(functional_call(model, ...)))``
per-sample gradients, ``grad`` and ``jacrev`` leave the watcher alone, and the ordinary training of the
same model is watched as without them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

import gradwatch as gw

STEPS = 12


def classifier() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, torch.randn(32, 8), torch.randint(0, 3, (32,))


def per_sample_loss(model: nn.Module):  # noqa: ANN201 - a loss of (params, x, y) for torch.func
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, params, (x.unsqueeze(0),))
        return nn.functional.cross_entropy(out, y.unsqueeze(0))
    return loss


def dp_sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, private: int, plain: int,
           transform: str | None = None) -> list[dict[str, torch.Tensor]]:
    """``private`` DP-SGD style steps (per-sample gradients by ``vmap(grad)``, clipped per sample, averaged
    into ``p.grad``), then ``plain`` ordinary steps, each after a ``transform`` call of the model (``grad``,
    ``jacrev`` or none) whose result training ignores; returns the gradients each step applied."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_of = per_sample_loss(model)
    applied = []
    for step in range(private + plain):
        params = {k: v.detach() for k, v in model.named_parameters()}
        if step < private:
            grads = vmap(grad(loss_of), in_dims=(None, 0, 0))(params, x, y)
            norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
            scale = (1.0 / norms).clamp(max=1.0)
            for name, p in model.named_parameters():
                p.grad = (grads[name] * scale.view(-1, *[1] * (grads[name].dim() - 1))).mean(0)
        else:
            if transform == "grad":
                grad(loss_of)(params, x[0], y[0])
            elif transform == "jacrev":
                jacrev(lambda p: functional_call(model, p, (x,)))(params)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
        applied.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
    return applied


def test_per_sample_gradients_by_vmap_leave_the_watcher_alone(tmp_path: Path) -> None:
    model, x, y = classifier()
    dp_sgd(model, x, y, private=6, plain=6)
    unwatched = {n: p.detach().clone() for n, p in model.named_parameters()}
    model, x, y = classifier()
    gw.watch(model, run=tmp_path / "r", overwrite=True, console=False)
    applied = dp_sgd(model, x, y, private=6, plain=6)
    gw.unwatch(model)
    for name, p in model.named_parameters():  # training is the same as without gradwatch
        assert torch.equal(p.detach(), unwatched[name]), name
    with gw.open_run(tmp_path / "r") as run:
        assert run.status == "finished" and run.steps == STEPS
        findings = run.findings()
        assert findings[findings["severity"] != "info"].empty, findings.to_dict("records")
        # every step is measured on the gradients it applied: the private ones (set by hand) too
        norms = run.matrix("grad_norm")
        assert list(norms.index) == list(range(STEPS))
        for step, grads in enumerate(applied):
            for layer in ("0", "2"):
                want = torch.sqrt(sum(g.double().pow(2).sum() for n, g in grads.items() if n.startswith(layer + ".")))
                np.testing.assert_allclose(norms.loc[step, layer], float(want), rtol=1e-5)


@pytest.mark.parametrize("transform", ["grad", "jacrev"])
def test_a_transform_call_is_no_call_of_the_step(tmp_path: Path, transform: str) -> None:
    """The activations of the ordinary forward calls are measured, not those of the transform's call."""
    acts = {}
    for name, call in (("plain", None), ("transformed", transform)):
        model, x, y = classifier()
        gw.watch(model, run=tmp_path / name, overwrite=True, console=False)
        dp_sgd(model, x, y, private=0, plain=STEPS, transform=call)
        gw.unwatch(model)
        with gw.open_run(tmp_path / name) as run:
            assert run.status == "finished" and run.steps == STEPS
            findings = run.findings()
            assert findings[findings["severity"] != "info"].empty, findings.to_dict("records")
            acts[name] = run.matrix("act_norm")
    assert len(acts["plain"]) > 0 and list(acts["plain"].index) == list(acts["transformed"].index)
    np.testing.assert_allclose(acts["transformed"].to_numpy(), acts["plain"].to_numpy(), rtol=1e-6)
