"""Downsampling for people: bounded size, first/last and every extreme kept, NaN-aware."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwatch.store import downsample
from gradwatch.store.downsample import Columns, bucket_starts, columns, minmax


def series(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return np.arange(n, dtype=np.int64) * 3, rng.normal(size=n)


@pytest.mark.parametrize("n, max_points", [(10_000, 2000), (100_001, 2000), (5000, 7), (2001, 2000), (999, 4)])
def test_minmax_is_bounded_and_keeps_first_last_and_extrema(n: int, max_points: int) -> None:
    steps, values = series(n)
    values[n // 3] = 50.0  # a spike
    values[2 * n // 3] = -40.0  # a dip
    s, v = minmax(steps, values, max_points)
    assert len(s) == len(v) <= max_points
    assert s[0] == steps[0] and s[-1] == steps[-1]
    assert v[0] == values[0] and v[-1] == values[-1]
    assert 50.0 in v and -40.0 in v
    assert np.all(np.diff(s) > 0), "in step order, no duplicates"
    index = np.searchsorted(steps, s)
    np.testing.assert_array_equal(values[index], v)  # every point is a real point of the series


def test_minmax_keeps_every_local_extreme_per_bucket() -> None:
    steps, values = series(20_000, seed=1)
    s, v = minmax(steps, values, 1000)
    buckets = np.array_split(np.arange(1, len(values) - 1), 20)  # coarser than minmax's: must all survive
    for b in buckets:
        assert values[b].max() in v and values[b].min() in v


def test_minmax_small_series_unchanged_and_copied() -> None:
    steps, values = series(50)
    s, v = minmax(steps, values, 2000)
    np.testing.assert_array_equal(s, steps)
    np.testing.assert_array_equal(v, values)
    v[0] = 123.0
    assert values[0] != 123.0, "a copy, not a view"
    empty = minmax(np.zeros(0, dtype=np.int64), np.zeros(0), 10)
    assert len(empty[0]) == len(empty[1]) == 0


def test_minmax_nan_and_inf() -> None:
    steps, values = series(10_000, seed=2)
    values[1234] = np.nan  # one NaN: its gap survives
    values[5000:5100] = np.nan  # a NaN stretch
    values[7777] = np.inf
    s, v = minmax(steps, values, 500)
    assert len(s) <= 500
    assert 1234 * 3 in s and np.isnan(v[list(s).index(1234 * 3)])
    assert np.isnan(v[(s >= 5000 * 3) & (s < 5100 * 3)]).any()
    assert np.inf in v
    finite = values[np.isfinite(values)]
    assert finite.max() in v and finite.min() in v, "NaN is never mistaken for an extreme"
    tiny = minmax(steps, values, 4)
    assert len(tiny[0]) <= 4 and np.inf in tiny[1]
    all_nan = minmax(np.arange(5000), np.full(5000, np.nan), 100)
    assert len(all_nan[0]) <= 100 and np.isnan(all_nan[1]).all()


def test_minmax_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="one length"):
        minmax(np.arange(3), np.arange(4.0), 10)
    with pytest.raises(ValueError, match="at least 4"):
        minmax(np.arange(30), np.arange(30.0), 3)


def test_bucket_starts() -> None:
    np.testing.assert_array_equal(bucket_starts(5, 9, 10), [5, 6, 7, 8, 9])
    starts = bucket_starts(0, 99_999, 400)
    assert len(starts) == 400 and starts[0] == 0 and np.all(np.diff(starts) == 250)
    assert len(bucket_starts(0, 1000, 3)) == 3


def test_columns_bounded_and_keeps_the_spike() -> None:
    rng = np.random.default_rng(3)
    steps = np.arange(10_000)
    table = rng.uniform(1, 2, size=(10_000, 30)).astype(np.float32)
    table[6543, 7] = 1e6
    table[100, 3] = -1e3  # largest magnitude, sign kept
    s, t = columns(steps, table, 400)
    assert t.shape == (len(s), 30) and len(s) <= 400
    assert s[0] == 0 and t.max() == 1e6 and t[:, 3].min() == -1e3
    column = np.searchsorted(s, 6543, side="right") - 1
    assert t[column, 7] == 1e6 and s[column] <= 6543 < s[column + 1]


def test_columns_mean_and_nan_handling() -> None:
    steps = np.arange(8)
    table = np.array([[1.0, np.nan], [3.0, np.nan], [5.0, np.inf], [7.0, 2.0],
                      [np.nan, np.nan], [np.nan, np.nan], [1.0, 4.0], [1.0, -8.0]])
    s, mean = columns(steps, table, 4, how="mean")
    np.testing.assert_array_equal(s, [0, 2, 4, 6])
    np.testing.assert_allclose(mean[:, 0], [2.0, 6.0, np.nan, 1.0])
    np.testing.assert_allclose(mean[:, 1], [np.nan, 2.0, np.nan, -2.0])  # inf left out
    _, top = columns(steps, table, 4, how="max")
    np.testing.assert_allclose(top[:, 0], [3.0, 7.0, np.nan, 1.0])
    np.testing.assert_allclose(top[:, 1], [np.nan, 2.0, np.nan, -8.0])


def test_columns_small_table_unchanged() -> None:
    table = np.arange(12.0).reshape(4, 3)
    s, t = columns([10, 20, 30, 40], table, 400)
    np.testing.assert_array_equal(s, [10, 20, 30, 40])
    np.testing.assert_array_equal(t, table)
    with pytest.raises(ValueError, match="one row per step"):
        columns([1, 2], table, 10)
    with pytest.raises(ValueError, match="unknown reduction"):
        Columns(bucket_starts(0, 10, 4), 3, how="median")


def test_streaming_in_chunks_equals_all_at_once() -> None:
    rng = np.random.default_rng(4)
    steps = np.sort(rng.choice(50_000, size=6000, replace=False))  # irregular steps (log_every + flight recorder)
    table = rng.lognormal(size=(6000, 12))
    table[rng.random(table.shape) < 0.05] = np.nan
    whole = columns(steps, table, 300)
    reducer = Columns(bucket_starts(int(steps.min()), int(steps.max()), 300), 12)
    order = rng.permutation(len(steps))  # chunks may arrive in any order
    for chunk in np.array_split(order, 17):
        reducer.add(steps[chunk], table[chunk])
    streamed = reducer.result()
    np.testing.assert_array_equal(streamed[0], whole[0])
    np.testing.assert_array_equal(streamed[1], whole[1])
    assert len(streamed[0]) <= 300


# ------------------------------------------------------------------ Envelope
def brute_envelope(steps: np.ndarray, rows: np.ndarray, scale: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    out = {}
    clean = np.where(np.isfinite(rows), rows, np.nan)
    for b in np.unique(steps // scale):
        part = clean[steps // scale == b]
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[int(b) * scale] = (np.nanmin(part, axis=0), np.nanmax(part, axis=0))
    return out


@given(st.integers(1, 700), st.integers(1, 5), st.sampled_from([2, 4, 16]), st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_envelope_grown_in_chunks_equals_the_whole_table(n: int, width: int, capacity: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    steps = np.sort(rng.choice(n * 2, size=n, replace=False)).astype(np.int64)
    rows = rng.normal(size=(n, width)).astype(np.float32)
    rows[rng.random((n, width)) < 0.05] = np.nan
    rows[rng.random((n, width)) < 0.02] = np.inf
    env = downsample.Envelope(width, capacity)
    cuts = sorted({*rng.choice(np.arange(1, n + 1), size=min(3, n), replace=False).tolist(), n})
    start = 0
    for cut in cuts:  # in chunks, one of them twice (idempotent)
        env.add(steps[start:cut], rows[start:cut])
        env.add(steps[start:cut], rows[start:cut])
        start = cut
    assert env.scale & (env.scale - 1) == 0 and int(steps.max()) // env.scale < capacity
    view_steps, low, high = env.view()
    expected = brute_envelope(steps, rows, env.scale)
    assert view_steps.tolist() == sorted(expected)
    for k, s in enumerate(view_steps):
        np.testing.assert_array_equal(low[k], expected[int(s)][0].astype(np.float32))
        np.testing.assert_array_equal(high[k], expected[int(s)][1].astype(np.float32))


def test_envelope_view_of_a_range_and_largest() -> None:
    env = downsample.Envelope(2, capacity=4)
    env.add(np.arange(10), np.array([[i, -i] for i in range(10)], dtype=np.float32))
    assert env.scale == 4
    steps, low, high = env.view(4, 8)
    assert steps.tolist() == [4] and low.tolist() == [[4, -7]] and high.tolist() == [[7, -4]]
    assert downsample.largest(low, high).tolist() == [[7, -7]]
    with pytest.raises(ValueError, match="power of two"):
        downsample.Envelope(2, capacity=6)
    with pytest.raises(ValueError, match="must not be negative"):
        env.add([-1], np.zeros((1, 2)))
