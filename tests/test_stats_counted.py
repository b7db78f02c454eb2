"""Activation zero and saturated counts look at a bounded, spread-out part of a large output."""

from __future__ import annotations

import torch

from gradwatch import stats


def test_a_small_output_is_counted_whole() -> None:
    x = torch.arange(-100.0, 100.0).reshape(20, 10).relu()
    values, counted = stats.activation_stats(x, None)
    assert counted == x.numel()
    assert int(values[1]) == int((x != 0).sum())
    assert torch.isclose(values[0], torch.linalg.vector_norm(x))


def test_a_large_output_is_counted_on_spread_runs_without_a_copy() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, 96, generator=gen)  # 786,432 elements
    dead = torch.rand(96, generator=gen) < 0.3  # a third of the units are dead on every token
    x[..., dead] = 0.0
    part = stats.counted(x)
    assert part.numel() == stats.COUNTED
    assert part.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # a view
    values, counted = stats.activation_stats(x, None)
    zero_frac = 1.0 - float(values[1]) / counted
    assert abs(zero_frac - float(dead.float().mean())) < 0.01
    assert torch.isclose(values[0], torch.linalg.vector_norm(x))  # the norm is over every element


def test_saturation_is_counted_on_the_same_elements() -> None:
    x = torch.full((300_000,), 0.5)
    x[::4] = 0.999  # a quarter saturated, spread evenly
    values, counted = stats.activation_stats(x, (0.0, 1.0))
    assert counted == stats.COUNTED
    assert abs(float(values[2]) / counted - 0.25) < 0.01


def test_a_non_contiguous_output_is_counted_whole() -> None:
    x = torch.randn(512, 256).t()
    assert not x.is_contiguous()
    assert stats.counted(x) is x


def test_a_small_output_changed_in_place_later_is_measured_as_it_was(tmp_path) -> None:
    """Small outputs are reduced together when the step reads them, from copies taken in the hook:
    an in-place ReLU after a Linear must not change what the Linear's statistics say."""
    from torch import nn

    import gradwatch as gw

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(inplace=True), nn.Linear(32, 1))
    seen: dict[str, torch.Tensor] = {}
    model[0].register_forward_hook(lambda m, a, out: seen.__setitem__("linear", out.detach().clone()))
    gw.watch(model, run=tmp_path / "run", console=False, sample_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 6), torch.randn(16, 1)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    gw.unwatch(model)
    record = next(gw.open_run(tmp_path / "run").records())
    layers = gw.open_run(tmp_path / "run").layers
    linear, relu = layers.index("0"), layers.index("1")
    before = seen["linear"]
    assert torch.isclose(torch.tensor(record.vector("act_norm")[linear]), torch.linalg.vector_norm(before))
    assert record.vector("act_zero_frac")[linear] == 0.0  # before the ReLU: no exact zeros
    assert abs(record.vector("act_zero_frac")[relu] - float((before <= 0).float().mean())) < 1e-6
