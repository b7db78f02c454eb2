"""The samples to blame (issue 18, item 3): a loss spike's or an exploding step's samples, sample ids
from the loop or its DataLoader, and the skip list that leaves blamed samples out afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import gradwatch as gw
from gradwatch.rootcause import skiplist
from gradwatch.rootcause.samples import concentrated

BATCH, STEPS = 16, 30
SPIKE_STEP, SPIKE_ROW = 25, 5
OUTLIER = SPIKE_STEP * BATCH + SPIKE_ROW  # the dataset index of the outlier


class Rows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A regression data set that notes which indices were fetched; one row can be poisoned."""

    def __init__(self, n: int, *, scale: dict[int, float] | None = None, nan: tuple[int, ...] = (),
                 label: dict[int, float] | None = None) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=gen)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [1.5]]) + 0.1 * torch.randn(n, 1, generator=gen)
        for i, factor in (scale or {}).items():
            self.x[i] *= factor
        for i in nan:
            self.x[i, 1] = float("nan")
        for i, factor in (label or {}).items():
            self.y[i] *= factor
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.fetched.append(int(i))
        return self.x[i], self.y[i]


def train(model: nn.Module, loader: Any, run_dir: Path, *, epochs: int = 1, per_sample_losses: bool = False,
          skip: Any = None, **kw: Any) -> Any:
    gw.watch(model, run=run_dir, console=False, **kw)
    w = gw.watcher(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(epochs):
        for x, y in w.batches(loader, skip=skip):
            opt.zero_grad()
            losses = F.mse_loss(model(x), y, reduction="none").mean(1)
            loss = losses.mean()
            loss.backward()
            w.observe(loss=loss, **({"sample_losses": losses} if per_sample_losses else {}))
            opt.step()
    gw.unwatch(model)
    return gw.open_run(run_dir).findings()


@pytest.mark.parametrize("per_sample_losses", [False, True])
def test_loss_spike_blames_the_one_outlier_sample(run_dir: Path, per_sample_losses: bool) -> None:
    """One sample scaled by 1e4 makes the spike: it is blamed by index and by its dataset index."""
    data = Rows(BATCH * STEPS, scale={OUTLIER: 1e4})
    found = train(nn.Linear(4, 1), DataLoader(data, batch_size=BATCH), run_dir, per_sample_losses=per_sample_losses,
                  rules=[gw.Rule(when="loss_spike", do="skip"), gw.Rule(when="exploding", do="skip")])
    blamed = found[found.kind.isin(["loss_spike", "exploding"])]
    assert set(blamed.kind) == {"loss_spike", "exploding"} and set(blamed.step) == {SPIKE_STEP}
    for row in blamed.itertuples():
        samples = row.data["samples"]
        assert (samples["indices"], samples["ids"], samples["batch"]) == ([SPIKE_ROW], [OUTLIER], BATCH)
        assert samples["share"] > 0.99 and row.data["replay_ms"] > 0
        assert f"Samples to blame: sample {SPIKE_ROW} (id {OUTLIER}) carries" in row.message
        assert samples["values"][0].startswith(f"sample {SPIKE_ROW} (id {OUTLIER}): 4 values, range [")
    spike = blamed[blamed.kind == "loss_spike"].iloc[0].data["samples"]
    by_grad = "per-sample gradient norm (torch.func)"
    assert spike["how"] == ("per-sample loss (observed)" if per_sample_losses else by_grad)
    exploding = blamed[blamed.kind == "exploding"].iloc[0].data["samples"]
    assert exploding["how"] == "per-sample gradient norm (torch.func)"


class LossFirst(nn.Module):
    """A model that computes its own loss and returns it first, as a Hugging Face model given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.linear(x)
        return F.mse_loss(out, labels), out


def test_a_model_that_returns_its_loss_first_says_how_to_blame_samples(run_dir: Path) -> None:
    data = Rows(BATCH * STEPS, scale={OUTLIER: 1e4})
    model = LossFirst()
    gw.watch(model, run=run_dir, console=False, rules=None)
    w = gw.watcher(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in w.batches(DataLoader(data, batch_size=BATCH)):
        opt.zero_grad()
        loss, _ = model(x, y)
        loss.backward()
        w.observe(loss=loss)
        opt.step()
    gw.unwatch(model)
    found = gw.open_run(run_dir).findings()
    row = found[found.kind == "exploding"].iloc[0]
    assert row.step == SPIKE_STEP and row.data["samples"]["indices"] == []
    assert "the model returns a scalar first (its own loss" in row.message
    assert "observe(sample_losses=...) names them" in row.message


@pytest.mark.slow  # one backward per sample
def test_a_model_that_mixes_samples_is_blamed_with_one_backward_per_sample(run_dir: Path) -> None:
    """BatchNorm in training mixes the batch: torch.func would change the step, so each sample's part
    of the replayed step's gradient is taken by its own backward. Here the outlier is a label."""
    data = Rows(BATCH * STEPS, label={OUTLIER: 1e4})
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    found = train(model, DataLoader(data, batch_size=BATCH), run_dir, rules=[gw.Rule(when="exploding", do="skip")])
    row = found[(found.kind == "exploding") & (found.step == SPIKE_STEP)].iloc[0]
    samples = row.data["samples"]
    assert samples["how"] == "per-sample gradient norm (one backward per sample)"
    assert (samples["indices"], samples["ids"]) == ([SPIKE_ROW], [OUTLIER])


def test_spread_gradient_blames_no_sample() -> None:
    assert concentrated(torch.tensor([1.0, 1.1, 0.9, 1.0, 1.2, 1.0, 0.8, 1.0, 1.0, 1.0, 1.0])) is None
    assert concentrated(torch.tensor([1.0] * 19 + [1e6])) == [19]
    assert concentrated(torch.tensor([1.0] * 27 + [1e6, 0.8e6, 0.7e6])) == [27, 28]
    assert concentrated(torch.tensor([1.0, float("inf"), 1.0])) == [1]


@pytest.mark.parametrize("do", ["skip", "rollback"])
def test_skip_samples_leaves_the_blamed_sample_out_afterwards(run_dir: Path, tmp_path: Path, do: str) -> None:
    bad = 2 * BATCH + 5  # batch 2, row 5
    data = Rows(BATCH * 6, nan=(bad,))
    found = train(nn.Linear(4, 1), DataLoader(data, batch_size=BATCH), run_dir, epochs=2,
                  rules=[gw.Rule(when="nonfinite", do=do, skip_samples=True)])
    found = found[found.kind == "nonfinite"]
    assert len(found) == 1  # the second epoch never meets the sample again
    row = found.iloc[0]
    assert (row.kind, row.step, row.action, row.data["root_cause"]["cause"]) == ("nonfinite", 2, do, "data")
    assert (row.data["samples"]["indices"], row.data["samples"]["ids"]) == ([5], [bad])
    assert row.data["outcome"]["samples_skipped"] == [bad]
    assert skiplist.read(run_dir) == [bad] == skiplist.read(run_dir / skiplist.FILE)
    first, second = data.fetched[:len(data)], data.fetched[len(data):]
    assert bad in first and bad not in second and len(second) == len(data) - 1

    again = Rows(BATCH * 6, nan=(bad,))  # a new run reuses the list: the sample is never drawn
    found = train(nn.Linear(4, 1), DataLoader(again, batch_size=BATCH), tmp_path / "again", skip=run_dir)
    assert "nonfinite" not in set(found.kind)
    assert bad not in again.fetched and skiplist.read(tmp_path / "again") == [bad]


def test_loader_ids_follow_shuffling_and_workers(run_dir: Path) -> None:
    """Shuffled batches from two worker processes: the ids are the dataset indices of each batch's rows."""
    bad = 37
    data = Rows(BATCH * 4, nan=(bad,))
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, num_workers=2,
                        generator=torch.Generator().manual_seed(3))
    found = train(nn.Linear(4, 1), loader, run_dir)
    samples = found[found.kind == "nonfinite"].iloc[0].data["samples"]
    assert samples["ids"] == [bad] and samples["values"][0].startswith(f"sample {samples['indices'][0]} (id {bad}): "
                                                                       "4 values, 1 NaN, 0 Inf")


def test_user_ids_take_over_from_the_loader_indices(run_dir: Path) -> None:
    bad = 21
    data = Rows(BATCH * 3, nan=(bad,))
    model = nn.Linear(4, 1)
    gw.watch(model, run=run_dir, console=False)
    w = gw.watcher(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (x, y) in enumerate(w.batches(DataLoader(data, batch_size=BATCH))):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        w.observe(loss=loss, sample_ids=torch.arange(BATCH) + 1000 * step)
        opt.step()
    gw.unwatch(model)
    found = gw.open_run(run_dir).findings()
    samples = found[found.kind == "nonfinite"].iloc[0].data["samples"]
    assert (samples["indices"], samples["ids"]) == ([bad - BATCH], [1000 + bad - BATCH])


def test_observe_refuses_ids_and_losses_of_the_wrong_kind(run_dir: Path) -> None:
    model = nn.Linear(4, 1)
    gw.watch(model, run=run_dir, console=False)
    w = gw.watcher(model)
    with pytest.raises(TypeError, match="sample_ids"):
        w.observe(sample_ids="abc")
    with pytest.raises(TypeError, match="one id per sample"):
        w.observe(sample_ids=torch.zeros(2, 2))
    with pytest.raises(TypeError, match="sample_losses"):
        w.observe(sample_losses=[1.0, 2.0])
    gw.unwatch(model)


def test_skip_list_file_errors(tmp_path: Path) -> None:
    with pytest.raises(gw.ConfigError, match="cannot read the skip list"):
        skiplist.read(tmp_path / "missing.txt")
    bad = tmp_path / "skip.txt"
    bad.write_text("# blamed samples\n3\n\"img-4\"\n[1, 2]\n", encoding="utf-8")
    with pytest.raises(gw.ConfigError, match=r"line 4: a sample id must be a JSON number or string"):
        skiplist.read(bad)
    bad.write_text("# blamed samples\n3\n\n\"img-4\"\n", encoding="utf-8")
    assert skiplist.read(bad) == [3, "img-4"]
