"""Per-parameter histograms (``wandb_histograms``): both ways of computing them count what numpy counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradwatch.step import histograms


@pytest.mark.parametrize("way", [histograms._on_host, histograms._on_device])
def test_a_histogram_counts_every_finite_element_over_its_range(way: object) -> None:
    torch.manual_seed(0)
    x = torch.randn(10_000)
    x[[5, 50]] = torch.tensor([math.nan, math.inf])
    row = way(x, 64).numpy()  # type: ignore[operator]
    finite = x[torch.isfinite(x)].numpy()
    assert (row[0], row[1]) == (finite.min(), finite.max())
    counts, _ = np.histogram(finite, bins=64, range=(finite.min(), finite.max()))
    assert row[2:].sum() == len(finite) == 9_998
    assert np.abs(row[2:] - counts).max() <= 1  # float32 against float64 at a bin's edge


@pytest.mark.parametrize("way", [histograms._on_host, histograms._on_device])
def test_one_value_throughout_is_one_bin_and_no_finite_value_is_no_histogram(way: object) -> None:
    row = way(torch.full((7,), 2.5), 64).numpy()  # type: ignore[operator]
    assert (row[0], row[1], row[2], row[3:].sum()) == (2.5, 2.5, 7, 0)
    nothing = way(torch.tensor([math.nan, math.inf]), 64).numpy()  # type: ignore[operator]
    read = histograms.read(np.concatenate([nothing, row]).astype(np.float64), ["p"])  # a gradient, a value
    assert list(read) == ["parameters/p"]  # the gradient had no finite element: no histogram
    counts, edges = read["parameters/p"]
    assert counts.sum() == 7 and edges[0] == 2.5 and len(edges) == 65 and edges[-1] > edges[0]


def test_parts_reads_each_parameter_in_model_order_with_its_gradient_first() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    names = [name for name, _ in model.named_parameters()]
    host = torch.cat(histograms.parts(list(model.parameters()))).double().numpy()
    assert len(host) == histograms.size(list(model.parameters()))
    read = histograms.read(host, names)
    assert list(read) == ["gradients/weight", "parameters/weight", "gradients/bias", "parameters/bias"]
    assert read["parameters/weight"][0].sum() == 6 and read["gradients/bias"][0].sum() == 2
