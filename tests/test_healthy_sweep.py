"""A sweep of ordinary, healthy training configurations: with the default rules, not one warning or error.

Each configuration is a small model of one family -- an MLP classifier or regressor, a CNN with
BatchNorm, an LSTM or a causal transformer language model, or a GAN's two models (each watched
into its own run) -- trained with Adam, AdamW or SGD with momentum, batches of 8 to 128, with or
without a linear warmup and cosine decay, ``clip_grad_norm_``, gradient accumulation and bf16
autocast, over several seeds. The axes are laid out by a seeded Latin-hypercube design per
family (every value of an axis comes up equally often), so the set is the same on every run and
each test id names its configuration. Every run must learn (its loss clearly falls: the
discriminator's for a GAN, whose generator's loss rises as its opponent learns) and gradwatch
must stay silent: false alarms on healthy runs are what make people turn a monitor off.

The configurations train two at a time, each alone in a process of the tests' pool
(``tests/pool.py``: seeded, one thread, as in the test process), ahead of the tests, which read
their runs: on two cores the sweep takes half the time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gradwatch as gw

from . import pool

# about 120 small training runs
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

OPTIMIZERS = ("adam", "adamw", "sgd")
BATCHES = (8, 16, 32, 64, 128)
#: configurations per family, and the training steps of each
FAMILIES = {"mlp_cls": (24, 300), "mlp_reg": (20, 300), "cnn_bn": (20, 150), "lstm_lm": (18, 150),
            "transformer_lm": (18, 120), "gan": (20, 120)}
#: the learning rate of each optimizer per family (Adam and AdamW share one); the GAN's is the DCGAN paper's
LR = {"mlp_cls": (2e-3, 0.05), "mlp_reg": (1e-3, 0.02), "cnn_bn": (5e-3, 0.05), "lstm_lm": (3e-3, 0.5),
      "transformer_lm": (1e-3, 0.1), "gan": (2e-4, 0.01)}
VOCAB, SEQ = 24, 16


@dataclass(frozen=True)
class Setup:
    """One training configuration."""

    family: str
    optimizer: str
    batch: int
    schedule: bool  # linear warmup (10% of the steps) then cosine decay to 0
    clip: bool  # clip_grad_norm_(..., 1.0) before every step
    accum: int  # micro-batches per optimizer step
    bf16: bool  # the forward pass under CPU autocast to bfloat16
    seed: int
    steps: int

    @property
    def name(self) -> str:
        extras = [x for x, on in (("cos", self.schedule), ("clip", self.clip), (f"acc{self.accum}", self.accum > 1),
                                  ("bf16", self.bf16)) if on]
        return "-".join([self.family, self.optimizer, f"b{self.batch}", *extras, f"s{self.seed}"])


def _latin(rng: random.Random, values: tuple[Any, ...], n: int) -> list[Any]:
    """``n`` values, each of ``values`` about equally often, in a shuffled order."""
    out = [values[i % len(values)] for i in range(n)]
    rng.shuffle(out)
    return out


def setups() -> list[Setup]:
    """Every configuration of the sweep, the same on every run."""
    out = []
    for k, (family, (n, steps)) in enumerate(FAMILIES.items()):
        rng = random.Random(1000 + k)
        gan = family == "gan"
        batches = BATCHES if family in ("mlp_cls", "mlp_reg", "cnn_bn") else (8, 16, 32, 64)
        most = 64 if family in ("transformer_lm", "gan") else 128  # the effective batch stays ordinary (and quick)
        axes = zip(_latin(rng, ("adam", "adamw") if gan else OPTIMIZERS, n), _latin(rng, batches, n),
                   _latin(rng, (False,) if gan else (False, True), n), _latin(rng, (False, True), n),
                   _latin(rng, (1,) if gan else (1, 2, 4), n), _latin(rng, (False, True), n), range(n))
        for opt, batch, schedule, clip, accum, bf16, seed in axes:
            if accum * batch > most:
                accum = 1
            out.append(Setup(family, opt, batch, schedule, clip, accum, bf16, seed, steps))
    return out


# --------------------------------------------------------------------------------- the models
class Mlp(nn.Module):
    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inputs, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Cnn(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


class LstmLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.rnn = nn.LSTM(32, 48, batch_first=True)
        self.head = nn.Linear(48, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(x))[0])


class TransformerLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.pos = nn.Parameter(torch.zeros(SEQ, 32))
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(x) + self.pos, mask=self.mask, is_causal=True))


class Generator(nn.Module):
    def __init__(self, nz: int = 8) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(nz, 64), nn.BatchNorm1d(64), nn.ReLU(True), nn.Linear(64, 64), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(0.2, inplace=True), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).view(-1)


# ----------------------------------------------------------------------------------- the data
Batch = Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]


def _task(family: str, seed: int) -> tuple[nn.Module, Batch, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The model, a batch sampler ``(generator, size) -> (x, y)`` and the loss of one family."""
    data = torch.Generator().manual_seed(10_000 + seed)
    if family == "mlp_cls":  # 512 samples of 5 overlapping Gaussian clusters: memorised, the loss goes to ~0
        centers = 2.0 * torch.randn(5, 20, generator=data)
        y_all = torch.randint(0, 5, (512,), generator=data)
        x_all = centers[y_all] + 1.5 * torch.randn(512, 20, generator=data)
        return Mlp(20, 5), _pick(x_all, y_all), F.cross_entropy
    if family == "mlp_reg":  # a random teacher network plus noise
        teacher = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
        with torch.no_grad():
            for p in teacher.parameters():
                p.copy_(torch.randn(p.shape, generator=data))

        def regression(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randn(size, 10, generator=gen)
            with torch.no_grad():
                return x, teacher(x) + 0.3 * torch.randn(size, 1, generator=gen)

        return Mlp(10, 1), regression, F.mse_loss
    if family == "cnn_bn":  # 12x12 noisy copies of 4 random templates, 1024 samples
        templates = torch.randn(4, 1, 12, 12, generator=data)
        y_all = torch.randint(0, 4, (1024,), generator=data)
        x_all = templates[y_all] + torch.randn(1024, 1, 12, 12, generator=data)
        return Cnn(4), _pick(x_all, y_all), F.cross_entropy
    # language models: a random Markov chain, each token followed by one of 3 others
    successors = torch.stack([torch.randperm(VOCAB, generator=data)[:3] for _ in range(VOCAB)])

    def text(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = [torch.randint(0, VOCAB, (size,), generator=gen)]
        for _ in range(SEQ):
            choice = torch.randint(0, 3, (size,), generator=gen)
            tokens.append(successors[tokens[-1], choice])
        seq = torch.stack(tokens, 1)
        return seq[:, :-1], seq[:, 1:]

    model = LstmLM() if family == "lstm_lm" else TransformerLM()
    return model, text, lambda logits, y: F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))


def _pick(x_all: torch.Tensor, y_all: torch.Tensor) -> Batch:
    def pick(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(x_all), (size,), generator=gen)
        return x_all[idx], y_all[idx]

    return pick


def _blobs(gen: torch.Generator, size: int) -> torch.Tensor:
    """8x8 images (flattened) of one soft Gaussian blob at a random place, in [-1, 1]."""
    grid = torch.arange(8, dtype=torch.float32)
    center = 1.5 + 5 * torch.rand(size, 2, generator=gen)
    width = 1.0 + 0.5 * torch.rand(size, 1, 1, generator=gen)
    d2 = (grid.view(1, 8, 1) - center[:, 0, None, None]) ** 2 + (grid.view(1, 1, 8) - center[:, 1, None, None]) ** 2
    return (2 * torch.exp(-d2 / (2 * width**2)) - 1).flatten(1)


# ------------------------------------------------------------------------------ the training
def _optimizer(setup: Setup, params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    adam_lr, sgd_lr = LR[setup.family]
    betas = (0.5, 0.999) if setup.family == "gan" else (0.9, 0.999)
    if setup.optimizer == "adam":
        return torch.optim.Adam(params, lr=adam_lr, betas=betas)
    if setup.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=adam_lr, betas=betas, weight_decay=0.01)
    return torch.optim.SGD(params, lr=sgd_lr, momentum=0.9)


def _schedule(setup: Setup, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
    if not setup.schedule:
        return None
    warm = max(1, setup.steps // 10)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / (setup.steps - warm)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train(setup: Setup, run: Path | None) -> dict[str, list[float]]:
    """Train one configuration (watched into ``run``, or not watched when None); the losses by model."""
    if setup.family == "gan":
        return _train_gan(setup, run)
    torch.manual_seed(setup.seed)
    model, batch, loss_fn = _task(setup.family, setup.seed)
    opt = _optimizer(setup, model.parameters())
    sched = _schedule(setup, opt)
    if run is not None:
        gw.watch(model, run=run, console=False)
    gen = torch.Generator().manual_seed(setup.seed)
    losses = []
    try:
        for _ in range(setup.steps):
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for _ in range(setup.accum):
                x, y = batch(gen, setup.batch)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup.bf16):
                    loss = loss_fn(model(x), y)
                (loss / setup.accum).backward()
                if run is not None:
                    gw.watcher(model).observe(loss=loss)
                total += loss.item() / setup.accum
            if setup.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if sched is not None:
                sched.step()
            losses.append(total)
    finally:
        if run is not None:
            gw.unwatch(model)
    return {"model": losses}


def _train_gan(setup: Setup, run: Path | None) -> dict[str, list[float]]:
    """The DCGAN loop: the discriminator on a real and a detached fake batch, then the generator."""
    torch.manual_seed(setup.seed)
    netG, netD = Generator(), Discriminator()
    opt_d, opt_g = _optimizer(setup, netD.parameters()), _optimizer(setup, netG.parameters())
    if run is not None:
        gw.watch(netD, run=run / "D", console=False)
        gw.watch(netG, run=run / "G", console=False)
    gen = torch.Generator().manual_seed(setup.seed)
    real_label = 0.9 if setup.seed % 2 else 1.0  # one-sided label smoothing on half the seeds
    # how far the generator's samples are from the data (their mean image): falls as the generator learns
    losses: dict[str, list[float]] = {"D": [], "G": [], "gap": []}
    try:
        for _ in range(setup.steps):
            real = _blobs(gen, setup.batch)
            netD.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup.bf16):
                out_real = netD(real).float()
                fake = netG(torch.randn(setup.batch, 8, generator=gen))
                out_fake = netD(fake.detach()).float()
            err_d = (F.binary_cross_entropy_with_logits(out_real, torch.full_like(out_real, real_label))
                     + F.binary_cross_entropy_with_logits(out_fake, torch.zeros_like(out_fake)))
            err_d.backward()
            if setup.clip:
                torch.nn.utils.clip_grad_norm_(netD.parameters(), 1.0)
            opt_d.step()
            netG.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup.bf16):
                out = netD(fake).float()
            err_g = F.binary_cross_entropy_with_logits(out, torch.ones_like(out))
            err_g.backward()
            if setup.clip:
                torch.nn.utils.clip_grad_norm_(netG.parameters(), 1.0)
            opt_g.step()
            if run is not None:
                gw.watcher(netD).observe(loss=err_d)
                gw.watcher(netG).observe(loss=err_g)
            losses["D"].append(err_d.item())
            losses["G"].append(err_g.item())
            losses["gap"].append((fake.detach().mean(0) - real.mean(0)).pow(2).mean().item())
    finally:
        if run is not None:
            gw.unwatch(netG)
            gw.unwatch(netD)
    return losses


def learned(losses: list[float]) -> bool:
    """The loss clearly fell: its last tenth's mean is below 0.7x its first tenth's."""
    tenth = max(1, len(losses) // 10)
    return sum(losses[-tenth:]) < 0.7 * sum(losses[:tenth])


SETUPS = setups()


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, tuple[Future[Any], Path]]]:
    """The configurations this session tests, each given to the pool as the module starts: its
    losses to come, and its run's folder."""
    root = tmp_path_factory.mktemp("sweep")
    futures = {s.name: (pool.submit(train, s, root / s.name / "run"), root / s.name)
               for s in pool.chosen(request, "setup")}
    yield futures
    for future, _ in futures.values():
        future.cancel()  # a session stopped early (-x) trains no configuration it no longer tests


def test_the_sweep_covers_every_axis() -> None:
    assert len(SETUPS) >= 100
    assert {s.family for s in SETUPS} == set(FAMILIES)
    assert {s.optimizer for s in SETUPS} == set(OPTIMIZERS)
    assert {s.batch for s in SETUPS} == set(BATCHES)
    for axis in ("schedule", "clip", "bf16"):
        assert {getattr(s, axis) for s in SETUPS} == {False, True}, axis
    assert {s.accum for s in SETUPS} == {1, 2, 4}
    assert len({s.name for s in SETUPS}) == len(SETUPS)


@pytest.mark.parametrize("setup", SETUPS, ids=[s.name for s in SETUPS])
def test_a_healthy_configuration_is_quiet(setup: Setup, trained: dict[str, Any]) -> None:
    future, folder = trained[setup.name]
    losses = pool.result(future)  # an exception in the pool process is raised here, with its traceback
    # a GAN's losses need not fall (the generator's rises as its opponent learns): its samples near the data's
    learner = "gap" if setup.family == "gan" else "model"
    assert learned(losses[learner]), f"the run learns: {losses[learner][:3]} ... {losses[learner][-3:]}"
    runs = [folder / "run" / "D", folder / "run" / "G"] if setup.family == "gan" else [folder / "run"]
    for run_dir in runs:
        with gw.open_run(run_dir) as run:
            found = run.findings()
        loud = found[found.severity != "info"]
        assert loud.empty, list(zip(loud.kind, loud.step, loud.layer, loud.message))
