"""Real models, real training steps: every recorded number is checked against a brute-force reference.

Each test trains a few steps of a small model with gradwatch attached, and computes the same
statistics itself, from the gradients and weights the optimizer actually saw (captured with the
optimizer's own step hooks) and from the activations its own forward hooks saw.
"""

from __future__ import annotations

import copy
import gc
import math
import warnings
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gradwatch as gw
from gradwatch.watching import registry

RTOL = 1e-5
ROOT = "(root)"


# --------------------------------------------------------------------------- brute-force references
class Reference:
    """Records what each optimizer step applied: the gradients and the weights before and after.

    Several optimizers stepping in one iteration make one step: a new step starts when an
    optimizer is about to update a parameter that the current step already holds.
    """

    def __init__(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> None:
        self.names = {id(p): n for n, p in model.named_parameters()}  # tied parameters once
        self.steps: list[dict[str, dict[str, torch.Tensor]]] = []
        for opt in optimizers:
            opt.register_step_pre_hook(self._pre)
            opt.register_step_post_hook(self._post)

    def _held(self, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
        return [(self.names[id(p)], p) for g in opt.param_groups for p in g["params"] if id(p) in self.names]

    def _pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        held = self._held(opt)
        if not self.steps or any(n in self.steps[-1]["before"] for n, _ in held):
            self.steps.append({"grad": {}, "before": {}, "after": {}})
        step = self.steps[-1]
        for name, p in held:
            step["before"][name] = p.detach().clone()
            if p.grad is not None:
                step["grad"][name] = p.grad.detach().clone()

    def _post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for name, p in self._held(opt):
            self.steps[-1]["after"][name] = p.detach().clone()


class Activations:
    """Outputs of chosen leaf modules in every grad-enabled forward call, per iteration."""

    def __init__(self, model: nn.Module, layers: Iterable[str]) -> None:
        self.calls: dict[str, list[torch.Tensor]] = {}
        self.iterations: list[dict[str, list[torch.Tensor]]] = []
        self.handles = [self._hook(model, name) for name in layers]

    def _hook(self, model: nn.Module, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                out = output[0] if isinstance(output, tuple) else output
                self.calls.setdefault(name, []).append(out.detach().float().clone())

        return module_at(model, name).register_forward_hook(hook)

    def end_iteration(self) -> None:
        self.iterations.append(self.calls)
        self.calls = {}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def module_at(model: nn.Module, layer: str) -> nn.Module:
    return model if layer == ROOT else model.get_submodule(layer)


def owned(model: nn.Module, layer: str) -> list[str]:
    """Names (as in ``named_parameters``) of the parameters a layer's module holds directly."""
    names = {id(p): n for n, p in model.named_parameters()}
    return list(dict.fromkeys(names[id(p)] for p in module_at(model, layer).parameters(recurse=False)))


def norm(tensors: Iterable[torch.Tensor]) -> float:
    """L2 norm of several tensors together, in float64."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def layer_norms(model: nn.Module, layers: Iterable[str], values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-layer L2 norm of per-parameter tensors; layers with none of their parameters in values are left out."""
    out = {}
    for layer in layers:
        mine = [values[n] for n in owned(model, layer) if n in values]
        if mine:
            out[layer] = norm(mine)
    return out


def global_norm(grads: dict[str, torch.Tensor]) -> float:
    return norm(grads.values())


def expected_layers(model: nn.Module) -> list[str]:
    """Brute force: modules that own a parameter, and leaf modules, in ``named_modules`` order."""
    return [name or ROOT for name, m in model.named_modules()
            if next(m.parameters(recurse=False), None) is not None or next(m.children(), None) is None]


def recorded(run: gw.Run, metric: str) -> dict[int, dict[str, float]]:
    """step -> layer -> value of one per-layer metric, as stored."""
    frame = run.metrics(metric, include_global=False)
    out: dict[int, dict[str, float]] = {}
    for step, layer, value in zip(frame["step"], frame["layer"], frame["value"], strict=True):
        out.setdefault(int(step), {})[layer] = float(value)
    return out


def assert_close(got: dict[str, float], want: dict[str, float], rtol: float = RTOL, what: str = "") -> None:
    assert set(got) == set(want), f"{what}: recorded layers {sorted(got)} != expected {sorted(want)}"
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rtol, abs=1e-7), f"{what}: {key}: {got[key]} != {value}"


def check_grad_norms(run: gw.Run, model: nn.Module, ref: Reference, steps: Iterable[int] | None = None,
                     rtol: float = RTOL) -> None:
    """Per-layer and global gradient norms at each recorded step equal those of the applied gradients."""
    steps = list(range(len(ref.steps))) if steps is None else list(steps)
    assert len(steps) == len(ref.steps)
    rec = recorded(run, "grad_norm")
    scalars = run.scalars()
    for step, applied in zip(steps, ref.steps, strict=True):
        grads = applied["grad"]
        assert_close(rec.get(step, {}), layer_norms(model, run.layers, grads), rtol, f"grad_norm@{step}")
        assert scalars.loc[step, "grad_norm"] == pytest.approx(global_norm(grads), rel=rtol)
        nonfinite = recorded(run, "grad_nonfinite")[step]
        assert set(nonfinite) == set(rec[step]) and not any(nonfinite.values())


def check_sampled(run: gw.Run, model: nn.Module, ref: Reference, steps: Iterable[int] | None = None,
                  rtol: float = RTOL) -> None:
    """grad_max, param_norm and update_ratio at each (sampled) step, against the applied step."""
    steps = list(range(len(ref.steps))) if steps is None else list(steps)
    assert len(steps) == len(ref.steps)
    grad_max, param_norm, ratio = (recorded(run, m) for m in ("grad_max", "param_norm", "update_ratio"))
    for step, applied in zip(steps, ref.steps, strict=True):
        grads, before, after = applied["grad"], applied["before"], applied["after"]
        want_max = {}
        for layer in run.layers:
            mine = [grads[n] for n in owned(model, layer) if n in grads]
            if mine:
                want_max[layer] = max(float(g.abs().max()) for g in mine)
        assert_close(grad_max[step], want_max, rtol, f"grad_max@{step}")
        trainable = {n: before[n] for n in before if n in grads}
        assert_close(param_norm[step], layer_norms(model, run.layers, before), rtol, f"param_norm@{step}")
        delta = {n: after[n] - before[n] for n in trainable}
        want_ratio = {}
        for layer, d in layer_norms(model, run.layers, delta).items():
            want_ratio[layer] = d / layer_norms(model, [layer], trainable)[layer]
        assert_close(ratio[step], want_ratio, 1e-4, f"update_ratio@{step}")


def check_activations(run: gw.Run, acts: Activations, steps: Iterable[int] | None = None,
                      saturating: dict[str, tuple[float, float]] | None = None, rtol: float = RTOL) -> None:
    """act_norm, act_zero_frac (and act_sat_frac of bounded layers) against our own forward hooks."""
    saturating = saturating or {}
    steps = list(range(len(acts.iterations))) if steps is None else list(steps)
    act_norm, zero, sat = (recorded(run, m) for m in ("act_norm", "act_zero_frac", "act_sat_frac"))
    for step, calls in zip(steps, acts.iterations, strict=True):
        outs = calls
        numel = {layer: sum(t.numel() for t in ts) for layer, ts in outs.items()}
        got_norm = {k: v for k, v in act_norm.get(step, {}).items() if k in outs}
        assert_close(got_norm, {k: norm(ts) for k, ts in outs.items()}, rtol, f"act_norm@{step}")
        want_zero = {k: sum(int((t == 0).sum()) for t in ts) / numel[k] for k, ts in outs.items()}
        got_zero = {k: v for k, v in zero.get(step, {}).items() if k in outs}
        assert_close(got_zero, want_zero, rtol, f"act_zero_frac@{step}")
        want_sat = {}
        for layer, (lo, hi) in saturating.items():
            mid, half = (lo + hi) / 2, (hi - lo) / 2
            want_sat[layer] = sum(int(((t - mid).abs() >= 0.98 * half).sum()) for t in outs[layer]) / numel[layer]
        assert_close(sat.get(step, {}), want_sat, rtol, f"act_sat_frac@{step}")


def train_loop(model: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[Any, Any]],
               loss_fn: Callable[[Any, Any], torch.Tensor], acts: Activations | None = None,
               observe: bool = True) -> list[float]:
    """zero_grad, forward, backward, observe(loss), step; returns the losses."""
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if observe:
            gw.watcher(model).observe(loss=loss)
        opt.step()
        losses.append(loss.item())
        if acts is not None:
            acts.end_iteration()
    return losses


def check_scalars(run: gw.Run, losses: list[float], lr: float) -> None:
    scalars = run.scalars()
    assert list(scalars.index) == list(range(len(losses)))
    assert scalars["loss"].tolist() == pytest.approx(losses, rel=RTOL)
    assert scalars["lr"].tolist() == pytest.approx([lr] * len(losses))


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
               + len(m._backward_pre_hooks) for m in model.modules())


def optimizer_hooks() -> tuple[int, int]:
    from torch.optim import optimizer as optim_mod

    return len(optim_mod._global_optimizer_pre_hooks), len(optim_mod._global_optimizer_post_hooks)


# ------------------------------------------------------------------------------------------- 1. MLP
def test_mlp_gradients_updates_and_activations(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
                          nn.Sigmoid(), nn.Linear(16, 3))
    with torch.no_grad():  # large pre-activations so that tanh and sigmoid saturate in part
        model[2].weight.mul_(6.0)
        model[4].weight.mul_(8.0)
    layers = ["0", "1", "2", "3", "4", "5", "6"]
    acts = Activations(model, layers)
    gw.watch(model, run=run_dir, sample_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref = Reference(model, opt)
    batches = [(torch.randn(32, 6), torch.randn(32, 3)) for _ in range(4)]
    losses = train_loop(model, opt, batches, F.mse_loss, acts)
    gw.unwatch(model)

    run = gw.open_run(run_dir)
    assert run.layers == layers == expected_layers(model)
    assert run.parameters == [f"{i}.{k}" for i in (0, 2, 4, 6) for k in ("weight", "bias")]
    assert run.steps == 4
    info = run.step_info()
    assert info["sampled"].all() and not info["skipped"].any()
    check_scalars(run, losses, 0.05)
    check_grad_norms(run, model, ref)
    check_sampled(run, model, ref)
    check_activations(run, acts, saturating={"3": (-1.0, 1.0), "5": (0.0, 1.0)})
    sat = recorded(run, "act_sat_frac")
    assert all(0 < sat[s]["3"] < 1 and 0 < sat[s]["5"] < 1 for s in range(4)), "the test must exercise saturation"
    assert all(0 < recorded(run, "act_zero_frac")[s]["1"] < 1 for s in range(4))


# ------------------------------------------------------------------------------------ 2. CNN with BN
class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.relu2 = nn.ReLU()
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu1(self.bn1(self.conv1(x))))
        x = self.gap(self.relu2(self.bn2(self.conv2(x))))
        return self.head(x.flatten(1))


def test_cnn_with_batchnorm(run_dir: Path) -> None:
    model = SmallCNN()
    layers = ["conv1", "bn1", "relu1", "pool", "conv2", "bn2", "relu2", "gap", "head"]
    acts = Activations(model, ["relu1", "relu2", "bn1", "pool"])
    gw.watch(model, run=run_dir, sample_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = Reference(model, opt)
    batches = [(torch.randn(8, 3, 12, 12), torch.randint(0, 4, (8,))) for _ in range(3)]
    losses = train_loop(model, opt, batches, F.cross_entropy, acts)
    gw.unwatch(model)

    run = gw.open_run(run_dir)
    assert run.layers == layers == expected_layers(model)
    assert "bn1.running_mean" not in run.parameters and "bn1.weight" in run.parameters
    assert run.steps == 3
    check_scalars(run, losses, 0.1)
    check_grad_norms(run, model, ref)
    check_sampled(run, model, ref)
    check_activations(run, acts)
    gn = recorded(run, "grad_norm")
    assert {"conv1", "bn1", "conv2", "bn2", "head"} == set(gn[0])  # only layers that own parameters


# ----------------------------------------------------------------------------------- 3. LSTM / GRU
class RNNModel(nn.Module):
    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = cell(5, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)  # a tuple: (output, h_n) or (output, (h_n, c_n))
        return self.head(out[:, -1])


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_recurrent_models(cell: type[nn.Module], run_dir: Path) -> None:
    model = RNNModel(cell)
    acts = Activations(model, ["rnn", "head"])
    gw.watch(model, run=run_dir, sample_every=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref = Reference(model, opt)
    batches = [(torch.randn(4, 7, 5), torch.randn(4, 2)) for _ in range(3)]
    losses = train_loop(model, opt, batches, F.mse_loss, acts)
    gw.unwatch(model)

    run = gw.open_run(run_dir)
    assert run.layers == ["rnn", "head"] == expected_layers(model)
    assert run.parameters == [n for n, _ in model.named_parameters()]
    assert len(run.parameters) == 2 * 4 + 2  # per recurrent layer: weight_ih, weight_hh, bias_ih, bias_hh
    assert run.steps == 3
    check_scalars(run, losses, 1e-2)
    check_grad_norms(run, model, ref)
    check_sampled(run, model, ref)
    check_activations(run, acts)  # the rnn's activation is the output sequence (first of the tuple)


# ---------------------------------------------------------------------------------- 4. Transformer
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(dim=1))


def test_transformer_encoder(run_dir: Path) -> None:
    model = Encoder().train()
    gw.watch(model, run=run_dir, sample_every=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = Reference(model, opt)
    batches = [(torch.randn(4, 6, 8), torch.randint(0, 3, (4,))) for _ in range(3)]
    losses = train_loop(model, opt, batches, F.cross_entropy)
    gw.unwatch(model)

    run = gw.open_run(run_dir)
    assert run.layers == expected_layers(model)
    for i in (0, 1):
        for name in ("self_attn", "self_attn.out_proj", "linear1", "dropout", "linear2", "norm1", "norm2",
                     "dropout1", "dropout2"):
            assert f"encoder.layers.{i}.{name}" in run.layers
    assert run.layers[0] == "embed" and run.layers[-1] == "head"
    assert "encoder.layers.0.self_attn.in_proj_weight" in run.parameters
    assert run.steps == 3
    check_scalars(run, losses, 1e-3)
    check_grad_norms(run, model, ref)
    check_sampled(run, model, ref)
    gn = recorded(run, "grad_norm")[0]
    assert gn["encoder.layers.0.self_attn"] == pytest.approx(
        norm([ref.steps[0]["grad"]["encoder.layers.0.self_attn.in_proj_weight"],
              ref.steps[0]["grad"]["encoder.layers.0.self_attn.in_proj_bias"]]), rel=RTOL)


# ------------------------------------------------------------------------------------ 5. HF GPT-2
@pytest.mark.slow  # a GPT-2 from transformers
def test_huggingface_gpt2_with_tied_embeddings(run_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    assert model.lm_head.weight is model.transformer.wte.weight
    gw.watch(model, run=run_dir, sample_every=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = Reference(model, opt)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 100, (2, 16))
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
        losses.append(loss.item())
    gw.unwatch(model)

    run = gw.open_run(run_dir)
    assert run.layers == expected_layers(model)
    assert {"transformer.wte", "transformer.wpe", "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc",
            "transformer.ln_f", "lm_head"} <= set(run.layers)
    assert run.parameters == [n for n, _ in model.named_parameters()]
    assert "transformer.wte.weight" in run.parameters and "lm_head.weight" not in run.parameters
    assert run.steps == 3
    check_scalars(run, losses, 1e-3)
    check_grad_norms(run, model, ref)
    check_sampled(run, model, ref)
    gn = recorded(run, "grad_norm")
    scalars = run.scalars()
    for step, applied in enumerate(ref.steps):
        tied = norm([applied["grad"]["transformer.wte.weight"]])
        assert gn[step]["transformer.wte"] == pytest.approx(tied, rel=RTOL)
        assert gn[step]["lm_head"] == gn[step]["transformer.wte"]
        once = math.sqrt(sum(norm([g]) ** 2 for g in applied["grad"].values()))
        assert scalars.loc[step, "grad_norm"] == pytest.approx(once, rel=RTOL)
        assert scalars.loc[step, "grad_norm"] != pytest.approx(math.sqrt(once**2 + tied**2), rel=1e-3)


# ------------------------------------------------------------------------------ 6. tied parameters
class ReusedLinear(nn.Module):
    """One Linear applied twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.shared = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.shared(self.act(self.shared(self.act(self.inp(x))))))


class SharedWeight(nn.Module):
    """Two Linear modules with one weight (own biases), plus a parameter of the root."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.scale


@pytest.mark.parametrize(
    ("factory", "layers", "params"),
    [
        (ReusedLinear, ["inp", "shared", "act", "out"],
         ["inp.weight", "inp.bias", "shared.weight", "shared.bias", "out.weight", "out.bias"]),
        (SharedWeight, [ROOT, "a", "b"], ["scale", "a.weight", "a.bias", "b.bias"]),
    ],
    ids=["module-used-twice", "weight-shared-by-two-modules"],
)
def test_tied_parameters(factory: Callable[[], nn.Module], layers: list[str], params: list[str],
                         run_dir: Path) -> None:
    model = factory()
    acts = Activations(model, [n for n in ("shared", "a", "b") if n in layers])
    gw.watch(model, run=run_dir, sample_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = Reference(model, opt)
    n_in, n_out = (4, 2) if factory is ReusedLinear else (8, 8)
    batches = [(torch.randn(16, n_in), torch.randn(16, n_out)) for _ in range(3)]
    losses = train_loop(model, opt, batches, F.mse_loss, acts)
    gw.unwatch(model)

    run = gw.open_run(run_dir)
    assert run.layers == layers == expected_layers(model)
    assert run.parameters == params
    assert run.steps == 3
    check_scalars(run, losses, 0.1)
    check_grad_norms(run, model, ref)  # the global norm counts each tied parameter once
    check_sampled(run, model, ref)
    check_activations(run, acts)  # a module called twice: both calls make its activation statistics
    gn = recorded(run, "grad_norm")
    for step, applied in enumerate(ref.steps):
        g = applied["grad"]
        if factory is SharedWeight:
            assert gn[step]["a"] == pytest.approx(norm([g["a.weight"], g["a.bias"]]), rel=RTOL)
            assert gn[step]["b"] == pytest.approx(norm([g["a.weight"], g["b.bias"]]), rel=RTOL)
            assert gn[step][ROOT] == pytest.approx(norm([g["scale"]]), rel=RTOL)
        else:
            assert len(acts.iterations[step]["shared"]) == 2


# --------------------------------------------------------------------------------- 7. frozen layers
def test_frozen_parameters(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    model[2].bias.requires_grad_(False)
    gw.watch(model, run=run_dir, sample_every=1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref = Reference(model, opt)
    frozen_before = model[0].weight.detach().clone()
    batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]
    losses = train_loop(model, opt, batches, F.mse_loss)
    gw.unwatch(model)

    run = gw.open_run(run_dir)
    assert run.layers == ["0", "1", "2", "3", "4"]
    assert run.steps == 3
    check_scalars(run, losses, 0.1)
    check_grad_norms(run, model, ref)
    check_sampled(run, model, ref)
    for step in range(3):
        assert set(recorded(run, "grad_norm")[step]) == {"2", "4"}
        assert recorded(run, "grad_norm")[step]["2"] == pytest.approx(
            norm([ref.steps[step]["grad"]["2.weight"]]), rel=RTOL)
    assert run.matrix("grad_norm")["0"].isna().all()
    assert torch.equal(model[0].weight, frozen_before)


def test_all_parameters_frozen_is_refused(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).requires_grad_(False)
    with pytest.raises(gw.ConfigError, match=r"(?i)frozen|trainable"):
        gw.watch(model, run=run_dir)
    assert not registry._live and hook_count(model) == 0


# ------------------------------------------------------------------------- 8. gradient accumulation
def test_gradient_accumulation(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1))
    acts = Activations(model, ["1"])
    gw.watch(model, run=run_dir, sample_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref = Reference(model, opt)
    micro = 4
    mean_losses = []
    for _ in range(3):
        step_losses = []
        for _ in range(micro):
            x, y = torch.randn(8, 5), torch.randn(8, 1)
            loss = F.mse_loss(model(x), y)
            (loss / micro).backward()
            gw.watcher(model).observe(loss=loss)
            step_losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        acts.end_iteration()
        mean_losses.append(sum(step_losses) / micro)
    gw.unwatch(model)

    run = gw.open_run(run_dir)
    assert run.steps == 3
    assert not run.step_info()["skipped"].any()
    check_scalars(run, mean_losses, 0.05)
    check_grad_norms(run, model, ref)  # the norm of the accumulated gradient
    check_sampled(run, model, ref)
    check_activations(run, acts)  # all micro-batches' activations belong to the step
    assert all(len(calls["1"]) == micro for calls in acts.iterations)


# ---------------------------------------------------------------------------------- 9. bf16 autocast
def test_bf16_autocast_on_cpu(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    acts = Activations(model, ["0", "1", "3"])
    gw.watch(model, run=run_dir, sample_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref = Reference(model, opt)
    losses = []
    for _ in range(3):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            assert out.dtype == torch.bfloat16
            loss = F.mse_loss(out.float(), y)
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
        losses.append(loss.item())
        acts.end_iteration()
    gw.unwatch(model)

    run = gw.open_run(run_dir)
    assert run.steps == 3
    check_scalars(run, losses, 0.05)
    check_grad_norms(run, model, ref)
    check_sampled(run, model, ref)
    check_activations(run, acts, saturating={"3": (-1.0, 1.0)}, rtol=1e-3)
    frame = run.metrics(include_global=False)
    assert len(frame) and frame["value"].map(math.isfinite).all()
    assert set(frame["metric"]) >= {"grad_norm", "grad_max", "param_norm", "update_ratio", "act_norm",
                                    "act_zero_frac", "act_sat_frac"}


# ---------------------------------------------------------------------------------- 10. GradScaler
@pytest.mark.parametrize("zero_grad", ["before", "after"])
def test_grad_scaler_unscaled_norms_and_skipped_overflow(zero_grad: str, run_dir: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    assert scaler.is_enabled(), "GradScaler('cpu') is usable in this torch"
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    gw.watch(model, run=run_dir, sample_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref = Reference(model, opt)
    iterations, bad = 5, 2
    unscaled: list[dict[str, torch.Tensor]] = []
    losses = []
    for it in range(iterations):
        x, y = torch.randn(8, 6), torch.randn(8, 2)
        if it == bad:
            x[0, 0] = float("inf")
        if zero_grad == "before":
            opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        gw.watcher(model).observe(loss=loss)
        scale = scaler.get_scale()
        unscaled.append({n: p.grad.detach().clone() / scale for n, p in model.named_parameters()})
        scaler.step(opt)
        scaler.update()
        if zero_grad == "after":
            opt.zero_grad()
        losses.append(loss.item())
    assert scaler.get_scale() < 2.0**16, "the overflow made the scaler back off"
    gw.unwatch(model)

    run = gw.open_run(run_dir)
    assert run.steps == iterations
    info = run.step_info()
    assert info["step"].tolist() == list(range(iterations))
    assert info["skipped"].tolist() == [it == bad for it in range(iterations)]
    good = [it for it in range(iterations) if it != bad]
    assert len(ref.steps) == len(good)  # the optimizer really stepped only on the good iterations
    check_grad_norms(run, model, ref, steps=good)
    check_sampled(run, model, ref, steps=good)
    gn = recorded(run, "grad_norm")
    assert bad not in gn, "a skipped step records no gradient statistics"
    for it in good:  # recorded norms are those of the unscaled gradients
        assert_close(gn[it], layer_norms(model, run.layers, unscaled[it]), RTOL, f"unscaled@{it}")
        assert gn[it]["0"] < 1e3
    scalars = run.scalars()
    assert scalars.loc[good, "loss"].tolist() == pytest.approx([losses[i] for i in good], rel=RTOL)
    assert scalars.loc[good, "lr"].tolist() == pytest.approx([0.05] * len(good))
    assert set(recorded(run, "update_ratio")) == set(good)


def _scaler_loop(model: nn.Module, opt: torch.optim.Optimizer, iterations: int, bad: int,
                 acts: Activations | None = None) -> None:
    """GradScaler training, zero_grad after the step, an inf in the batch of iteration ``bad``."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for it in range(iterations):
        x, y = torch.randn(8, 6), torch.randn(8, 2)
        if it == bad:
            x[0, 0] = float("inf")
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        gw.watcher(model).observe(loss=loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if acts is not None:
            acts.end_iteration()


def test_grad_scaler_overflow_on_last_iteration_is_recorded(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    gw.watch(model, run=run_dir)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _scaler_loop(model, opt, iterations=5, bad=4)  # zero_grad after the step: the gradients are gone
    assert all(p.grad is None for p in model.parameters())
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    assert run.steps == 5
    assert run.step_info()["skipped"].tolist() == [False, False, False, False, True]


def test_activations_on_the_sampled_step_after_a_skipped_step(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    acts = Activations(model, ["0", "1", "2"])
    gw.watch(model, run=run_dir, sample_every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _scaler_loop(model, opt, iterations=4, bad=1, acts=acts)
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    info = run.step_info()
    assert info["skipped"].tolist() == [False, True, False, False]
    assert info["sampled"].tolist() == [True, False, True, False]
    sampled = copy.copy(acts)
    sampled.iterations = [acts.iterations[0], acts.iterations[2]]
    check_activations(run, sampled, steps=[0, 2])  # step 2 is sampled and not skipped: it has activations


# ------------------------------------------------------------------------------- 11. torch.compile
@pytest.mark.slow  # torch.compile compiles twice
def test_torch_compile_both_ways(tmp_path: Path) -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    torch._dynamo.reset()
    batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]
    for variant in ("watch-compiled", "compile-watched"):
        run_dir = tmp_path / variant
        model = make()
        if variant == "watch-compiled":
            compiled = gw.watch(torch.compile(model), run=run_dir, sample_every=1)
        else:
            compiled = torch.compile(gw.watch(model, run=run_dir, sample_every=1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref = Reference(model, opt)
        losses = train_loop(compiled, opt, batches, F.mse_loss)
        gw.unwatch(compiled)

        run = gw.open_run(run_dir)
        assert run.layers == ["0", "1", "2"], variant
        assert run.steps == 3, variant
        check_scalars(run, losses, 0.1)
        check_grad_norms(run, model, ref)
        check_sampled(run, model, ref)
        metrics = set(run.metrics(include_global=False)["metric"])
        assert {"grad_norm", "grad_max", "param_norm", "update_ratio"} <= metrics, variant
        if variant == "watch-compiled":  # the leaf hooks are in the compiled graph (tests/test_compile.py)
            assert {"act_norm", "act_zero_frac"} <= metrics, variant
        else:  # the hooks were traced with the model: none is registered in time to be in its graph
            assert not metrics & {"act_norm", "act_zero_frac", "act_sat_frac"}, variant
        assert hook_count(model) == 0 and hook_count(compiled) == 0


# ------------------------------------------------------------------------------ 12. two optimizers
def test_two_optimizers_make_one_step(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    gw.watch(model, run=run_dir, sample_every=1)
    body = torch.optim.SGD([*model[0].parameters(), *model[2].parameters()], lr=0.1, momentum=0.9)
    head = torch.optim.Adam(model[4].parameters(), lr=1e-2)
    ref = Reference(model, body, head)
    losses = []
    for _ in range(4):
        x, y = torch.randn(8, 6), torch.randn(8, 3)
        body.zero_grad()
        head.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        body.step()
        head.step()
        losses.append(loss.item())
    gw.unwatch(model)

    run = gw.open_run(run_dir)
    assert len(ref.steps) == 4
    assert run.steps == 4
    assert run.scalars()["loss"].tolist() == pytest.approx(losses, rel=RTOL)
    check_grad_norms(run, model, ref)
    check_sampled(run, model, ref)
    for step in range(4):
        assert set(recorded(run, "grad_norm")[step]) == {"0", "2", "4"}
        assert set(recorded(run, "update_ratio")[step]) == {"0", "2", "4"}


# ------------------------------------------------------------------------------ 13. watching twice
def test_watching_twice_is_one_watcher(tmp_path: Path) -> None:
    batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]
    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    once, twice = copy.deepcopy(base), copy.deepcopy(base)

    gw.watch(once, run=tmp_path / "once", sample_every=1)
    hooks_once, opt_hooks_once = hook_count(once), optimizer_hooks()
    train_loop(once, torch.optim.SGD(once.parameters(), lr=0.1), batches, F.mse_loss)
    gw.unwatch(once)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same run directory again: no warning, nothing to do
        assert gw.watch(twice, run=tmp_path / "twice", sample_every=1) is twice
        assert gw.watch(twice, run=tmp_path / "twice", sample_every=1) is twice
    assert len(registry._live) == 1
    assert hook_count(twice) == hooks_once
    assert optimizer_hooks() == opt_hooks_once
    opt = torch.optim.SGD(twice.parameters(), lr=0.1)
    ref = Reference(twice, opt)
    train_loop(twice, opt, batches, F.mse_loss)
    gw.unwatch(twice)

    a, b = gw.open_run(tmp_path / "once"), gw.open_run(tmp_path / "twice")
    assert a.steps == b.steps == 3
    check_grad_norms(b, twice, ref)
    for metric in ("grad_norm", "param_norm", "update_ratio", "act_norm"):
        assert recorded(a, metric) == recorded(b, metric), metric
    assert a.scalars()["loss"].tolist() == b.scalars()["loss"].tolist()


# ----------------------------------------------------------------------------------- 14. unwatch
def test_unwatch_removes_every_hook_and_frees_the_model(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    before = optimizer_hooks()
    gw.watch(model, run=run_dir, sample_every=1)
    assert optimizer_hooks() != before and hook_count(model) > 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # end in the middle of an iteration, with activation hooks attached for the next sampled step
    train_loop(model, opt, [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)], F.mse_loss)
    model(torch.randn(8, 4)).sum().backward()
    gw.unwatch(model)

    for name, module in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs"):
            assert not getattr(module, attr), f"{name or ROOT}.{attr}"
    for name, p in model.named_parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None), name
        assert not getattr(p, "_backward_hooks", None), name
    assert optimizer_hooks() == before
    assert not registry._live and gw.unwatch(model) is None  # idempotent
    with pytest.raises(gw.ConfigError):
        gw.watcher(model)
    assert gw.open_run(run_dir).status == "finished"

    ref = weakref.ref(model)
    del model, opt
    gc.collect()
    assert ref() is None, "the unwatched model is still referenced"


# ---------------------------------------------------------------------------- 15. class decorator
def test_class_decorator_watches_every_instance(run_dir: Path) -> None:
    @gw.watch(run=run_dir, sample_every=1)
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(4, 8)
            self.act = nn.ReLU()
            self.fc2 = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.act(self.fc1(x)))

    class Bigger(Net):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Linear(2, 2)  # added after the decorated __init__ returned

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.extra(super().forward(x))

    first, second, bigger = Net(), Net(), Bigger()
    refs = {}
    for model in (first, second, bigger):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        refs[id(model)] = Reference(model, opt)
        batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_loop(model, opt, batches, F.mse_loss)
        if model is not first:
            assert any("in use by another watched model" in str(w.message) for w in caught)
    dirs = [gw.watcher(m).run_dir for m in (first, second, bigger)]
    assert dirs == [run_dir, run_dir.with_name(f"{run_dir.name}-1"), run_dir.with_name(f"{run_dir.name}-2")]
    for m in (first, second, bigger):
        gw.unwatch(m)

    for model, d in zip((first, second, bigger), dirs, strict=True):
        run = gw.open_run(d)
        want = ["fc1", "act", "fc2"] + (["extra"] if model is bigger else [])
        assert run.layers == want == expected_layers(model)
        assert run.steps == 3
        check_grad_norms(run, model, refs[id(model)])
        check_sampled(run, model, refs[id(model)])
    assert hook_count(first) == hook_count(bigger) == 0


# -------------------------------------------------------------------------------- 16. no side effects
def test_training_is_bitwise_identical_with_and_without_gradwatch(run_dir: Path) -> None:
    def make() -> nn.Module:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.Tanh(),
                             nn.Linear(32, 3))

    batches = [(torch.randn(16, 6), torch.randn(16, 3)) for _ in range(5)]

    def fit(model: nn.Module, watched: bool) -> list[float]:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(7)  # the same dropout masks, unless something draws from the generator
        return train_loop(model, opt, batches, F.mse_loss, observe=watched)

    plain = make()
    plain_losses = fit(plain, watched=False)
    watched = gw.watch(make(), run=run_dir, sample_every=1)
    watched_losses = fit(watched, watched=True)
    gw.unwatch(watched)

    assert watched_losses == plain_losses
    for (name, a), b in zip(plain.named_parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert gw.open_run(run_dir).steps == 5
