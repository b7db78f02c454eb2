"""Root cause, its limits: nothing runs on healthy steps, what cannot be replayed says why, and each
fact about a culprit op is exact."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import gradwatch as gw
from gradwatch.rootcause import facts
from gradwatch.rootcause.frames import user_line


class Spy(nn.Module):
    """Notes, at each call, whether a torch function mode, a dispatch mode or anomaly mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, int, bool, bool]] = []
        self.in_loop = False
        self.negate = False  # the log of a negative value: NaN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.in_loop, torch._C._len_torch_function_stack(), _get_current_dispatch_mode() is not None,
                          torch.is_anomaly_enabled()))
        return torch.log(-x if self.negate else x)


def hooks(model: nn.Module) -> int:
    """Every module hook on the model, and the global module hooks."""
    from torch.nn.modules import module as m

    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    own = sum(len(getattr(mod, name)) for mod in model.modules() for name in names)
    return own + len(m._global_forward_hooks) + len(m._global_forward_pre_hooks) + len(m._global_backward_hooks)


def test_no_mode_or_hook_outside_the_replay(run_dir: Path) -> None:
    """Healthy steps run with no dispatch mode, no anomaly mode and no hook beyond the watcher's own, and with no
    torch function mode but on a sampled step's forward call, which runs under the attention statistics' mode
    (gradwatch.step.attention) until a model that makes no attention call has shown it on 3 sampled steps;
    the replay of the anomalous step does use them (the spy sees them), then removes all."""
    spy = Spy()
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid(), spy, nn.Linear(4, 1))
    gw.watch(model, run=run_dir, console=False, rules=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    counts = []
    for step in range(6):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        counts.append(hooks(model))
        spy.in_loop, spy.negate = True, step == 3  # negated until the step's replay: it reproduces
        out = model(x)
        spy.in_loop = False
        loss = F.mse_loss(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    counts.append(hooks(model))
    gw.unwatch(model)
    in_loop = [s for s in spy.seen if s[0]]
    replayed = [s for s in spy.seen if not s[0]]
    # step 0 is sampled (every 10th is): the attention mode on the stack; none on the others
    assert len(in_loop) == 6 and [s[1:] for s in in_loop] == [(1, False, False)] + [(0, False, False)] * 5
    assert any(s[2] for s in replayed), "the op search runs under a dispatch mode"
    assert len(set(counts)) == 1, counts  # the replay's hooks are all gone
    assert torch._C._len_torch_function_stack() == 0 and _get_current_dispatch_mode() is None


def plain(run_dir: Path, model: nn.Module, plant: str) -> dict:
    """Train a few steps; at step 2 break the replay the way ``plant`` says; the finding's data."""
    gw.watch(model, run=run_dir, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(4):
        x, y = torch.rand(8, 4), torch.randn(8, 1)
        if step == 2:
            x[1, 0] = float("nan")
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if step == 2 and plant == "in_place":
            x.nan_to_num_(0.0)  # the loop reuses the batch's memory before the step
        opt.step()
    gw.unwatch(model)
    found = gw.open_run(run_dir).findings()
    return found[found.kind == "nonfinite"].iloc[0]


def test_inputs_changed_in_place_after_the_forward_are_not_replayed(run_dir: Path) -> None:
    row = plain(run_dir, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), "in_place")
    assert row.data["origin"] == "attributed" and "root_cause" not in row.data
    assert row.data["note"] == "the step was not replayed: its input batch was changed in place after the forward pass"
    assert "approximately: the step could not be replayed" in row.message and "replay_ms" not in row.data


class Once(nn.Module):
    """A forward with a side effect: a second call in the same step raises (a replay cannot run it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls % 2 == 0:
            raise RuntimeError("called twice in one step")
        return x


def test_a_forward_that_cannot_run_twice_falls_back_with_the_reason(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), Once(), nn.Linear(4, 1))
    gw.watch(model, run=run_dir, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        x, y = torch.rand(8, 4), torch.randn(8, 1)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if step == 1:
            model[0].weight.grad[0, 0] = float("inf")  # a NaN/Inf the step must be replayed to place
        opt.step()
        model[1].calls = 0  # the loop's own bookkeeping, once per step
    gw.unwatch(model)
    row = gw.open_run(run_dir).findings().iloc[0]
    assert row.data["origin"] == "attributed"
    assert row.data["note"] == "the step could not be replayed (RuntimeError: called twice in one step)"
    assert row.data["replay_ms"] > 0


# ------------------------------------------------------------------ facts

def test_facts_of_forward_culprits() -> None:
    x = torch.tensor([[-1.0, 0.0, 2.0], [3.0, 4.0, 5.0]])
    assert facts.forward("log", None, [x], {}, torch.log(x)) == (
        "1 of the input's 6 values is negative (min -1); 1 of the input's 6 values is exactly 0 (log 0 = -inf)")
    assert facts.forward("sqrt", None, [x], {}, torch.sqrt(x)) == "1 of the input's 6 values is negative (min -1)"
    z = torch.tensor([0.0, 4.0])
    assert facts.forward("rsqrt", None, [z], {}, torch.rsqrt(z)) == (
        "1 of the input's 2 values is exactly 0 (1/sqrt(0) = inf)")
    assert facts.forward("div", None, [torch.tensor([0.0, 1.0]), z], {}, torch.tensor([0.0, 1.0]) / z) == (
        "the divisor is 0 in 1 of its 2 values (0/0 in 1)")
    assert facts.forward("div", None, [z, 0], {}, z / 0) == "divides by the constant 0"
    big = torch.tensor([10.0, 100.0])
    assert facts.forward("exp", None, [big], {}, torch.exp(big)) == (
        "exp of values up to 100 overflows float32 (exp(x) > 3.4e+38 for x > 88.72)")
    assert facts.forward("pow", None, [torch.tensor([-8.0, 1.0]), 0.5], {}, torch.tensor([-8.0, 1.0]) ** 0.5) == (
        "a negative base to the fractional power 0.5: 1 of the 2 bases is negative (min -8)")
    assert facts.forward("pow", None, [torch.tensor([1e20]), 3], {}, torch.tensor([1e20]) ** 3) == (
        "|base|^3 overflows float32: the largest |base| is 1e+20")
    rows = torch.zeros(2, 3, 4)
    rows[1, 2] = -math.inf
    assert facts.forward("_softmax", None, [rows, -1, False], {}, torch.softmax(rows, -1)) == (
        "row [1, 2] of the input is all -inf (every position masked): softmax over it is 0/0")
    half = torch.tensor([7e4])
    assert facts.forward("_to_copy", None, [half], {}, half.half()) == (
        "values up to 7e+04 are cast to float16, whose largest value is 6.55e+04 (|x| > 6.55e+04 overflows)")
    a = torch.full((2, 2), 300.0, dtype=torch.float16)
    assert facts.forward("mm", torch.ops.aten.mm.default, [a, a], {}, a @ a) == (
        "float16 overflow: in float32 its result reaches 1.8e+05, beyond float16's largest value 6.55e+04 "
        "(|x| > 6.55e+04 is inf)")
    assert facts.forward("add", None, [z, z], {}, z + z) == "its inputs are finite (ranges [0, 4], [0, 4])"


def test_facts_of_backward_culprits() -> None:
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    g = (torch.ones(2),)
    assert facts.backward("LinalgVectorNormBackward0", "linalg_vector_norm", "norm", [x], g, None) == (
        "the norm's gradient x/‖x‖ is 0/0 where the norm is 0: 1 of its 2 vectors is all zero")
    s = torch.tensor([0.0, 1.0, 0.0])
    assert facts.backward("SqrtBackward0", "sqrt", "sqrt", [s], g, None) == (
        "sqrt's gradient 1/(2·sqrt(x)) is infinite at x = 0: 2 of its 3 inputs are 0")
    assert facts.backward("PowBackward0", "pow", "pow", [s, 0.5], g, None) == (
        "pow's gradient 0.5·x^(0.5-1) is infinite at x = 0: 2 of its 3 inputs are exactly 0")
    inp, w = torch.full((4, 2), 200.0, dtype=torch.float16), torch.ones(3, 2, dtype=torch.float16)
    grad = (torch.full((4, 3), 100.0, dtype=torch.float16),)
    assert facts.backward("AddmmBackward0", "addmm", "linear", [inp, w], grad, "fc.weight") == (
        "input^T @ grad_output overflows float16: max |input| 200 × max |grad| 100 summed over 4 rows reaches "
        "8e+04 (largest float16: 6.55e+04)")


def test_user_line_is_the_callers_line_outside_torch() -> None:
    line = user_line()
    assert line is not None and line.file == __file__ and line.code == "line = user_line()" and line.user


def test_sqrt_of_a_negative_value_in_float32_is_checked_in_float64(run_dir: Path) -> None:
    class Root(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sqrt()

    model = nn.Sequential(nn.Linear(4, 4), Root(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    gw.watch(model, run=run_dir, console=False)
    x = torch.rand(8, 4)
    x[6, 3] = -4.0
    F.mse_loss(model(x), torch.zeros(8, 1)).backward()
    torch.optim.SGD(model.parameters(), lr=0.01).step()
    gw.unwatch(model)
    row = gw.open_run(run_dir).findings().iloc[0]
    root = row.data["root_cause"]
    assert (root["op"], root["fact"], row.data["samples"]["indices"]) == (
        "aten::sqrt", "1 of the input's 32 values is negative (min -4)", [6])
    assert root["cause"] == "model" and root["precision_replay"] == "float64"


def test_model_cause_names_the_weights_that_grew(run_dir: Path) -> None:
    """Diverged weights make exp overflow even in float64: the cause is the model, and the weight that
    grew since watching began is named."""

    class Expo(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.exp(x)

    model = nn.Sequential(nn.Linear(4, 4), Expo(), nn.Linear(4, 1))
    gw.watch(model, run=run_dir, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for step in range(4):
        if step == 3:
            with torch.no_grad():
                model[0].weight.mul_(1e4)  # the weights diverged
        x, y = torch.rand(8, 4) + 1.0, torch.randn(8, 1)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    gw.unwatch(model)
    row = gw.open_run(run_dir).findings().iloc[0]
    root = row.data["root_cause"]
    assert (root["op"], root["cause"], root["precision_replay"]) == ("aten::exp", "model", "float64")
    assert [d["param"] for d in root["grew"]] == ["0.weight"] and 9e3 < root["grew"][0]["ratio"] < 1.1e4
    assert "weights that grew: '0.weight' x" in row.message


def test_a_parameter_that_started_at_zero_is_not_named_as_grown_by_its_learning() -> None:
    """A bias initialised at zero that learned ordinary values is no diverged weight (a ratio to zero
    says nothing); a weight that grew 10x is, and so is a zero-started one that is no longer finite."""
    from gradwatch.rootcause.cause import grown
    from gradwatch.rootcause.diagnose import reference_norms

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
    nn.init.zeros_(model[2].bias)
    reference = reference_norms(model)
    with torch.no_grad():
        model[1].bias.add_(0.05)  # learned: norm 0 -> 0.4, "x5" of a floor of 0.08
        model[0].weight.mul_(10.0)
    assert [d["param"] for d in grown(model, reference)] == ["0.weight"]
    with torch.no_grad():
        model[2].bias[0] = float("inf")
    assert [d["param"] for d in grown(model, reference)] == ["2.bias", "0.weight"]


def test_capture_tells_inputs_changed_in_place_and_keeps_no_version_for_inference_tensors() -> None:
    from gradwatch.rootcause.capture import Capture, versions
    from gradwatch.rootcause.state import Autocast

    with torch.inference_mode():
        frozen = torch.ones(2)
    x = torch.zeros(3)
    cap = Capture.of((x, {"mask": frozen}), {}, [], Autocast())
    assert sorted(versions((x, frozen))) == [-1, x._version] and not cap.modified()
    x.add_(1.0)
    assert cap.modified()


def first_finding(model: nn.Module, run_dir: Path, loss_at: Callable[[int], torch.Tensor], *, lr: float,
                  observe: bool = True, **options: Any) -> Any:
    """Train four SGD steps on ``loss_at(step)`` (the loss observed unless ``observe`` is False) and
    return the run's first finding."""
    gw.watch(model, run=run_dir, console=False, **options)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(4):
        loss = loss_at(step)
        opt.zero_grad()
        loss.backward()
        if observe:
            gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)
    return gw.open_run(run_dir).findings().iloc[0]


def test_a_nan_loss_observed_names_the_samples_of_its_gradient(run_dir: Path) -> None:
    """log(1 - p) is -inf where a sample saturates the sigmoid: the observed loss is inf, the model's output
    finite; the rows of the loss's gradient that the step kept name the sample."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid())

    def loss_at(step: int) -> torch.Tensor:
        x = torch.rand(16, 8)
        if step == 2:
            x[5] = 1000.0
        return -torch.log(1 - model(x)).mean()

    row = first_finding(model, run_dir, loss_at, lr=0.1)
    assert (row.step, row.kind, row.data["samples"]["indices"]) == (2, "nonfinite", [5])
    assert row.message.startswith("The model's output is finite but the loss is NaN/Inf (born in the loss function) "
                                  "at step 2; samples to blame: sample 5;")


def test_nan_born_in_the_loss_names_the_samples_of_its_gradient(run_dir: Path) -> None:
    """sqrt(|out - y|) has an infinite gradient where the prediction is exact: the loss, not the model."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def loss_at(step: int) -> torch.Tensor:
        x, y = torch.rand(8, 4), torch.randn(8, 1)
        out = model(x)
        if step == 2:
            y[3] = out[3].detach()  # an exact prediction: d sqrt(|e|)/de is 0 * inf there
        return (out - y).abs().sqrt().mean()

    row = first_finding(model, run_dir, loss_at, lr=0.01)
    assert (row.step, row.phase, row.layer) == (2, "backward", None)
    assert row.data["root_cause"]["cause"] is None and row.data["samples"]["indices"] == [3]
    assert row.message.startswith("The gradient of the loss with respect to the model's output is already NaN/Inf "
                                  "(born in the loss) at step 2; samples to blame: sample 3; ")


def test_a_nan_in_every_row_blames_the_batch_not_a_list_of_all_its_samples(run_dir: Path) -> None:
    """A loss whose gradient is NaN in every row (sqrt of 0 for all: a GAN's minibatch-std of a collapsed
    batch) is not a few bad samples: the message says so instead of listing them all."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def loss_at(step: int) -> torch.Tensor:
        out = model(torch.rand(8, 4))
        y = out.detach().clone() if step == 2 else torch.randn(8, 1)
        return (out - y).abs().sqrt().mean()

    row = first_finding(model, run_dir, loss_at, lr=0.01, observe=False)
    assert (row.step, row.kind) == (2, "nonfinite") and row.data["samples"]["indices"] == list(range(8))
    assert "samples to blame: every sample of the batch (8): not a few bad samples" in row.message


def test_a_nan_through_the_gradient_of_a_second_output_is_not_called_faulty_hardware(run_dir: Path) -> None:
    """A VAE-style model returns (reconstruction, log-variance); the loss, not observed, overflows in
    exp(log-variance). The replay from the first output stays finite: that is not a fault of the
    hardware, the NaN came back through the other output's gradient."""

    class TwoOutputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.recon, self.logvar = nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.relu(self.body(x))
            return self.recon(h), self.logvar(h)

    torch.manual_seed(0)
    model = TwoOutputs()

    def loss_at(step: int) -> torch.Tensor:
        x = torch.rand(8, 4) * (1e4 if step == 2 else 1.0)
        recon, logvar = model(x)
        return F.mse_loss(recon, x) + logvar.exp().mean()  # exp overflows to inf at step 2

    row = first_finding(model, run_dir, loss_at, lr=1e-3, observe=False, rules=None)
    assert (row.kind, row.step, row.data["origin"]) == ("nonfinite", 2, "attributed")
    assert row.data["root_cause"]["cause"] is None
    assert row.message.startswith("NaN/Inf at step 2 was not reproduced by the replay")
    assert "the model returns more than one tensor" in row.message and "faulty hardware" not in row.message


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_a_large_output_gradient_is_reduced_to_a_finiteness_flag(bad: float | None) -> None:
    """Beyond KEEP_GRAD_NUMEL elements the step's output gradient is not kept, only whether it was finite."""
    from gradwatch.rootcause.capture import KEEP_GRAD_NUMEL, Capture
    from gradwatch.rootcause.locate import output_grad
    from gradwatch.rootcause.state import Autocast

    grad = torch.randn(KEEP_GRAD_NUMEL + 7, generator=torch.Generator().manual_seed(0))
    if bad is not None:
        grad[KEEP_GRAD_NUMEL // 3] = bad
    cap = Capture.of((), {}, [], Autocast())
    cap.keep_grad(grad)
    assert cap.grad is None
    assert bool(cap.grad_finite) == (bad is None)
    replayed, note = output_grad(cap, grad)
    assert (replayed is None) == (bad is not None)


def test_a_call_whose_own_output_went_nan_is_never_blamed_on_the_loss_function(tmp_path: Path) -> None:
    """MAML-style: the step's second forward call runs with other weights (torch.func.functional_call), which
    blow up at step 10, so its replay (with the module's own weights) stays finite while the loss is NaN.
    That call's output was Inf/NaN when it ran: the model made it, not the loss function."""
    torch.manual_seed(0)
    model = gw.watch(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1)), run=tmp_path / "run",
                     console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(12):
        x = torch.randn(8, 4)
        fast = {n: p * (1e30 if step == 10 else 1.0) for n, p in model.named_parameters()}
        loss = nn.functional.mse_loss(model(x), x[:, :1]) + nn.functional.mse_loss(
            torch.func.functional_call(model, fast, (x,)), x[:, :1])
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)
    found = gw.open_run(tmp_path / "run").findings()
    assert found[["step", "kind"]].values.tolist() == [[10, "nonfinite"]]
    message = found["message"].iloc[0]
    assert "loss function" not in message and "not reproducible" in message, message
