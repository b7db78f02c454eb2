"""Replay state (judge stage, rare path): the autocast a forward ran under, and what a replay puts back."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

#: floating-point types narrower than float32 (autocast's, or a half-precision model's)
LOW_PRECISION = (torch.float16, torch.bfloat16)


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of tensors, mappings, lists and tuples (a batch, a model's output)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def first_tensor(output: Any) -> torch.Tensor | None:
    """The first floating-point tensor in a module output (tensor, tuple, list, dict, ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            t = first_tensor(item)
            if t is not None:
                return t
    return None


def floats(obj: Any) -> list[torch.Tensor]:
    """The floating-point (and complex) tensors inside ``obj``."""
    return [t for t in tensors(obj) if t.is_floating_point() or t.is_complex()]


def stored(t: torch.Tensor) -> torch.Tensor:
    """The values a tensor stores: a sparse tensor's (COO, CSR, CSC, BSR, BSC) specified elements, which
    elementwise checks have no sparse kernel for (its unspecified elements are zeros); else itself.
    """
    if t.layout == torch.sparse_coo:
        return t._values()
    if t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        return t.values()
    return t


def version(t: torch.Tensor) -> int:
    """``t``'s version counter (how often it was written in place), -1 for an inference tensor (none)."""
    try:
        return int(t._version)
    except RuntimeError:
        return -1


def finite(*objs: Any) -> bool:
    """Whether every floating-point tensor inside ``objs`` is finite (reads from the device)."""
    flags = [torch.isfinite(stored(t)).all() for o in objs for t in floats(o)]
    return bool(torch.stack(flags).all()) if flags else True


def has_nan(*objs: Any) -> bool:
    """Whether some floating-point tensor inside ``objs`` holds a NaN (reads from the device)."""
    flags = [torch.isnan(stored(t)).any() for o in objs for t in floats(o)]
    return bool(torch.stack(flags).any()) if flags else False


def devices(model: nn.Module) -> list[str]:
    """The device types autocast can act on for ``model``: ``cpu`` and its accelerators'."""
    kinds = {p.device.type for p in model.parameters()} | {"cpu"}
    return sorted(k for k in kinds if k in ("cpu", "cuda", "xpu", "mps", "hpu"))


@dataclass(frozen=True)
class Autocast:
    """The autocast state of one forward call: ``(device type, enabled, dtype)`` for each device type."""

    modes: tuple[tuple[str, bool, torch.dtype], ...] = ()
    cache: bool = True

    @classmethod
    def now(cls, kinds: list[str]) -> Autocast:
        """The autocast state in force: one call per device type when autocast is off (the state of each
        forward call is taken, so this is kept cheap; no device work).
        """
        on = [torch.is_autocast_enabled(k) for k in kinds]
        if not any(on):
            off = _OFF.get(tuple(kinds))
            if off is None:
                off = _OFF[tuple(kinds)] = cls(tuple((k, False, torch.get_autocast_dtype(k)) for k in kinds))
            return off
        return cls(tuple((k, e, torch.get_autocast_dtype(k)) for k, e in zip(kinds, on)),
                   torch.is_autocast_cache_enabled())

    @property
    def enabled(self) -> bool:
        """Whether autocast was on for some device type."""
        return any(on for _, on, _ in self.modes)

    @property
    def dtype(self) -> torch.dtype | None:
        """The low-precision type autocast ran in (None when it was off)."""
        return next((dtype for _, on, dtype in self.modes if on), None)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Run the block under this autocast state (whatever is in force around it)."""
        with contextlib.ExitStack() as stack:
            for kind, on, dtype in self.modes:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=on, cache_enabled=self.cache))
            yield

    def restore(self) -> None:
        """Make this the autocast state in force."""
        for kind, on, dtype in self.modes:
            torch.set_autocast_enabled(kind, on)
            torch.set_autocast_dtype(kind, dtype)
        torch.set_autocast_cache_enabled(self.cache)

    @classmethod
    @contextlib.contextmanager
    def off(cls, kinds: list[str]) -> Iterator[None]:
        """Run the block with autocast off on every device type in ``kinds``."""
        with contextlib.ExitStack() as stack:
            for kind in kinds:
                stack.enter_context(torch.autocast(kind, enabled=False))
            yield


#: the autocast state "off" for each set of device types (shared: it is the same every step)
_OFF: dict[tuple[str, ...], Autocast] = {}


class Rng:
    """The torch RNG state of the CPU and of the CUDA devices a model uses."""

    def __init__(self, model: nn.Module) -> None:
        self.cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})

    def get(self) -> list[torch.Tensor]:
        """The current states (copies)."""
        if not self.cuda:  # taken at every captured forward call: the CPU's alone without a generator
            return [torch.get_rng_state()]
        return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in self.cuda)]

    def set(self, states: list[torch.Tensor]) -> None:
        """Put back states from :meth:`get`."""
        torch.set_rng_state(states[0])
        for d, s in zip(self.cuda, states[1:]):
            torch.cuda.set_rng_state(s, d)


@contextlib.contextmanager
def preserved(model: nn.Module, rng: Rng) -> Iterator[None]:
    """Replay inside the block; afterwards buffers (BatchNorm statistics), RNG states (torch, CUDA,
    numpy, ``random``) and ``inplace`` flags are as they were, and autocast is as the caller had it
    (each replay enters its own).

    In-place activations are switched off during the replay: full backward hooks refuse in-place
    outputs. ``.grad`` is never touched by a replay (it uses ``torch.autograd.grad``).
    """
    saved_rng = rng.get()
    saved_py, saved_np = random.getstate(), np.random.get_state()  # a forward may draw from them too
    with torch.no_grad():
        buffers = [(b, version(b), b.detach().clone()) for b in model.buffers()]
    inplace = [m for m in model.modules() if getattr(m, "inplace", None) is True]
    for m in inplace:
        setattr(m, "inplace", False)  # noqa: B010 - an attribute of the module's own
    kinds = devices(model)
    before = Autocast.now(kinds)
    try:
        yield
    finally:
        for m in inplace:
            setattr(m, "inplace", True)  # noqa: B010
        with torch.no_grad():
            for b, was, saved in buffers:
                if version(b) != was or was < 0:  # what the replay left alone keeps its version (never written)
                    b.copy_(saved)
        rng.set(saved_rng)
        random.setstate(saved_py)
        np.random.set_state(saved_np)
        if Autocast.now(kinds) != before:  # a replay interrupted inside an autocast block
            before.restore()
