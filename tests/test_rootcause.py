"""Root cause of a NaN/Inf (issue 18): the op, the source line, the fact, the cause and the samples.

Each planted case knows its answer: the aten op, the line of this file that ran it, what about
its inputs explains it, the cause class and the samples of the batch; each is asserted exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradwatch as gw

HERE = Path(__file__).read_text(encoding="utf-8").splitlines()


def line_of(marker: str) -> tuple[int, str]:
    """The line number and stripped text of the line of this file holding ``marker``."""
    found = [(n, text.strip()) for n, text in enumerate(HERE, 1) if text.rstrip().endswith(marker)]
    assert len(found) == 1, marker
    return found[0]


def run(model: nn.Module, run_dir: Path, batch: Callable[[int], tuple[tuple[Any, ...], torch.Tensor]], *,
        steps: int = 6, autocast: torch.dtype | None = None, ids: bool = False,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.mse_loss, lr: float = 0.01,
        **kw: Any) -> Any:
    """A plain loop; ``batch(step)`` gives the model's arguments and the target."""
    gw.watch(model, run=run_dir, console=False, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        args, y = batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = loss_fn(model(*args).float(), y)
        loss.backward()
        w = gw.watcher(model)
        w.observe(loss=loss)
        if ids:
            w.observe(sample_ids=[f"img-{step}-{i}" for i in range(len(y))])
        opt.step()
    gw.unwatch(model)
    return gw.open_run(run_dir).findings()


def only_nonfinite(found: Any) -> Any:
    rows = found[found.kind == "nonfinite"]
    assert len(rows) == 1, list(found.message)
    return rows.iloc[0]


def assert_root(row: Any, *, op: str, marker: str | None, fact: str, cause: str, samples: list[int],
                phase: str, layer: str) -> dict[str, Any]:
    """The finding's root cause is exactly the planted one."""
    root = row.data["root_cause"]
    assert (row.phase, row.layer) == (phase, layer)
    assert (root["op"], root["fact"], root["cause"]) == (op, fact, cause)
    if marker is not None:
        assert (root["file"], root["user_code"]) == (__file__, True)
        assert (root["line"], root["code"]) == line_of(marker)
        assert f"`{op}`" in row.message and f"test_rootcause.py:{root['line']}" in row.message
    assert row.data["samples"]["indices"] == samples
    assert row.data["replay_ms"] > 0
    return root


# ------------------------------------------------------------------ forward


class Positive(nn.Linear):
    """A frozen linear layer with weights 0.1, 0.2 ... by output: a negative input row gives a negative
    output row, and its values are known whatever training did before."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        with torch.no_grad():
            self.weight.copy_(0.1 * torch.arange(1, n_out + 1, dtype=torch.float32)[:, None].expand(n_out, n_in))
            self.bias.zero_()
        self.requires_grad_(False)


def uniform_batch(bad: int, plant: Callable[[torch.Tensor], None], n: int = 8) -> Callable[[int], Any]:
    def batch(step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.rand(n, 4, generator=gen) + 0.5, torch.randn(n, 1, generator=gen)
        if step == bad:
            plant(x)
        return (x,), y
    return batch


class LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # plant: log


def test_log_of_a_negative_feature(run_dir: Path) -> None:
    model = nn.Sequential()
    model.add_module("inp", Positive(4, 3))
    model.add_module("feat", LogFeatures())
    model.add_module("out", nn.Linear(3, 1))

    def plant(x: torch.Tensor) -> None:
        x[2] = -1.0

    row = only_nonfinite(run(model, run_dir, uniform_batch(3, plant), ids=True))
    # the log's input comes from the batch through a frozen layer: no trainable weight enters it, and only
    # sample 2 went NaN, so the sample's own values are to blame (with a trainable layer before it, the
    # model is: see test_rootcause_outputs)
    root = assert_root(row, op="aten::log", marker="# plant: log", phase="forward", layer="feat", cause="data",
                       fact="3 of the input's 24 values are negative (min -1.2)", samples=[2])
    assert root["born"] == "NaN" and row.step == 3 and row.data["type"] == "LogFeatures"
    assert row.data["samples"]["ids"] == ["img-3-2"]
    assert row.message.startswith("NaN born in `aten::log` at test_rootcause.py:")
    assert "in the forward pass of feat (LogFeatures) at step 3: 3 of the input's 24 values are negative" in row.message
    assert (f"cause: data (only 1 of the batch's 8 samples went NaN/Inf, by a negative value in the input of log at "
            f"test_rootcause.py:{root['line']}, a value the batch alone makes: no trainable weight enters it); "
            "samples to blame: sample 2 (id 'img-3-2')") in row.message
    assert row.data["hint"].startswith("look at the samples named")


class LayerNorm(nn.Module):
    """A hand-written layer norm without an epsilon: a constant row divides 0 by 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, std = x.mean(-1, keepdim=True), x.std(-1, keepdim=True)
        return (x - mu) / std  # plant: layernorm


def test_hand_written_layernorm_divides_by_a_zero_std(run_dir: Path) -> None:
    model = nn.Sequential()
    model.add_module("inp", Positive(4, 6))
    model.add_module("act", nn.ReLU())
    model.add_module("norm", LayerNorm())
    model.add_module("out", nn.Linear(6, 1))

    def plant(x: torch.Tensor) -> None:
        x[3] = -1.0  # the ReLU makes row 3 all zeros: its std is 0

    row = only_nonfinite(run(model, run_dir, uniform_batch(2, plant)))
    # sample 3 alone makes the zero divisor (through a frozen layer and a ReLU): the data's doing, and
    # the hint also says to guard the op, since a constant row may be valid
    root = assert_root(row, op="aten::div", marker="# plant: layernorm", phase="forward", layer="norm", cause="data",
                       fact="the divisor is 0 in 1 of its 8 values (0/0 in 6)", samples=[3])
    assert row.data["samples"]["ids"] is None
    assert root["culprit"] == "a 0 in the divisor of the division"
    assert "cause: data (only 1 of the batch's 8 samples went NaN/Inf, by a 0 in the divisor of the division" in \
        row.message
    assert "guard the op" in row.data["hint"]


class BoxDensity(nn.Module):
    """Boxes as (cx, cy, w, h): their centre over their area; a box of area 0 divides by 0."""

    def forward(self, boxes: torch.Tensor) -> torch.Tensor:
        area = boxes[:, 2] * boxes[:, 3]
        return boxes[:, :2] / area.unsqueeze(1)  # plant: area


def test_a_box_of_area_0_in_the_batch_is_the_datas_doing(run_dir: Path) -> None:
    """The batch is finite, but sample 5's box has height 0: the division by its area is the data's doing."""
    model = nn.Sequential()
    model.add_module("box", BoxDensity())
    model.add_module("out", nn.Linear(2, 1))

    def plant(x: torch.Tensor) -> None:
        x[5, 3] = 0.0

    row = only_nonfinite(run(model, run_dir, uniform_batch(3, plant)))
    root = assert_root(row, op="aten::div", marker="# plant: area", phase="forward", layer="box", cause="data",
                       fact="the divisor is 0 in 1 of its 8 values", samples=[5])
    assert root["culprit"] == "a 0 in the divisor of the division" and "grew" not in root
    assert (f"cause: data (only 1 of the batch's 8 samples went NaN/Inf, by a 0 in the divisor of the division at "
            f"test_rootcause.py:{root['line']}, a value the batch alone makes: no trainable weight enters it); "
            "samples to blame: sample 5;") in row.message


def test_every_sample_making_it_at_an_op_no_weight_enters_is_the_code(run_dir: Path) -> None:
    """Every box of the batch has height 0: not a few bad samples, and no weight to blame: the code."""
    model = nn.Sequential()
    model.add_module("box", BoxDensity())
    model.add_module("out", nn.Linear(2, 1))

    def plant(x: torch.Tensor) -> None:
        x[:, 3] = 0.0

    row = only_nonfinite(run(model, run_dir, uniform_batch(3, plant)))
    root = assert_root(row, op="aten::div", marker="# plant: area", phase="forward", layer="box", cause="model",
                       fact="the divisor is 0 in 8 of its 8 values", samples=list(range(8)))
    assert "grew" not in root and root["cause_detail"].endswith(
        "every sample of the batch makes it at an op whose offending input no trainable weight enters: a bug in the "
        "code at that line (or a batch whose every sample is bad), not diverged weights")


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(~mask, float("-inf"))
        att = F.softmax(att, dim=-1)  # plant: softmax
        return att @ v


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention(4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, mask)).mean(1)


def test_attention_mask_that_masks_a_whole_row(run_dir: Path) -> None:
    def batch(step: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 3, 4, generator=gen), torch.randn(4, 1, generator=gen)
        mask = torch.ones(3, 3, dtype=torch.bool).tril().expand(4, 3, 3).clone()
        if step == 4:
            mask[2, 1, :] = False  # sample 2, query 1: every position masked
        return (x, mask), y

    row = only_nonfinite(run(Tiny(), run_dir, batch))
    root = assert_root(row, op="aten::_softmax", marker="# plant: softmax", phase="forward", layer="attn",
                       cause="model", samples=[2],
                       fact="row [2, 1] of the input is all -inf (every position masked): softmax over it is 0/0")
    assert root["born"] == "NaN" and row.step == 4


class Mask(nn.Module):
    """Masks positions with -inf by design (its output is never finite): not where the NaN is born."""

    def forward(self, scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(~keep, float("-inf"))


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scores = nn.Linear(4, 5)
        self.mask = Mask()
        self.softmax = nn.Softmax(dim=-1)
        self.out = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.out(self.softmax(self.mask(self.scores(x), keep)))


def test_a_module_that_returns_minus_inf_by_design_is_not_the_origin(run_dir: Path) -> None:
    """The mask module is the first whose output is not finite, but -inf is what it is for: the NaN is
    born in the softmax after it, which the finding names (with a note saying why)."""
    def batch(step: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        gen = torch.Generator().manual_seed(step)
        keep = torch.ones(6, 5, dtype=torch.bool)
        keep[:, 0] = False
        if step == 3:
            keep[4] = False  # sample 4: every position masked
        return (torch.randn(6, 4, generator=gen), keep), torch.randn(6, 1, generator=gen)

    # activations=False: on sampled steps the activation statistics would flag the mask's -inf output itself
    row = only_nonfinite(run(Scorer(), run_dir, batch, activations=False))
    root = assert_root(row, op="aten::_softmax", marker=None, phase="forward", layer="softmax", cause="model",
                       samples=[4], fact="row 4 of the input is all -inf (every position masked): softmax over it "
                                         "is 0/0")
    assert row.data["type"] == "Softmax" and root["layer"] == "softmax"
    assert row.data["note"] == ("mask (Mask) returns -inf/inf by design; the first NaN/Inf that was not meant was "
                                "born in softmax")


class Expo(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)  # plant: exp


def test_exp_overflow_under_fp16_autocast_is_precision(run_dir: Path) -> None:
    """exp(12) = 162755 overflows float16 (largest 65504) but not float32."""
    model = nn.Sequential()
    model.add_module("lin", nn.Linear(4, 4))
    model.add_module("expo", Expo())
    model.add_module("out", nn.Linear(4, 1))
    with torch.no_grad():
        model.lin.weight.fill_(0.25)
        model.lin.bias.zero_()
    model.lin.requires_grad_(False)

    def plant(x: torch.Tensor) -> None:
        x[1] = 12.0  # lin gives the mean of the row: 12

    row = only_nonfinite(run(model, run_dir, uniform_batch(3, plant), autocast=torch.float16))
    root = assert_root(row, op="aten::exp", marker="# plant: exp", phase="forward", layer="expo", cause="precision",
                       fact="exp of values up to 12 overflows float16 (exp(x) > 6.55e+04 for x > 11.09)", samples=[1])
    assert root["born"] == "Inf" and root["precision_replay"] == "float32"
    assert "stays finite when replayed in float32 (it ran under float16 autocast)" in root["cause_detail"]
    assert "cause: precision" in row.message


def test_fp16_overflow_in_the_first_linear_is_a_forward_origin(run_dir: Path) -> None:
    """Under fp16 autocast without a GradScaler, a batch that overflows float16 in the first Linear is
    found in that Linear's forward (the replay runs under the step's autocast), not "in the loss";
    every sample overflows alike, so it is precision, not an outlier of the data."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
    model[0].requires_grad_(False)

    def plant(x: torch.Tensor) -> None:
        x[:] = 2e4  # fits float16 (65504), but the first Linear sums 4 of them: 8e4

    row = only_nonfinite(run(model, run_dir, uniform_batch(2, plant), autocast=torch.float16))
    root = assert_root(row, op="aten::addmm", marker=None, phase="forward", layer="0", cause="precision",
                       samples=list(range(8)),
                       fact="float16 overflow: in float32 its result reaches 8e+04, beyond float16's largest value "
                            "6.55e+04 (|x| > 6.55e+04 is inf)")
    # nn.Linear inside nn.Sequential: no line of the user's runs it; the module's own forward is named
    assert root["file"].endswith("linear.py") and root["user_code"] is False and "F.linear" in root["code"]


def test_one_sample_holding_nan_is_data_with_its_index_and_id(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def plant(x: torch.Tensor) -> None:
        x[5, 2] = float("nan")

    row = only_nonfinite(run(model, run_dir, uniform_batch(3, plant), ids=True))
    assert (row.phase, row.layer) == ("forward", None)
    root, samples = row.data["root_cause"], row.data["samples"]
    assert (root["cause"], samples["indices"], samples["ids"]) == ("data", [5], ["img-3-5"])
    assert samples["values"][0].startswith("sample 5 (id 'img-3-5'): 4 values, 1 NaN, 0 Inf, range [")
    assert row.message.startswith("The model's input batch holds NaN/Inf at step 3; cause: data")
    assert "samples to blame: sample 5 (id 'img-3-5')" in row.message


def test_a_nan_sample_in_a_later_micro_batch_is_counted_across_the_step(run_dir: Path) -> None:
    """Gradient accumulation over 4 micro-batches of 8: a NaN in sample 2 of the third is sample 18
    of the step, in forward call 3."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    gw.watch(model, run=run_dir, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        opt.zero_grad()
        for micro in range(4):
            x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
            if (step, micro) == (2, 2):
                x[2, 1] = float("nan")
            (F.mse_loss(model(x), y) / 4).backward()
        opt.step()
    gw.unwatch(model)
    row = only_nonfinite(gw.open_run(run_dir).findings())
    samples = row.data["samples"]
    assert (row.step, samples["indices"], samples["call"], samples["batch"]) == (2, [18], 2, 32)
    assert samples["values"][0].startswith("sample 18: 4 values, 1 NaN")
    assert "samples to blame: sample 18 (forward call 3 of the step; samples counted across its calls)" in row.message


@pytest.mark.parametrize(("value", "stands_out"), [
    (1e6, "reach 1e+06, 7.66e+05x the batch's typical largest value (1.31)"),
    (200.0, "reach 200, 153x the batch's typical largest value (1.31) (in float64 they would stay finite)"),
])
def test_one_outlier_sample_that_overflows_is_data(run_dir: Path, value: float, stands_out: str) -> None:
    """A sample 100 times the others' scale or more is the cause, whether or not float64 would survive it."""
    model = nn.Sequential()
    model.add_module("lin", nn.Linear(4, 4))
    model.add_module("expo", Expo())
    model.add_module("out", nn.Linear(4, 1))
    with torch.no_grad():
        model.lin.weight.fill_(0.25)
        model.lin.bias.zero_()
    model.lin.requires_grad_(False)

    def plant(x: torch.Tensor) -> None:
        x[6] = value

    row = only_nonfinite(run(model, run_dir, uniform_batch(3, plant), ids=True))
    root = assert_root(row, op="aten::exp", marker="# plant: exp", phase="forward", layer="expo", cause="data",
                       samples=[6], fact=f"exp of values up to {value:.3g} overflows float32 (exp(x) > 3.4e+38 for "
                                          "x > 88.72)")
    assert root["cause_detail"] == f"only 1 of the batch's 8 samples went NaN/Inf and their inputs {stands_out}"
    assert row.data["samples"]["ids"] == ["img-3-6"] and "cause: data (only 1 of the batch's 8 samples" in row.message


class Flaky(nn.Module):
    """Returns NaN on its first call of the planted step only (like a transient hardware fault)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            return x * float("nan")
        return x


def test_module_that_fails_only_on_its_first_call_is_not_reproducible(run_dir: Path) -> None:
    model = nn.Sequential()
    model.add_module("inp", nn.Linear(4, 8))
    model.add_module("flaky", Flaky())
    model.add_module("out", nn.Linear(8, 1))

    def plant(x: torch.Tensor) -> None:
        model.flaky.armed = True

    row = only_nonfinite(run(model, run_dir, uniform_batch(3, plant)))
    root = row.data["root_cause"]
    assert (root["cause"], row.data["origin"], root["seen_in"]) == ("not_reproducible", "attributed", "output")
    assert "rank" not in root and "samples" not in row.data
    assert "faulty hardware (silent data corruption)" in root["cause_detail"]
    assert row.message.startswith("NaN/Inf at step 3 did not come back when the step was replayed")
    assert "cause: not reproducible" in row.message


# ----------------------------------------------------------------- backward


class Radius(nn.Module):
    """Forward finite at 0 (sqrt(0) = 0), backward infinite: d sqrt(s)/ds at s = 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.pow(2).sum(-1, keepdim=True).sqrt()], dim=-1)  # plant: sqrt


def test_sqrt_backward_at_zero(run_dir: Path) -> None:
    model = nn.Sequential()
    model.add_module("inp", nn.Linear(4, 3, bias=False))
    model.add_module("radius", Radius())
    model.add_module("out", nn.Linear(4, 1))

    def plant(x: torch.Tensor) -> None:
        x[1] = 0.0

    row = only_nonfinite(run(model, run_dir, uniform_batch(4, plant)))
    root = assert_root(row, op="aten::sqrt", marker="# plant: sqrt", phase="backward", layer="radius", cause="model",
                       fact="sqrt's gradient 1/(2·sqrt(x)) is infinite at x = 0: 1 of its 8 inputs is 0", samples=[1])
    assert (root["node"], root["born"]) == ("SqrtBackward0", "Inf")
    assert "param" not in root


def test_weight_gradient_overflow_names_the_parameter_and_op(run_dir: Path) -> None:
    """fc's weight gradient input^T @ grad_output overflows float16 while its input gradient stays finite."""
    model = nn.Sequential()
    model.add_module("inp", nn.Linear(4, 4))
    model.add_module("fc", nn.Linear(4, 4))
    model.add_module("out", nn.Linear(4, 1))
    with torch.no_grad():
        model.inp.weight.fill_(1.0)
        model.inp.bias.zero_()
        model.fc.weight.fill_(0.01)
        model.out.weight.fill_(10.0)

    def plant(x: torch.Tensor) -> None:
        x[4] = 60.0  # fc's input row 4 is 240; its incoming gradient is 1,000 per element

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return out.sum() * 100.0  # a hand-made loss scale, no GradScaler

    found = run(model, run_dir, uniform_batch(2, plant), autocast=torch.float16, loss_fn=loss_fn, steps=3, lr=1e-9)
    row = only_nonfinite(found)
    root = assert_root(row, op="aten::addmm", marker=None, phase="backward", layer="fc", cause="precision",
                       samples=[4], fact=row.data["root_cause"]["fact"])
    assert (root["param"], root["node"]) == ("fc.weight", "AddmmBackward0")
    assert root["fact"].startswith("input^T @ grad_output overflows float16: max |input| 240 × max |grad| 1e+03")
    assert "Inf born in the gradient of fc.weight, in `aten::addmm` (AddmmBackward0)" in row.message


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_replay_leaves_autocast_rng_and_buffers_as_they_were(run_dir: Path, dtype: torch.dtype) -> None:
    """Every replay (module, op, wider type) runs under the step's autocast; the loop's own autocast
    around ``optimizer.step()``, the RNG stream and BatchNorm's statistics are left as they were."""
    model = nn.Sequential(nn.Linear(4, 8), Expo(), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    gw.watch(model, run=run_dir, console=False, rules=None)
    x = torch.rand(8, 4)
    x[0] = 30.0  # exp(120) overflows every floating-point type but float64
    with torch.autocast("cpu", dtype=dtype):
        loss = model(x).float().mean()
    loss.backward()
    stats = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.float16):
        torch.optim.SGD(model.parameters(), lr=0.0).step()
        assert torch.is_autocast_enabled("cpu") == (dtype == torch.float16)
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(((a == b) | (a.isnan() & b.isnan())).all() for a, b in zip(stats, model.buffers()))
    assert any(b.isnan().any() for b in stats)  # the step itself left NaN in the running statistics
    gw.unwatch(model)
    row = only_nonfinite(gw.open_run(run_dir).findings())
    assert (row.layer, row.data["root_cause"]["op"], row.data["root_cause"]["cause"]) == ("1", "aten::exp", "model")
    assert row.data["samples"]["indices"] == [0] and row.data["replay_ms"] > 0


@pytest.mark.slow  # a real training script: a small GPT, 21 iterations under bf16 autocast
def test_gpt_trainer_with_a_fully_masked_attention_row(tmp_path: Path) -> None:
    """The issue's own case: a left-padded sample whose first query may attend to nothing."""
    from .realcode import gpt

    result = gpt.train(gpt.Config(run=tmp_path / "run", pad_at=20, max_iters=21))
    found = [f for f in result.findings() if f["kind"] == "nonfinite"]
    assert [(f["step"], f["layer"], f["phase"]) for f in found] == [(20, "transformer.h.0.attn", "forward")]
    root, samples = found[0]["data"]["root_cause"], found[0]["data"]["samples"]
    assert (root["op"], Path(root["file"]).name, root["code"]) == ("aten::_softmax", "gpt.py",
                                                                   "att = F.softmax(att, dim=-1)")
    assert root["fact"].startswith("row [0, 0, 0] of the input is all -inf (every position masked)")
    assert root["cause"] == "model" and "grew" not in root and samples["indices"] == [0]
    assert found[0]["message"].startswith("NaN born in `aten::_softmax` at gpt.py:")


@pytest.mark.parametrize("batch_first", [False, True])
def test_the_samples_of_a_sequence_first_batch_run_over_its_second_dimension(tmp_path: Path,
                                                                            batch_first: bool) -> None:
    """nn.LSTM takes (T, B, F) by default: a NaN in sequence 5 at time step 3 is sample 5 of 10, not 3 of 35."""

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(8, 16, batch_first=batch_first)
            self.out = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.rnn(x)[0])

    torch.manual_seed(0)
    model = gw.watch(Tagger(), run=tmp_path / "run", console=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(6):
        x = torch.randn(35, 10, 8) if not batch_first else torch.randn(10, 35, 8)
        if step == 4:
            x[(3, 5, 2) if not batch_first else (5, 3, 2)] = float("nan")
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        error = run.findings().iloc[0]
    assert (error.kind, error.step) == ("nonfinite", 4)
    assert error.data["samples"]["indices"] == [5] and error.data["samples"]["batch"] == 10
