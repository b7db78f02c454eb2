"""Small by design is not vanishing: layer scales and zero-initialised gates.

Modern blocks multiply a residual branch by a parameter that starts tiny (ConvNeXt's and CaiT's layer
scale at 1e-6, timm's ``LayerScale`` leaf, ReZero's gate at 0, a ResNet's last BatchNorm weight of each
block at 0 with ``zero_init_residual``): the branch's gradients are that parameter times ordinary ones,
a millionth of the others' while it is that small, which a long warmup from 0 keeps for hundreds of steps.
Trained the way their recipes do (AdamW, a per-iteration linear warmup from 0), these runs are healthy:
no warning, one info finding per gate. A constant of the same size (a buffer, not a parameter) explains
nothing, nor does a gate for the layers outside its module, nor a gate grown past ``GATE``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

import gradwatch as gw
from gradwatch.detectors.gates import GATE, gates, outer
from gradwatch.detectors.vanishing import Vanishing
from gradwatch.store.records import LAYER, PARAM, Layout, StepRecord

STEPS = 20


class Scaled(nn.Module):
    """x + scale * mlp(norm(x)), the scale a parameter on the block (ConvNeXt) or a constant buffer."""

    def __init__(self, dim: int, init: float, learned: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        if learned:
            self.gamma = nn.Parameter(init * torch.ones(dim))
        else:
            self.register_buffer("gamma", init * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x)) * self.gamma


class LayerScale(nn.Module):
    """timm's: a leaf module holding the scale, beside the branch it scales."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(init * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class TimmBlock(nn.Module):
    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.ls1 = LayerScale(dim, init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ls1(self.mlp(self.norm1(x)))


class Bottleneck(nn.Module):
    """A residual block whose last BatchNorm weight starts at 0 (torchvision's ``zero_init_residual``)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def classify(model: nn.Module, run: Path, inputs: tuple[int, ...], *, warmup: int = 25_000) -> gw.Run:
    """AdamW at 4e-3 under a per-iteration linear warmup from 0 (ConvNeXt's recipe), 10 classes."""
    gw.watch(model, run=run, console=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: min(1.0, it / warmup))
    gen = torch.Generator().manual_seed(0)
    templates = torch.randn(10, *inputs, generator=gen)
    for _ in range(STEPS):
        y = torch.randint(0, 10, (32,), generator=gen)
        x = templates[y] + torch.randn(32, *inputs, generator=gen)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        optimizer.step()
        schedule.step()
    gw.unwatch(model)
    return gw.open_run(run)


def mlp_with(block: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), block, nn.LayerNorm(32), nn.Linear(32, 10))
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
    return model


def findings(run: gw.Run, kind: str = "vanishing") -> list[dict]:
    return [f for f in run.findings().to_dict("records") if f["kind"] == kind]


def loud(run: gw.Run) -> list[tuple[str, int, str]]:
    return [(f["kind"], f["step"], f["layer"]) for f in run.findings().to_dict("records") if f["severity"] != "info"]


def test_a_layer_scale_on_its_block_is_small_by_design(tmp_path: Path) -> None:
    run = classify(mlp_with(Scaled(32, 1e-6)), tmp_path / "run", (32,))
    assert loud(run) == []
    (info,) = findings(run)
    assert (info["severity"], info["step"], info["data"]["gate"]) == ("info", 9, "1.gamma")
    assert info["data"]["layers"] == ["1.norm", "1.mlp.0", "1.mlp.2"]
    assert info["data"]["gate_rms"] <= GATE and "small by design" in info["message"]


def test_the_same_scale_as_a_constant_is_vanishing(tmp_path: Path) -> None:
    """A buffer is no gate: nothing grows it, and the branch's gradients stay a millionth for good."""
    run = classify(mlp_with(Scaled(32, 1e-6, learned=False)), tmp_path / "run", (32,))
    assert [(kind, step, layer) for kind, step, layer in loud(run)] == [("vanishing", 9, "1.norm")]
    (found,) = [f for f in findings(run) if f["severity"] != "info"]  # one cause, one finding naming its layers
    assert found["data"]["layers"] == ["1.norm", "1.mlp.0", "1.mlp.2"]


def test_timms_layer_scale_leaf_scales_the_layers_of_its_parent(tmp_path: Path) -> None:
    run = classify(mlp_with(TimmBlock(32, 1e-6)), tmp_path / "run", (32,))
    assert loud(run) == []
    (info,) = findings(run)
    assert info["data"]["gate"] == "1.ls1.gamma"
    assert info["data"]["layers"] == ["1.norm1", "1.mlp.0", "1.mlp.2"]


def test_a_residual_blocks_last_batchnorm_at_zero_is_small_by_design(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), Bottleneck(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 10))
    run = classify(model, tmp_path / "run", (3, 8, 8))
    assert loud(run) == []
    assert {f["data"]["gate"] for f in findings(run)} <= {"1.bn2.weight"}


def gated_layout() -> Layout:
    """(root) owns a token; block 'b' owns a scale and holds two Linears; leaf 'ls' (under the root) owns one."""
    layers = ("(root)", "b", "b.fc", "b.out", "ls", "head")
    params = ("token", "b.gamma", "b.fc.weight", "b.fc.bias", "b.out.weight", "ls.gamma", "head.weight")
    owners = ((0, 0), (1, 1), (2, 2), (2, 3), (3, 4), (4, 5), (5, 6))
    return Layout(version=1, layers=layers, layer_types=("Net", "Block", "Linear", "Linear", "LayerScale", "Linear"),
                  layer_numel=(4, 4, 20, 4, 4, 4), params=params, param_numel=(4, 4, 16, 4, 4, 4, 4), owners=owners,
                  leaves=(2, 3, 4, 5), trainable=(True,) * len(params))


def test_which_parameters_are_gates() -> None:
    """Tiny, trainable, not a bias, below the root: a token on the root, a zero bias, a leaf right under the
    root and a parameter of ordinary size are none."""
    sizes = np.array([1e-6, 1e-6, 0.1, 0.0, 0.1, 1e-6, 0.0])
    found = gates(gated_layout(), sizes)
    assert list(found) == [1]
    assert [gated_layout().layers[i] for i in found[1]] == ["b.fc", "b.out"]


def test_a_gate_grown_past_its_bound_explains_nothing() -> None:
    """While 'b.gamma' is 1e-6 the small layers of 'b' are small by design; grown to 1e-2 (their gradients
    still a millionth of the head's, the cause elsewhere) they are vanishing again, 10 steps on."""
    layout = gated_layout()
    detector = Vanishing()
    small = np.array([np.nan, 1.0, 1e-5, 1e-5, 1.0, 1.0], dtype=np.float32)
    weights = np.array([1.0, 2e-6, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=np.float32)  # b.gamma: RMS 1e-6
    out = []
    for step in range(40):
        if step == 20:
            weights[1] = 2e-2  # grown: RMS 1e-2
        vectors = {(LAYER, "grad_norm"): small, (LAYER, "grad_nonfinite"): np.zeros(6, dtype=np.float32),
                   (PARAM, "grad_nonfinite"): np.zeros(7, dtype=np.float32)}
        if step % 10 == 0:
            vectors[(PARAM, "param_norm")] = weights
        out += detector.check(StepRecord(step=step, time=0.0, layout=layout, scalars={"grad_norm": 1.7},
                                         vectors=vectors))
    assert [(f.severity, f.step) for f in out if f.layer == "b.fc"][:2] == [("info", 9), ("warning", 29)]


def test_a_gates_scope_widens_past_modules_that_hold_only_gates() -> None:
    """PEFT's ``q.lora_B`` (a ModuleDict holding the zero ``default``) holds no other weights: the gate scales
    the layers of ``q`` (``lora_A``, the frozen base). A ModuleList of zero convolutions likewise widens to
    the module that holds it."""
    layers = ("q", "q.base", "q.lora_A.default", "q.lora_B.default", "c", "c.enc", "c.zero.0", "c.zero.1")
    params = ("q.base.weight", "q.lora_A.default.weight", "q.lora_B.default.weight", "c.enc.weight",
              "c.zero.0.weight", "c.zero.1.weight")
    owners = ((1, 0), (2, 1), (3, 2), (5, 3), (6, 4), (7, 5))
    layout = Layout(version=1, layers=layers, layer_types=("Linear",) * 8, layer_numel=(0, 4, 4, 4, 0, 4, 4, 4),
                    params=params, param_numel=(4,) * 6, owners=owners, leaves=(1, 2, 3, 5, 6, 7),
                    trainable=(False, True, True, True, True, True))
    found = gates(layout, np.array([0.5, 0.5, 0.0, 0.5, 0.0, 0.0]))
    assert {layout.params[p]: [layout.layers[i] for i in found[p]] for p in found} == {
        "q.lora_B.default.weight": ["q.base", "q.lora_A.default"],
        "c.zero.0.weight": ["c.enc", "c.zero.1"], "c.zero.1.weight": ["c.enc", "c.zero.0"]}


def output_gated_layout() -> Layout:
    """(root) holds 'body.0', 'body.1' (a Sequential 'body') and 'head', a leaf right under the root."""
    layers = ("(root)", "body", "body.0", "body.1", "head")
    params = ("body.0.weight", "body.1.weight", "head.weight")
    return Layout(version=1, layers=layers, layer_types=("Net", "Sequential", "Linear", "Linear", "Linear"),
                  layer_numel=(0, 0, 4, 4, 4), params=params, param_numel=(4, 4, 4), owners=((2, 0), (3, 1), (4, 2)),
                  leaves=(2, 3, 4), trainable=(True,) * 3)


def judged(layout: Layout, norms: list[float], weights: list[float], steps: int = 12, *,
           messages: bool = False) -> list:
    detector, out = Vanishing(), []
    for step in range(steps):
        vectors = {(LAYER, "grad_norm"): np.array([np.nan, np.nan, *norms], dtype=np.float32),  # leaves' only
                   (LAYER, "grad_nonfinite"): np.zeros(len(layout.layers), dtype=np.float32),
                   (PARAM, "grad_nonfinite"): np.zeros(len(weights), dtype=np.float32)}
        if step % 10 == 0:
            vectors[(PARAM, "param_norm")] = np.array(weights, dtype=np.float32)
        out += detector.check(StepRecord(step=step, time=0.0, layout=layout, scalars={"grad_norm": 1.0},
                                         vectors=vectors))
    return [f.message for f in out] if messages else [(f.severity, f.step, f.layer) for f in out]


def test_a_zero_output_layer_explains_a_model_below_the_absolute_floor() -> None:
    """A zero-initialised head (DiT's final layer; an output layer under a long warmup) scales every gradient
    upstream of it: all of them below 1e-10 while its own is ordinary is small by design. It explains no
    layer small beside the others, and nothing once its own gradient is below the floor too (the whole
    network's gradient has vanished: a saturated output, a loss scaled to nothing)."""
    layout = output_gated_layout()
    assert [layout.params[p] for p in outer(layout, np.array([0.5, 0.5, 1e-7]))] == ["head.weight"]
    assert [layout.params[p] for p in gates(layout, np.array([0.5, 0.5, 1e-7]))] == []
    weights = [1.0, 1.0, 2e-7]  # head.weight: RMS 1e-7
    assert judged(layout, [2e-12, 4e-12, 1.0], weights) == [("info", 9, "body.0")]
    # body.0 also 1e-9 of body.1's: small beside the others, which the head does not explain
    assert judged(layout, [4e-21, 4e-12, 1.0], weights) == [("info", 9, "body.1"), ("warning", 9, "body.0")]
    # the head's own gradient below the floor: the whole network's has vanished (one cause, one finding)
    assert judged(layout, [2e-12, 4e-12, 2e-12], weights) == [("warning", 9, "body.0")]
    # a warning from the floor says so: the layers are no smaller than the others
    assert judged(layout, [2e-12, 4e-12, 2e-12], weights, messages=True) == [
        "gradients of 3 layers (body.0, body.1, head; Linear) have vanished for 10 steps: RMS 1e-12 to "
        "2e-12, the smallest below the floor of 1e-10 (the median layer's is 1e-12)."]
    # grown past GATE, the head explains nothing
    assert judged(layout, [2e-12, 4e-12, 1.0], [1.0, 1.0, 0.2]) == [("warning", 9, "body.0")]
