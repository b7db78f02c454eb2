"""The run store: format, reading while writing, crash safety, schema versions, bad runs."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from torch import nn

import gradwatch as gw
from gradwatch.store.schema import DB_NAME, SCHEMA_VERSION, pack, unpack

from .conftest import train


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def batches() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(16, 4), torch.randn(16, 2)


@given(arrays(np.float32, st.integers(0, 300)), st.data())
def test_pack_roundtrip_keeps_values_and_presence(values: np.ndarray, data: st.DataObject) -> None:
    present = np.array(data.draw(st.lists(st.booleans(), min_size=len(values), max_size=len(values))), dtype=bool)
    codec, blob, mask = pack(values, present)
    out, out_present = unpack(codec, blob, mask, len(values))
    np.testing.assert_array_equal(out.view(np.uint32), values.view(np.uint32))  # bit-exact, NaN payloads too
    np.testing.assert_array_equal(out_present, present)


def test_all_zero_vectors_are_compressed() -> None:
    codec, blob, mask = pack(np.zeros(1000, np.float32), np.ones(1000, bool))
    assert len(blob) < 100 and mask is None


def test_store_is_wal_and_versioned(run_dir: Path) -> None:
    model = gw.watch(mlp(), run=run_dir)
    train(model, batches, nn.functional.mse_loss, steps=3)
    gw.watcher(model).flush()
    conn = sqlite3.connect(run_dir / DB_NAME)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    assert run.meta["schema_version"] == SCHEMA_VERSION
    assert run.meta["model"] == "Sequential"
    assert run.meta["optimizers"] == ["SGD"], "the optimizers found stepping the model are recorded"
    assert run.status == "finished"


def test_reader_sees_steps_while_training_writes(run_dir: Path) -> None:
    model = gw.watch(mlp(), run=run_dir, flush_seconds=0.05)
    opt = train(model, batches, nn.functional.mse_loss, steps=5)
    gw.watcher(model).flush()
    reader = gw.open_run(run_dir)  # stays open while training goes on
    seen = reader.steps
    assert seen >= 4  # the last step is completed by the next iteration or close
    assert reader.status == "running"
    train(model, batches, nn.functional.mse_loss, steps=20, optimizer=opt)
    gw.watcher(model).flush()
    assert reader.steps >= seen + 20
    gw.unwatch(model)
    assert reader.steps == 25
    assert reader.status == "finished"
    frame = reader.metrics("grad_norm", include_global=False)
    assert sorted(frame["step"].unique()) == list(range(25))
    reader.close()


def test_readers_open_read_only(run_dir: Path) -> None:
    model = gw.watch(mlp(), run=run_dir)
    train(model, batches, nn.functional.mse_loss, steps=2)
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        run._conn.execute("DELETE FROM steps")


KILLED_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    import gradwatch as gw
    torch.manual_seed(0)
    model = gw.watch(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), run=sys.argv[1],
                     flush_seconds=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while True:
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad(); loss.backward(); gw.watcher(model).observe(loss=loss); opt.step()
        step += 1
        if step == 50:
            print("ready", flush=True)
    """
)


@pytest.mark.slow  # a training subprocess, killed
def test_killed_training_process_leaves_a_readable_store(tmp_path: Path) -> None:
    run_dir = tmp_path / "killed"
    script = tmp_path / "train.py"
    script.write_text(KILLED_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    run = gw.open_run(run_dir)
    assert run.steps >= 50
    assert run.status == "crashed"
    scalars = run.scalars()
    assert np.isfinite(scalars["loss"]).all() and len(scalars) == run.steps
    assert not run.metrics("grad_norm", include_global=False).empty


def test_newer_schema_is_refused_with_upgrade_hint(run_dir: Path) -> None:
    model = gw.watch(mlp(), run=run_dir)
    train(model, batches, nn.functional.mse_loss, steps=1)
    gw.unwatch(model)
    conn = sqlite3.connect(run_dir / DB_NAME)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(gw.SchemaError, match="upgrade gradwatch"):
        gw.open_run(run_dir)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: p, "does not exist"),
        (lambda p: (p.mkdir(), p)[1], "not a gradwatch run"),
        (lambda p: (p.mkdir(), (p / DB_NAME).write_bytes(b"garbage" * 200), p)[2], "corrupted"),
        (lambda p: (p.write_text("hello"), p)[1], "not a gradwatch run"),
    ],
    ids=["missing", "empty-dir", "corrupted", "plain-file"],
)
def test_open_run_on_something_that_is_not_a_run(tmp_path: Path, make, match: str) -> None:
    path = make(tmp_path / "x")
    with pytest.raises(gw.RunError, match=match):
        gw.open_run(path)


def test_layout_change_gets_a_new_version(run_dir: Path) -> None:
    class Grows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.heads = nn.ModuleList()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.body(x)
            return sum((head(h) for head in self.heads), h)

    model = gw.watch(Grows(), run=run_dir)
    opt = train(model, batches, lambda out, y: out.pow(2).mean(), steps=3)
    model.heads.append(nn.Linear(4, 4))
    opt.add_param_group({"params": model.heads[0].parameters()})
    train(model, batches, lambda out, y: out.pow(2).mean(), steps=3, optimizer=opt)
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    assert run.layers == ["body", "heads.0"]
    grads = run.metrics("grad_norm", include_global=False)
    assert set(grads[grads.step < 3].layer) == {"body"}
    assert set(grads[grads.step >= 3].layer) == {"body", "heads.0"}
    matrix = run.matrix("grad_norm")
    assert list(matrix.columns) == ["body", "heads.0"]
    assert matrix.loc[:2, "heads.0"].isna().all() and matrix.loc[3:, "heads.0"].notna().all()


def test_reading_a_few_layers_agrees_with_reading_all(run_dir: Path) -> None:
    class Partly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.unused = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
            self.act = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.act(self.a(x)))

    model = gw.watch(Partly(), run=run_dir, sample_every=2)
    train(model, batches, lambda out, y: out.pow(2).mean(), steps=6)
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    everything = run.metrics(include_global=False, per_parameter=True)
    for layers in (["b"], ["unused", "act"], ["a", "b.weight", "unused.bias"]):
        few = run.metrics(layers=layers, per_parameter=True)
        expected = everything[everything.layer.isin(layers)].reset_index(drop=True)
        pd.testing.assert_frame_equal(few.sort_values(["step", "metric", "layer"], ignore_index=True),
                                      expected.sort_values(["step", "metric", "layer"], ignore_index=True))
    assert "unused" not in set(everything[everything.metric == "grad_norm"].layer)
    assert "unused" in set(everything[everything.metric == "param_norm"].layer)
