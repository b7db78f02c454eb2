"""Many small CPU tensors are reduced by shape groups: the norms and largest values of the fused per-tensor calls."""

from __future__ import annotations

import torch
from torch import nn

from gradwatch.step import stats


def _params() -> list[torch.Tensor]:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(40)]
    return [p for b in blocks for p in b.parameters()] + list(nn.Linear(256, 64).parameters())


def test_small_tensors_group_by_shape_and_large_ones_do_not() -> None:
    params = _params()
    grouping = stats.Grouping(params)
    assert grouping.useful
    shapes = sorted(tuple(params[idx[0]].shape) for idx in grouping.groups)
    assert shapes == [(16,), (16, 16)]  # the 120 vectors and the 40 matrices; the 256 x 64 weight is too large
    assert [tuple(params[i].shape) for i in grouping.rest] == [(64, 256), (64,)]


def test_grouped_reductions_are_the_fused_ones_in_order_with_nan_and_inf() -> None:
    params = _params()
    grouping = stats.Grouping(params)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    grads[5][3] = float("nan")
    grads[6][0, 1] = float("inf")  # a (16, 16) weight's
    fused = torch.stack(stats.norms(grads))
    assert torch.allclose(grouping.norms(grads), fused, equal_nan=True)
    assert torch.allclose(grouping.norms(grads, float("inf")), stats.max_abs_stacked(grads)[0], equal_nan=True)
    assert torch.allclose(grouping.max_abs(grads), stats.max_abs_stacked(grads)[0], equal_nan=True)
    assert torch.isnan(grouping.norms(grads)[5]) and torch.isinf(grouping.max_abs(grads)[6])


def test_tensors_that_do_not_group_as_the_layout_did_are_left_to_the_fused_calls() -> None:
    params = _params()
    grouping = stats.Grouping(params)
    grads = [torch.ones_like(p) for p in params]
    grads[0] = grads[0].to_sparse()  # a sparse gradient of a dense parameter
    assert grouping.norms(grads) is None and grouping.max_abs(grads) is None


def test_nothing_groups_where_the_tensors_are_few_or_large() -> None:
    assert not stats.Grouping(list(nn.Linear(512, 512).parameters())).useful
    assert not stats.Grouping([torch.zeros(4) for _ in range(stats.GROUP - 1)]).useful
    assert not stats.Grouping([torch.zeros(4, dtype=torch.float64) for _ in range(200)]).useful
    assert not stats.Grouping([torch.zeros(4) for _ in range(stats.GROUPED - 1)]).useful  # too few to be worth it
    assert stats.Grouping([torch.zeros(4) for _ in range(stats.GROUPED)]).useful
