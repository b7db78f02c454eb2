"""Activation zero and saturated counts look at a bounded, spread-out part of a large output."""

from __future__ import annotations

import numpy as np
import torch

from gradwatch.step import stats


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


class Flip(torch.nn.Module):
    """ReLU, in place from step ``from_step`` on (counted by the calls of ``forward``), else a new tensor."""

    def __init__(self, from_step: int) -> None:
        super().__init__()
        self.from_step, self.calls = from_step, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.relu_() if self.calls > self.from_step else x.relu()


def train_seen(tmp_path, flip_from: int, steps: int = 4):
    """Train Linear -> Flip -> Linear watched with every step sampled; return the run and the first
    Linear's outputs as its own hook saw them, per step."""
    from torch import nn

    import gradwatch as gw

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), Flip(flip_from), nn.Linear(32, 1))
    seen: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    gw.watch(model, run=tmp_path / "run", console=False, sample_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 1, generator=gen)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    gw.unwatch(model)
    return gw.open_run(tmp_path / "run"), seen


def test_a_small_output_changed_in_place_later_is_measured_as_it_was(tmp_path) -> None:
    """Small outputs are reduced together when the step reads them: an in-place ReLU after a Linear
    must not change what the Linear's statistics say, on the first sampled step (copied while
    gradwatch learns which outputs change) nor later (copied in the hook from then on)."""
    run, seen = train_seen(tmp_path, flip_from=0)
    linear, relu = run.layers.index("0"), run.layers.index("1")
    for record, before in zip(run.records(), seen, strict=True):
        assert torch.isclose(torch.tensor(record.vector("act_norm")[linear]), torch.linalg.vector_norm(before))
        assert record.vector("act_zero_frac")[linear] == 0.0  # before the ReLU: no exact zeros
        assert abs(record.vector("act_zero_frac")[relu] - float((before <= 0).float().mean())) < 1e-6


def test_an_output_held_by_reference_that_starts_changing_is_left_out_of_that_step_only(tmp_path) -> None:
    """An output that stayed as it was is held by reference from the second sampled step on; when a
    later op starts changing it in place, that step cannot know its values (the layer reads NaN
    there, not a wrong number) and the leaf is copied from the next step on."""
    run, seen = train_seen(tmp_path, flip_from=2)
    linear = run.layers.index("0")
    norms = [float(r.vector("act_norm")[linear]) for r in run.records()]
    expected = [float(torch.linalg.vector_norm(before)) for before in seen]
    assert np.isnan(norms[2])
    for step in (0, 1, 3):
        assert abs(norms[step] - expected[step]) <= 1e-5 * expected[step]
