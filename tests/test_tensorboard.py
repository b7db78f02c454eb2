"""TensorBoard event files, read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import gradwatch as gw

from .conftest import train


def load(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def test_per_layer_series_grouped_by_metric(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    gw.watch(model, run=run_dir, log_every=2, sample_every=4)
    train(model, lambda: (torch.randn(8, 4), torch.randn(8, 1)), nn.functional.mse_loss, steps=9)
    gw.unwatch(model)
    tags = set(load(run_dir).Tags()["scalars"])
    for metric in ("grad_norm", "grad_max", "param_norm", "update_ratio"):
        assert {f"{metric}/0", f"{metric}/2"} <= tags
    assert {"act_norm/0", "act_norm/1", "act_norm/2", "act_zero_frac/1", "act_sat_frac/1"} <= tags
    assert "act_sat_frac/0" not in tags, "saturation is only for bounded activations"
    assert {"global/grad_norm", "global/loss", "global/lr"} <= tags


def test_values_match_the_store(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    gw.watch(model, run=run_dir, log_every=3)
    train(model, lambda: (torch.randn(8, 4), torch.randn(8, 1)), nn.functional.mse_loss, steps=10)
    gw.unwatch(model)
    acc, run = load(run_dir), gw.open_run(run_dir)
    layer = [(e.step, e.value) for e in acc.Scalars("grad_norm/2")]
    assert [s for s, _ in layer] == [0, 3, 6, 9], "per-layer series follow log_every"
    stored = run.metrics("grad_norm", layers="2").set_index("step")["value"]
    np.testing.assert_allclose([v for _, v in layer], stored.loc[[0, 3, 6, 9]].to_numpy(), rtol=1e-6)
    glob = [(e.step, e.value) for e in acc.Scalars("global/loss")]
    assert [s for s, _ in glob] == list(range(10)), "global series are written every step"
    np.testing.assert_allclose([v for _, v in glob], run.scalars()["loss"].to_numpy(), rtol=1e-6)


def test_tensorboard_can_be_turned_off(run_dir: Path) -> None:
    model = gw.watch(nn.Linear(2, 1), run=run_dir, tensorboard=False)
    train(model, lambda: (torch.randn(4, 2), None), lambda out, y: out.sum(), steps=2)
    gw.unwatch(model)
    assert not list(run_dir.glob("events.out.tfevents.*"))
    assert gw.open_run(run_dir).steps == 2


@pytest.mark.parametrize("log_every", [1, 5])
def test_grad_norm_series_lengths(run_dir: Path, log_every: int) -> None:
    model = gw.watch(nn.Linear(2, 1), run=run_dir, log_every=log_every)
    train(model, lambda: (torch.randn(4, 2), None), lambda out, y: out.sum(), steps=10)
    gw.unwatch(model)
    assert len(load(run_dir).Scalars(f"grad_norm/{'(root)'}")) == 10 // log_every


def test_event_records_use_tensorboards_checksum() -> None:
    import os
    import struct

    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    from gradwatch.sinks.tensorboard import _masked_crc

    for data in (b"", b"gradwatch", os.urandom(10_000)):
        assert _masked_crc(data) == struct.pack("<I", masked_crc32c(data))
