"""Matrix axis: parameter and activation dtypes — every floating and complex dtype torch trains in, mixed, autocast."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.matrix import Cell, Loop, Observe
from tests.matrix.loops import batch, mlp, supervised


def trainable(kind: str) -> list[torch.dtype]:
    """torch's own dtypes of a kind (``floating`` or ``complex``) that training runs in on the CPU.

    Enumerated from the ``torch.dtype`` objects torch exports, so that a new one is seen here. Left
    out, for having no CPU matmul to train with: the 8-bit floats (``float8_*``: scaled matmul only)
    and ``complex32`` (``chalf``).
    """
    found = {d for d in vars(torch).values() if isinstance(d, torch.dtype)}
    if kind == "complex":
        picked = [d for d in found if d.is_complex and d.itemsize >= 8]
    else:
        picked = [d for d in found if d.is_floating_point and not d.is_complex and d.itemsize >= 2]
    return sorted(picked, key=str)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def whole(dtype: torch.dtype) -> Loop:
    """An MLP, its parameters and batches all in ``dtype`` (a complex one: complex tanh, real loss)."""
    return supervised(mlp(dtype), dtype=dtype, lr=0.05 if dtype.itemsize >= 4 else 0.1)


def cast_after_watch(dtype: torch.dtype) -> Loop:
    """The model cast by ``.to(dtype)`` in the loop's first iteration, after ``gw.watch``; its optimizer
    built then."""
    model = mlp(torch.float32)
    inner: list[Loop] = []

    def step(i: int, poison: bool, observe: Observe) -> None:
        if not inner:
            model.to(dtype)
            inner.append(supervised(model, dtype=dtype))
        inner[0].step(i, poison, observe)

    return Loop(model, step)


class ToDouble(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double()


def mixed() -> Loop:
    """A float32 body under a float64 head (scientific code's precise last layer)."""
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), ToDouble(),
                          nn.Linear(16, 1).double())
    return supervised(model, data=lambda i: (batch(i)[0], batch(i, dtype=torch.float64)[1]))


def autocast(dtype: torch.dtype) -> Loop:
    """A float32 model whose forward runs under CPU autocast to ``dtype``."""
    def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            return model(x)
    return supervised(mlp(torch.float32), forward=forward, loss=lambda out, y: F.mse_loss(out.float(), y))


class Spectral(nn.Module):
    """An FNO-style spectral layer: complex weights applied to the first Fourier modes (``torch.fft``)."""

    def __init__(self, width: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.randn(width, width, modes, dtype=torch.cfloat) / width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, width, points)
        spectrum = torch.fft.rfft(x)
        out = torch.zeros_like(spectrum)
        out[:, :, : self.modes] = torch.einsum("bix,iox->box", spectrum[:, :, : self.modes], self.weight)
        return torch.fft.irfft(out, n=x.shape[-1])


class FNO(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Conv1d(1, 8, 1)
        self.spectral = Spectral(8, 4)
        self.act = nn.GELU()
        self.project = nn.Conv1d(8, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x)
        return self.project(self.act(self.spectral(h) + h))


def fno() -> Loop:
    def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(2000 + i)  # smooth signals: their first modes say everything
        t = torch.linspace(0, 1, 33)[:-1]
        amp, phase = torch.randn(8, 3, 1, generator=g), 6.28 * torch.rand(8, 3, 1, generator=g)
        x = (amp * torch.sin(6.28 * torch.arange(1, 4).view(1, 3, 1) * t + phase)).sum(1, keepdim=True)
        return x, torch.roll(x, 1, dims=-1) * 0.5
    return supervised(FNO(), data=data, optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))


CELLS = [
    *[Cell(f"dtypes/{_name(d)}", lambda d=d: whole(d)) for d in trainable("floating")],
    *[Cell(f"dtypes/{_name(d)}", lambda d=d: whole(d)) for d in trainable("complex")],
    *[Cell(f"dtypes/{_name(d)}-cast-after-watch", lambda d=d: cast_after_watch(d))
      for d in (torch.float64, torch.complex64)],
    Cell("dtypes/float64-head-on-float32-body", mixed),
    *[Cell(f"dtypes/autocast-{_name(d)}", lambda d=d: autocast(d), tolerance=1e-2)
      for d in (torch.bfloat16, torch.float16)],
    Cell("dtypes/complex-spectral-fno", fno),
]
