"""A zoo of small, seeded, CPU-fast training setups ("cases") for the detector tests.

Each :class:`Case` builds its own model, optimizer and (optional) LR scheduler with a fixed seed,
produces a deterministic batch for every step from its own ``torch.Generator``, and says which
pathology it plants (``kind``), where (``layer``: a path of ``model.named_modules()``, None for a
global pathology) and when (``onset``: the 0-based optimizer step at which it first appears).

``HEALTHY`` cases train normally and must show no pathology; ``PATHOLOGIES`` holds one case per
planted pathology. ``tests/test_zoo.py`` checks every claim here with plain PyTorch (hooks,
``torch.isfinite``); this module does not import gradwatch.

Conventions of the pathological cases:

* ``onset`` is the step of the *first* occurrence. Activation / update pathologies present from
  the start (dead units, saturation, update ratio, vanishing, unused parameters) have onset 0
  and persist for every step of the case.
* Non-finite cases run ``onset + 20`` steps: without intervention everything after ``onset`` is
  NaN (the bad update poisons the weights); a rule that skips the step keeps training healthy.
* Every other case stays finite for all its steps.
* Some pathologies unavoidably bring others along (what a detector test may also see):
  ``exploding_*`` and ``loss_spike_corrupt_batch`` -- both a loss spike and a gradient explosion
  at ``onset``; ``dead_relu_bias`` -- ``fc1`` gets exactly-zero gradients (vanishing);
  ``vanishing_deep_sigmoid`` -- all of ``layers.0`` .. ``layers.12`` vanish (``layers.0`` is
  the deepest, the named one), and their updates are below 1e-8 of their weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Built = tuple[nn.Module, torch.optim.Optimizer, Any]


@dataclass
class Case:
    """One training setup. See the module docstring."""

    name: str
    build: Callable[[], Built]  # (model, optimizer, lr scheduler or None); seeds itself
    batch: Callable[[int], tuple[Any, Any]]  # step -> (model input (tensor or tuple of args), target)
    loss: Callable[[Any, Any], torch.Tensor]  # (model output, target) -> scalar loss
    steps: int  # optimizer steps to run
    kind: str | None = None  # planted pathology kind (None for healthy cases)
    layer: str | None = None  # module path where it is born / shows; None = global
    onset: int | None = None  # 0-based optimizer step at which it first appears
    phase: str | None = None  # for nonfinite: "forward" or "backward"

    def __repr__(self) -> str:  # short ids in pytest output
        return f"Case({self.name})"


def run(
    case: Case,
    *,
    observe: Callable[[torch.Tensor], None] | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:
    """Train ``case`` with a plain loop and return (model, optimizer, loss per step).

    Per step: ``x, y = case.batch(step)``; ``opt.zero_grad()``; ``out = model(*x)`` if ``x`` is a
    tuple else ``model(x)``; ``loss = case.loss(out, y)``; ``loss.backward()``;
    ``observe(loss)`` if given; ``opt.step()``; ``scheduler.step()`` if any. Loss values are read
    (``float(loss)``) after ``opt.step()``, so the loop adds no host read before the step.

    With neither ``model`` nor ``optimizer`` given, ``case.build()`` supplies all three (a given
    ``scheduler`` replaces the built one). Given ``model`` and ``optimizer`` (e.g. from an
    earlier ``case.build()``) are used as they are, with ``scheduler`` as given (None: no
    scheduler) -- pass the built scheduler along, some cases rely on theirs.
    """
    if model is None and optimizer is None:
        model, optimizer, built_scheduler = case.build()
        if scheduler is None:
            scheduler = built_scheduler
    elif model is None or optimizer is None:
        raise ValueError("run(): give both model and optimizer (from case.build()), or neither")
    losses: list[float] = []
    for step in range(case.steps):
        x, y = case.batch(step)
        optimizer.zero_grad()
        out = model(*x) if isinstance(x, tuple) else model(x)
        loss = case.loss(out, y)
        loss.backward()
        if observe is not None:
            observe(loss)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(float(loss.detach()))
    return model, optimizer, losses


# ----------------------------------------------------------------------------------- helpers


def _gen(seed: int, step: int) -> torch.Generator:
    """The batch generator of one case at one step."""
    return torch.Generator().manual_seed(1_000_003 * seed + step)


def _fixed(seed: int) -> torch.Generator:
    """A generator for fixed data-generating parameters (teachers, templates)."""
    return torch.Generator().manual_seed(7_919 * seed + 12_345)


class _Teacher:
    """A fixed random one-hidden-layer tanh network, output standardised to unit variance."""

    def __init__(self, seed: int, d_in: int, d_out: int, hidden: int = 32) -> None:
        g = _fixed(seed)
        self.w1 = torch.randn(d_in, hidden, generator=g) / math.sqrt(d_in)
        self.b1 = 0.3 * torch.randn(hidden, generator=g)
        self.w2 = torch.randn(hidden, d_out, generator=g) / math.sqrt(hidden)
        probe = self.raw(torch.randn(4096, d_in, generator=g))
        self.mean, self.std = probe.mean(0), probe.std(0)

    def raw(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1 + self.b1) @ self.w2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (self.raw(x) - self.mean) / self.std


def _mlp(sizes: list[int], act: Callable[[], nn.Module] = nn.ReLU) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def _groups_batch(
    seed: int, step: int, batch: int, length: int, vocab: int, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences where half the tokens come from one dominant group; label = that group."""
    g = _gen(seed, step)
    per = vocab // groups
    label = torch.randint(0, groups, (batch,), generator=g)
    uniform = torch.randint(0, vocab, (batch, length), generator=g)
    dominant = label[:, None] * per + torch.randint(0, per, (batch, length), generator=g)
    pick = torch.rand(batch, length, generator=g) < 0.5
    return torch.where(pick, dominant, uniform), label


# ------------------------------------------------------------------------------ healthy cases

_T_MLP_SGD = _Teacher(1, 16, 1)


def _mlp_sgd_build() -> Built:
    torch.manual_seed(101)
    model = _mlp([16, 64, 64, 64, 1])
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), None


def _mlp_sgd_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 16, generator=_gen(1, step))
    return x, _T_MLP_SGD(x)


_T_MLP_ADAM = _Teacher(2, 20, 5)


def _mlp_adam_build() -> Built:
    torch.manual_seed(102)
    model = _mlp([20, 64, 64, 64, 5])
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), None


def _mlp_adam_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 20, generator=_gen(2, step))
    return x, _T_MLP_ADAM(x).argmax(1)


_CNN_TEMPLATES = torch.randn(10, 3, 16, 16, generator=_fixed(3))


def _cnn_build() -> Built:
    torch.manual_seed(103)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)


def _cnn_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(3, step)
    y = torch.randint(0, 10, (32,), generator=g)
    return 0.5 * _CNN_TEMPLATES[y] + torch.randn(32, 3, 16, 16, generator=g), y


class LstmClassifier(nn.Module):
    """Embedding -> 2-layer LSTM -> Linear on the last time step."""

    def __init__(self, vocab: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 32)
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.emb(x))
        return self.head(out[:, -1])


def _lstm_build() -> Built:
    torch.manual_seed(104)
    model = LstmClassifier()
    return model, torch.optim.Adam(model.parameters(), lr=2e-3), None


def _lstm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _groups_batch(4, step, batch=32, length=16, vocab=32, groups=4)


class GruRegressor(nn.Module):
    """GRU over a sequence of feature vectors -> Linear on the last time step."""

    def __init__(self, d_in: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.gru = nn.GRU(d_in, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


_GRU_V = torch.randn(4, generator=_fixed(5))
_GRU_DECAY = 0.8 ** torch.arange(19, -1, -1.0)  # exponentially decaying filter over 20 steps
_GRU_SCALE = float(torch.sqrt((_GRU_DECAY**2).sum() * (_GRU_V**2).sum()))


def _gru_build() -> Built:
    torch.manual_seed(105)
    model = GruRegressor()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01), None


def _gru_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 20, 4, generator=_gen(5, step))
    y = ((x @ _GRU_V) * _GRU_DECAY).sum(1, keepdim=True) / _GRU_SCALE
    return x, torch.tanh(2 * y)


class TransformerClassifier(nn.Module):
    """Embedding -> 2-layer nn.TransformerEncoder -> mean pool -> Linear."""

    def __init__(self, vocab: int = 32, classes: int = 4, d_model: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 4, 128, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(x)).mean(1))


def _warmup(steps: int) -> Callable[[int], float]:
    return lambda s: min(1.0, s / steps)  # lr = 0 at step 0, full lr from step `steps`


def _transformer_build() -> Built:
    torch.manual_seed(106)
    model = TransformerClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _warmup(20))


def _transformer_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _groups_batch(6, step, batch=16, length=16, vocab=32, groups=4)


_GPT2_VOCAB = 128
_GPT2_NEXT = torch.randint(0, _GPT2_VOCAB, (_GPT2_VOCAB, 4), generator=_fixed(7))  # 4 successors per token


def _gpt2_build() -> Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(107)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=_GPT2_VOCAB, n_positions=64, use_cache=False,
                        bos_token_id=_GPT2_VOCAB - 1, eos_token_id=_GPT2_VOCAB - 1)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _warmup(20))


def _gpt2_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random Markov chain: each token has 4 equally likely successors (entropy ln 4)."""
    g = _gen(7, step)
    seq = torch.empty(8, 33, dtype=torch.long)
    seq[:, 0] = torch.randint(0, _GPT2_VOCAB, (8,), generator=g)
    choice = torch.randint(0, 4, (8, 32), generator=g)
    for t in range(32):
        seq[:, t + 1] = _GPT2_NEXT[seq[:, t], choice[:, t]]
    return seq[:, :-1], seq[:, 1:]


def _lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _spiral_batch(seed: int, step: int, batch: int = 128, arms: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed, step)
    y = torch.randint(0, arms, (batch,), generator=g)
    r = torch.rand(batch, generator=g)
    theta = y * (2 * math.pi / arms) + 4.0 * r + 0.4 * torch.randn(batch, generator=g)
    return torch.stack([r * torch.cos(theta), r * torch.sin(theta)], 1), y


def _tanh_build() -> Built:
    torch.manual_seed(108)
    model = _mlp([2, 64, 64, 64, 64, 64, 3], act=nn.Tanh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), None


HEALTHY: list[Case] = [
    Case("mlp_sgd", _mlp_sgd_build, _mlp_sgd_batch, _mse, steps=200),
    Case("mlp_adam", _mlp_adam_build, _mlp_adam_batch, _ce, steps=200),
    Case("cnn_bn_sgd", _cnn_build, _cnn_batch, _ce, steps=200),
    Case("lstm_adam", _lstm_build, _lstm_batch, _ce, steps=200),
    Case("gru_adamw", _gru_build, _gru_batch, _mse, steps=200),
    Case("transformer_warmup", _transformer_build, _transformer_batch, _ce, steps=200),
    Case("gpt2_adamw", _gpt2_build, _gpt2_batch, _lm_loss, steps=200),
    Case("tanh_mlp_adam", _tanh_build, lambda step: _spiral_batch(8, step), _ce, steps=300),
]


# -------------------------------------------------------------------------- pathological cases


# 1. nonfinite, forward: log of an input that is exactly 0 at the onset step only.
class LogFeatures(nn.Module):
    """log(x): -inf where x == 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class LogNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feat = LogFeatures()
        self.head = _mlp([8, 32, 1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.feat(x))


_T_LOG = _Teacher(11, 8, 1)
LOG_ONSET = 40


def _log_build() -> Built:
    torch.manual_seed(111)
    model = LogNet()
    return model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9), None


def _log_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = 0.1 + 1.9 * torch.rand(32, 8, generator=_gen(11, step))  # strictly positive
    y = _T_LOG(torch.log(x))
    if step == LOG_ONSET:
        x = x.clone()
        x[3, 5] = 0.0  # log(0) = -inf inside `feat`
    return x, y


# 2. nonfinite, forward: x / ||x|| with an all-zero sample at the onset step (0/0 = NaN).
class Normalize(nn.Module):
    """x / ||x|| along the last dimension (no epsilon: 0/0 = NaN)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)


class DirectionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(Normalize(), nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


_T_DIV = _Teacher(12, 8, 1)
DIV_ONSET = 50


def _div_build() -> Built:
    torch.manual_seed(112)
    model = DirectionNet()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), None


def _div_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 8, generator=_gen(12, step))
    y = _T_DIV(x / x.norm(dim=-1, keepdim=True))
    if step == DIV_ONSET:
        x = x.clone()
        x[5] = 0.0  # 0 / 0 inside `body.0`
    return x, y


# 3. nonfinite, backward: sqrt of a sum of squares that is exactly 0 -- finite forward
#    (sqrt(0) = 0), but d sqrt/ds at 0 is inf and inf * 0 = NaN in the backward pass.
class RowNorm(nn.Module):
    """||h|| per row, as sqrt(sum h^2) (no epsilon)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.pow(2).sum(-1, keepdim=True).sqrt()


class RadialNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16, bias=False)  # a zero input row stays exactly zero
        self.radial = RowNorm()
        self.head = nn.Linear(17, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.head(torch.cat([h, self.radial(h)], -1))


_T_SQRT = _Teacher(13, 8, 1)
SQRT_ONSET = 30


def _sqrt_build() -> Built:
    torch.manual_seed(113)
    model = RadialNet()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), None


def _sqrt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 8, generator=_gen(13, step))
    y = _T_SQRT(x)
    if step == SQRT_ONSET:
        x = x.clone()
        x[2] = 0.0  # proj(x)[2] == 0 exactly -> NaN gradient out of `radial`
    return x, y


# 4. nonfinite from the data: a NaN in the input batch at the onset step.
_T_POISON = _Teacher(14, 16, 1)
POISON_ONSET = 35


def _poison_build() -> Built:
    torch.manual_seed(114)
    model = _mlp([16, 32, 32, 1])
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), None


def _poison_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 16, generator=_gen(14, step))
    y = _T_POISON(x)
    if step == POISON_ONSET:
        x = x.clone()
        x[3, 2] = float("nan")
    return x, y


# 5. exploding: a tanh RNN trained fine with SGD lr=0.02 whose LR jumps 1000x at step LR_JUMP
#    (LambdaLR). The update of step LR_JUMP is huge, so the gradient explodes from the next step
#    (onset = LR_JUMP + 1: ~100x its typical norm, then 1e6x ...); the run ends while finite.
class RnnRegressor(nn.Module):
    def __init__(self, d_in: int = 4, hidden: int = 32, nonlinearity: str = "tanh") -> None:
        super().__init__()
        self.rnn = nn.RNN(d_in, hidden, batch_first=True, nonlinearity=nonlinearity)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


LR_JUMP = 60  # the step whose update uses the 1000x LR
EXPLODE_LR_ONSET = LR_JUMP + 1  # the first step whose gradient is computed on the blown-up weights


def _explode_lr_build() -> Built:
    torch.manual_seed(115)
    model = RnnRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < LR_JUMP else 1000.0)
    return model, opt, sched


def _explode_lr_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 16, 4, generator=_gen(15, step))
    y = ((x @ _GRU_V) * _GRU_DECAY[-16:]).sum(1, keepdim=True) / _GRU_SCALE
    return x, torch.tanh(2 * y)


# 6. exploding: a ReLU RNN whose recurrent weights are initialised 2.5x orthogonal (spectral
#    radius 2.5). Latent on the short sequences (8 steps) of the first steps of a length
#    curriculum, it explodes when the sequences grow to 32 steps at the onset step: the gradient
#    norm goes from ~2 to ~1e7 (and stays there; Adam keeps the updates, and so the weights,
#    bounded, so everything stays finite).
LONG_ONSET = 60


def _explode_init_build() -> Built:
    torch.manual_seed(116)
    model = RnnRegressor(hidden=32, nonlinearity="relu")
    w_hh: torch.Tensor = model.rnn.get_parameter("weight_hh_l0")
    with torch.no_grad():
        nn.init.orthogonal_(w_hh)
        w_hh.mul_(2.5)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), None


def _explode_init_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = 8 if step < LONG_ONSET else 32
    g = _gen(16, step)
    x = torch.randn(32, length, 4, generator=g)
    y = torch.tanh(x[:, -4:] @ _GRU_V).mean(1, keepdim=True)
    return x, y


# 7. vanishing: 16 Linear+Sigmoid layers (8 regression outputs); each layer shrinks the gradient
#    about 8x, so the gradient RMS of the first Linear is ~1e-15, <1e-5 (typically ~1e-6) of the
#    median layer's, from step 0 on.
class DeepSigmoid(nn.Module):
    def __init__(self, depth: int = 16, width: int = 32, d_out: int = 8) -> None:
        super().__init__()
        mods: list[nn.Module] = [nn.Linear(16, width), nn.Sigmoid()]
        for _ in range(depth - 1):
            mods += [nn.Linear(width, width), nn.Sigmoid()]
        mods.append(nn.Linear(width, d_out))
        self.layers = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


_T_VANISH = _Teacher(17, 16, 8)


def _vanish_build() -> Built:
    torch.manual_seed(117)
    model = DeepSigmoid()
    return model, torch.optim.SGD(model.parameters(), lr=0.01), None


def _vanish_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 16, generator=_gen(17, step))
    return x, _T_VANISH(x)


# 8. dead units: a bias of -100 before a ReLU: every output of `act` is exactly 0 from step 0.
class DeadReluNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(64, 1)
        with torch.no_grad():
            self.fc1.bias.fill_(-100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


_T_DEAD = _Teacher(18, 16, 1)


def _dead_build() -> Built:
    torch.manual_seed(118)
    model = DeadReluNet()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), None


def _dead_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 16, generator=_gen(18, step))
    return x, _T_DEAD(x)


# 9. saturation: weights scaled 400x before a Sigmoid: >95% of `gate`'s outputs within 0.01 of 0 or 1.
class SaturatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.gate = nn.Sigmoid()
        self.fc2 = nn.Linear(64, 1)
        with torch.no_grad():
            self.fc1.weight.mul_(400.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.gate(self.fc1(x)))


_T_SAT = _Teacher(19, 16, 1)


def _sat_build() -> Built:
    torch.manual_seed(119)
    model = SaturatedNet()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), None


def _sat_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 16, generator=_gen(19, step))
    return x, _T_SAT(x)


# 10. unused parameter: a submodule that forward never calls.
class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp([16, 32, 1])
        self.unused = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


_T_UNUSED = _Teacher(20, 16, 1)


def _unused_build() -> Built:
    torch.manual_seed(120)
    model = WithUnused()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), None


def _unused_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 16, generator=_gen(20, step))
    return x, _T_UNUSED(x)


# 11. unused parameter: an accidental .detach() cuts the encoder off the graph.
class DetachedEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = _mlp([32, 32, 1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x).detach()  # the bug
        return self.head(h)


def _detach_build() -> Built:
    torch.manual_seed(121)
    model = DetachedEncoder()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), None


def _detach_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 16, generator=_gen(21, step))
    return x, _T_UNUSED(x)


# 12. loss spike: healthy regression, one corrupted batch (targets x100) at the onset step.
_T_SPIKE = _Teacher(22, 16, 1)
SPIKE_ONSET = 80


def _spike_build() -> Built:
    torch.manual_seed(122)
    model = _mlp([16, 64, 64, 1])
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), None


def _spike_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 16, generator=_gen(22, step))
    y = _T_SPIKE(x)
    if step == SPIKE_ONSET:
        y = 100.0 * y
    return x, y


# 13. update ratio: a linear probe on bounded (+-0.125) inputs trained with SGD lr=50, at the
#     edge of stability: each update overshoots (w -> about -w), so ||dw|| / ||w|| stays ~1.5
#     while the weights contract -- every step finite.
class LinearProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


_PROBE_W = 0.05 * torch.randn(32, 1, generator=_fixed(23))


def _ratio_build() -> Built:
    torch.manual_seed(123)
    model = LinearProbe()
    return model, torch.optim.SGD(model.parameters(), lr=50.0), None


def _ratio_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(23, step)
    x = 0.125 * (2.0 * torch.randint(0, 2, (256, 32), generator=g) - 1.0)  # bounded inputs
    y = x @ _PROBE_W + 0.1 * torch.randn(256, 1, generator=g)  # weak signal, noisy targets
    return x, y


PATHOLOGIES: list[Case] = [
    Case("nonfinite_log", _log_build, _log_batch, _mse, steps=LOG_ONSET + 20,
         kind="nonfinite", layer="feat", onset=LOG_ONSET, phase="forward"),
    Case("nonfinite_div", _div_build, _div_batch, _mse, steps=DIV_ONSET + 20,
         kind="nonfinite", layer="body.0", onset=DIV_ONSET, phase="forward"),
    Case("nonfinite_sqrt_backward", _sqrt_build, _sqrt_batch, _mse, steps=SQRT_ONSET + 20,
         kind="nonfinite", layer="radial", onset=SQRT_ONSET, phase="backward"),
    Case("nonfinite_poisoned_batch", _poison_build, _poison_batch, _mse, steps=POISON_ONSET + 20,
         kind="nonfinite", layer=None, onset=POISON_ONSET, phase="forward"),
    Case("exploding_lr_jump", _explode_lr_build, _explode_lr_batch, _mse, steps=EXPLODE_LR_ONSET + 5,
         kind="exploding", layer=None, onset=EXPLODE_LR_ONSET),
    Case("exploding_large_init", _explode_init_build, _explode_init_batch, _mse, steps=LONG_ONSET + 5,
         kind="exploding", layer=None, onset=LONG_ONSET),
    Case("vanishing_deep_sigmoid", _vanish_build, _vanish_batch, _mse, steps=30,
         kind="vanishing", layer="layers.0", onset=0),
    Case("dead_relu_bias", _dead_build, _dead_batch, _mse, steps=30,
         kind="dead_units", layer="act", onset=0),
    Case("saturated_sigmoid", _sat_build, _sat_batch, _mse, steps=30,
         kind="saturation", layer="gate", onset=0),
    Case("unused_submodule", _unused_build, _unused_batch, _mse, steps=20,
         kind="unused_parameter", layer="unused", onset=0),
    Case("unused_detach", _detach_build, _detach_batch, _mse, steps=20,
         kind="unused_parameter", layer="encoder.0", onset=0),
    Case("loss_spike_corrupt_batch", _spike_build, _spike_batch, _mse, steps=SPIKE_ONSET + 40,
         kind="loss_spike", layer=None, onset=SPIKE_ONSET),
    Case("update_ratio_high_lr", _ratio_build, _ratio_batch, _mse, steps=40,
         kind="update_ratio", layer="fc", onset=0),
]

CASES: dict[str, Case] = {c.name: c for c in HEALTHY + PATHOLOGIES}
