"""Aggregate: per-parameter numbers into per-layer numbers. The usual step's matrix product and
the general scatter must agree, shared parameters included."""

from __future__ import annotations

import numpy as np
import pytest

from gradwatch.step import aggregate
from gradwatch.step.aggregate import Aggregator
from gradwatch.store.records import Layout


def layout() -> Layout:
    # layer 0 owns p0, p1; layer 1 owns p2 and shares p1 (tied); layer 2 owns nothing (a leaf)
    return Layout(version=1, layers=("a", "b", "c"), layer_types=("Linear", "Linear", "ReLU"),
                  layer_numel=(6, 4, 0), params=("a.w", "a.b", "b.w"), param_numel=(4, 2, 4),
                  owners=((0, 0), (0, 1), (1, 1), (1, 2)), leaves=(2,))


@pytest.mark.parametrize("dense", [True, False])
def test_layer_norms_and_sums_over_owned_parameters(monkeypatch: pytest.MonkeyPatch, dense: bool) -> None:
    monkeypatch.setattr(aggregate, "DENSE", 1 << 18 if dense else 0)
    agg = Aggregator(layout())
    norms = np.array([3.0, 4.0, 12.0], dtype=np.float32)
    np.testing.assert_allclose(agg.norm(norms, agg.every), [5.0, np.hypot(4.0, 12.0), np.nan])
    np.testing.assert_allclose(agg.sum(np.array([1.0, 2.0, 3.0]), agg.every), [3.0, 5.0, np.nan])
    some = np.array([True, False, True])  # p1 has no value this step
    np.testing.assert_allclose(agg.norm(norms, some), [3.0, 12.0, np.nan])
    np.testing.assert_array_equal(agg.zeros, np.array([0.0, 0.0, np.nan], dtype=np.float32))


def test_a_nan_norm_propagates_to_its_layers_only() -> None:
    agg = Aggregator(layout())
    out = agg.norm(np.array([1.0, np.nan, 2.0]), agg.every)
    assert np.isnan(out).all()  # p1 is in both layers; layer 2 owns nothing
    out = agg.norm(np.array([np.nan, 1.0, 2.0]), agg.every)
    assert np.isnan(out[0]) and out[1] == pytest.approx(np.sqrt(5.0))
