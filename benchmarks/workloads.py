"""Overhead benchmark, workloads: the seeded synthetic models, data and optimizers it trains (no downloads)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributions import Categorical

SEED = 0
#: distinct batches per workload, generated once and cycled through by every variant
POOL = 8

Batch = tuple[Tensor, Tensor]


# ------------------------------------------------------------------ workloads
class Block(nn.Module):
    """Pre-LN transformer block with causal self-attention."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(self.act(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-style decoder: token and learned position embeddings, blocks, LM head (tied to the
    token embedding when ``tied``, as in GPT-2).
    """

    def __init__(self, vocab: int = 512, seq: int = 128, d_model: int = 256, heads: int = 4, layers: int = 6,
                 tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=not tied)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_batch(gen: torch.Generator, vocab: int = 512, seq: int = 128, batch: int = 8) -> Batch:
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass(frozen=True)
class GPT2Config:
    """GPT-2 small's shape (124M parameters): the model a user would put a number on."""

    vocab: int = 50257
    positions: int = 1024
    d_model: int = 768
    heads: int = 12
    layers: int = 12
    #: tokens per step on the CPU: a few sequences of a short context
    batch: int = 2
    seq: int = 128


GPT2_SMALL = GPT2Config()


def gpt2_small() -> nn.Module:
    c = GPT2_SMALL
    return GPT(vocab=c.vocab, seq=c.positions, d_model=c.d_model, heads=c.heads, layers=c.layers, tied=True)


def gpt2_batch(gen: torch.Generator) -> Batch:
    return gpt_batch(gen, vocab=GPT2_SMALL.vocab, seq=GPT2_SMALL.seq, batch=GPT2_SMALL.batch)


@dataclass(frozen=True)
class ResNetConfig:
    """ResNet-50's shape (25.6M parameters): bottleneck blocks of 3, 4, 6 and 3, BatchNorm, 1,000 classes."""

    blocks: tuple[int, ...] = (3, 4, 6, 3)
    widths: tuple[int, ...] = (64, 128, 256, 512)
    expansion: int = 4
    classes: int = 1000
    #: images per step on the CPU: a few, at ImageNet's size
    batch: int = 2
    image: int = 224


RESNET50 = ResNetConfig()


class Bottleneck(nn.Module):
    """1x1, 3x3 (strided), 1x1 convolutions with BatchNorm and a projected shortcut where the shape changes."""

    def __init__(self, cin: int, width: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        nn.init.zeros_(self.bn3.weight)  # each block starts as its shortcut ("zero-init residual")
        self.relu = nn.ReLU(inplace=True)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.down is None else self.down(x)))


def resnet50() -> nn.Module:
    c = RESNET50
    layers: list[nn.Module] = [nn.Conv2d(3, c.widths[0], 7, stride=2, padding=3, bias=False),
                               nn.BatchNorm2d(c.widths[0]), nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1)]
    cin = c.widths[0]
    for stage, (n, width) in enumerate(zip(c.blocks, c.widths)):
        for k in range(n):
            layers.append(Bottleneck(cin, width, width * c.expansion, 2 if k == 0 and stage > 0 else 1))
            cin = width * c.expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, c.classes)]
    return nn.Sequential(*layers)


def resnet50_batch(gen: torch.Generator) -> Batch:
    c = RESNET50
    return (torch.randn(c.batch, 3, c.image, c.image, generator=gen),
            torch.randint(0, c.classes, (c.batch,), generator=gen))


def deep_mlp(depth: int = 48, width: int = 128) -> nn.Module:
    """Linear + ReLU layers with He initialisation, so activations neither vanish nor explode."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        linear = nn.Linear(width, width)
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.ReLU()]
    return nn.Sequential(*layers)


def mlp_batch(gen: torch.Generator) -> Batch:
    return torch.randn(64, 128, generator=gen), torch.randn(64, 128, generator=gen)


def small_cnn() -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, 32), nn.MaxPool2d(2),
        *block(32, 64), nn.MaxPool2d(2),
        *block(64, 128), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(128, 10),
    )


def cnn_batch(gen: torch.Generator) -> Batch:
    return torch.randn(32, 3, 32, 32, generator=gen), torch.randint(0, 10, (32,), generator=gen)


class TinyBlock(nn.Module):
    """A pre-norm residual block of three tiny leaves: LayerNorm, Linear, ReLU."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU()
        nn.init.normal_(self.fc.weight, std=0.02)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.act(self.fc(self.norm(x)))


#: blocks of the many-module workload: 4,003 modules (3,002 leaves) and 4,004 parameters
MANY_BLOCKS = 1000


def many_modules(blocks: int = MANY_BLOCKS, width: int = 16) -> nn.Module:
    """A deep stack of tiny residual blocks and a linear head: thousands of modules whose own work is
    next to nothing, so that a cost per module (a hook, a Python object, a loop over the modules) shows.
    """
    return nn.Sequential(*(TinyBlock(width) for _ in range(blocks)), nn.LayerNorm(width), nn.Linear(width, width))


def many_batch(gen: torch.Generator) -> Batch:
    return torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)


#: single-sample forward calls per episode (one optimizer step each)
EPISODE = 100


class Policy(nn.Module):
    """The classic REINFORCE policy: Linear, dropout, ReLU, Linear, softmax over two actions."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, hidden)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(hidden, 2)

    def forward(self, x: Tensor) -> Tensor:
        return F.softmax(self.affine2(F.relu(self.dropout(self.affine1(x)))), dim=1)


def episode_batch(gen: torch.Generator) -> Batch:
    """One episode's observations (one per forward call) and its standardised discounted returns."""
    returns = torch.tensor([0.99**k for k in range(EPISODE)]).flip(0).cumsum(0).flip(0)
    returns = (returns - returns.mean()) / (returns.std() + 1e-6)
    return torch.rand(EPISODE, 4, generator=gen) * 0.1 - 0.05, returns


class Trainable(Protocol):
    """What a workload's own training step needs of the benchmark's loop."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def on_loss(self, loss: Tensor) -> None: ...

    def on_backward(self) -> None: ...


def rollout_step(loop: Trainable, batch: Batch) -> None:
    """One REINFORCE episode: a single-sample forward call per observation, each sampling an
    action (read on the host, as an environment needs it), then one optimizer step.
    """
    states, returns = batch
    log_probs = []
    for t in range(len(states)):
        dist = Categorical(loop.model(states[t:t + 1]))
        action = dist.sample()
        log_probs.append(dist.log_prob(action))
        int(action.item())  # the environment takes a Python int
    loss = (-torch.cat(log_probs) * returns).sum()
    loop.optimizer.zero_grad()
    loss.backward()
    loop.on_loss(loss)
    loop.on_backward()
    loop.optimizer.step()


@dataclass(frozen=True)
class Workload:
    """A model, its optimizer, its data and loss, and how it is measured by default."""

    build: Callable[[], nn.Module]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    batch: Callable[[torch.Generator], Batch]
    loss: Callable[[Tensor, Tensor], Tensor]
    steps: int  # steps per block, a multiple of gradwatch's default sampling period
    rounds: int
    target: float  # the largest acceptable ratio of gradwatch at default settings to bare
    #: the workload's own training step (default: one forward, backward and optimizer step per batch)
    train: Callable[[Trainable, Batch], None] | None = None
    #: warm-up steps (gradwatch variants: at least three sampling periods)
    warmup: int = 20
    warmup_watched: int = 30
    #: variants measured by default (None: all); a large model leaves out the slow references
    variants: tuple[str, ...] | None = None

    def batches(self) -> list[Batch]:
        gen = torch.Generator().manual_seed(SEED)
        return [self.batch(gen) for _ in range(POOL)]


def _unused_loss(output: Tensor, target: Tensor) -> Tensor:
    raise AssertionError("a rollout computes its own loss")


WORKLOADS = {
    "gpt": Workload(GPT, lambda p: torch.optim.AdamW(p, lr=3e-4), gpt_batch, lm_loss, steps=10, rounds=5, target=1.01),
    "mlp": Workload(deep_mlp, lambda p: torch.optim.SGD(p, lr=1e-2), mlp_batch, F.mse_loss, steps=50, rounds=11,
                    target=1.10),
    "cnn": Workload(small_cnn, lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9), cnn_batch, F.cross_entropy,
                    steps=20, rounds=9, target=1.01),
    "pg": Workload(Policy, lambda p: torch.optim.Adam(p, lr=1e-2), episode_batch, _unused_loss, steps=10, rounds=9,
                   target=1.02, train=rollout_step),
    "many": Workload(many_modules, lambda p: torch.optim.SGD(p, lr=1e-2), many_batch, F.mse_loss, steps=10,
                     rounds=5, target=1.05),
    "gpt2": Workload(gpt2_small, lambda p: torch.optim.AdamW(p, lr=3e-4), gpt2_batch, lm_loss, steps=10, rounds=2,
                     target=1.01, warmup=2, warmup_watched=11, variants=("bare", "gradwatch", "foreach", "minimal")),
    "resnet50": Workload(resnet50, lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, weight_decay=1e-4),
                         resnet50_batch, F.cross_entropy, steps=10, rounds=2, target=1.01, warmup=2, warmup_watched=11,
                         variants=("bare", "gradwatch", "foreach", "minimal")),
}
#: the realistic sizes: a step takes seconds on a CPU, so they run only when named
LARGE = ("gpt2", "resnet50")
