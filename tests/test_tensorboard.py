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


class _LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN for a negative input


def _train_every_metric(run_dir: Path) -> None:
    """A run that writes every tag gradwatch has: sampled statistics, a bounded activation, an
    observed extra scalar, and a NaN step (non-finite gradient counts, a skipped step)."""
    model = nn.Sequential(_LogFeatures(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    gw.watch(model, run=run_dir, sample_every=2, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(8):
        x = torch.rand(16, 4) + 0.5
        if step == 5:
            x[0, 0] = -1.0
        loss = nn.functional.mse_loss(model(x), torch.zeros(16, 1))
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss, accuracy=0.5)
        opt.step()
    gw.unwatch(model)


def _custom_scalars_plugin(logdir: Path):  # type: ignore[no-untyped-def]
    """TensorBoard's own custom-scalars plugin over a logdir, as ``tensorboard --logdir`` serves it."""
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.custom_scalar.custom_scalars_plugin import CustomScalarsPlugin
    from tensorboard.plugins.scalar.scalars_plugin import ScalarsPlugin

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    plugins: dict[str, object] = {}
    context = base_plugin.TBContext(logdir=str(logdir), multiplexer=multiplexer, plugin_name_to_instance=plugins,
                                    data_provider=data_provider.MultiplexerDataProvider(multiplexer, str(logdir)))
    plugins["scalars"] = ScalarsPlugin(context)
    return CustomScalarsPlugin(context)


@pytest.mark.filterwarnings("ignore:html5lib's sanitizer is deprecated:DeprecationWarning")  # TB's imports
def test_custom_scalars_layout_charts_the_tags_written(tmp_path: Path) -> None:
    import json
    import re
    from importlib.resources import files

    from google.protobuf import json_format
    from tensorboard import context
    from tensorboard.plugins.custom_scalar import layout_pb2

    _train_every_metric(tmp_path / "a")
    _train_every_metric(tmp_path / "b")
    acc = load(tmp_path / "a")
    assert acc.Tags()["tensors"].count("custom_scalars__config__") == 1, "the layout is written once per run"
    written = set(acc.Tags()["scalars"])

    plugin = _custom_scalars_plugin(tmp_path)
    served = json.loads(plugin.layout_impl(context.RequestContext(), ""))
    source = (files("gradwatch.dashboards") / "tensorboard" / "custom_scalars.json").read_text(encoding="utf-8")
    as_served = json_format.Parse(json.dumps(served), layout_pb2.Layout())
    assert as_served == json_format.Parse(source, layout_pb2.Layout()), \
        "TensorBoard serves the layout as defined (the two runs' layouts merge into one)"
    assert [c["title"] for c in served["category"]][0] == "gradwatch: global"

    charted = set()
    for category in served["category"]:
        for chart in category["chart"]:
            (pattern,) = chart["multiline"]["tag"]
            shown = plugin.scalars_impl(context.RequestContext(), "a", pattern, "")
            assert shown["regex_valid"], pattern
            tags = set(shown["tag_to_events"])
            assert tags, f"chart {chart['title']!r} ({pattern}) matches no tag the run wrote"
            assert tags == {t for t in written if re.match(pattern, t)}
            charted |= tags
    assert charted == written, f"tags in no chart: {sorted(written - charted)}"
    assert {"global/grad_norm", "global/loss", "global/lr", "global/skipped", "global/accuracy",
            "grad_nonfinite/1", "act_sat_frac/2", "update_ratio/3"} <= written
    (other,) = [c for cat in served["category"] for c in cat["chart"] if c["title"] == "other observed scalars"]
    assert set(plugin.scalars_impl(context.RequestContext(), "a", other["multiline"]["tag"][0], "")
               ["tag_to_events"]) == {"global/accuracy"}
