"""Captures (probe stage, every step; references only): what a replay of one forward call needs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradwatch.rootcause.state import Autocast, tensors

#: output gradients up to this many elements are kept for the replay; larger ones are replaced
#: by a finite substitute (the birth place of a NaN in backward rarely depends on its values)
KEEP_GRAD_NUMEL = 1 << 22
#: forward calls per step kept for replay (gradient accumulation)
MAX_CAPTURES = 16
#: the gradient arriving at a kept call's output is kept for the first calls of a step, and for
#: later ones whose output has at least SMALL_OUTPUT elements (a micro-batch): a hook on the
#: output of a single-sample call of a rollout costs more than the call; such a call's backward is
#: replayed with a substitute output gradient
KEEP_GRADS = 4
SMALL_OUTPUT = 1024


@dataclass
class Capture:
    """One forward call of the root module, kept by reference (nothing is copied).

    Attributes:
        args, kwargs: the call's inputs.
        rng: the RNG states it started from.
        autocast: the autocast state it ran under (a replay runs under the same).
        versions: the version counter of each input tensor, to tell inputs changed in place since.
        grad: the gradient that arrived at the model's output, when small enough to keep.
        grad_finite: a device flag saying whether that gradient was finite, when it was not kept.
        grad_kept: False for a small call after the step's first :data:`KEEP_GRADS`, whose output
            gradient is not hooked at all (see :data:`SMALL_OUTPUT`).
        grad_none: the backward pass gave the output no gradient (autograd's None): nothing came back
            through it, e.g. from a compiled model that computes its loss in its graph and returns it
            beside the output (``gw.watch(torch.compile(m))``).
        output: the call's output (its first floating-point tensor), when small enough to keep: a
            replay whose output is finite where this one was not did not reproduce the step.
        several: the call returned more than that tensor (a tuple, a dict): a gradient may have come
            back through another of its outputs, which is not kept.
        ids: the user's ids of the batch's samples (``observe(sample_ids=...)``, ``batches(loader)``),
            as given (a 1-D tensor stays on its device: it is read only if a sample is blamed).
        weak_ids: the ids are a DataLoader's indices, which the user's own replace.
        losses: the per-sample losses the loop observed (``observe(sample_losses=...)``).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: list[torch.Tensor]
    autocast: Autocast = field(default_factory=Autocast)
    versions: tuple[int, ...] = ()
    grad: torch.Tensor | None = None
    grad_finite: torch.Tensor | None = None
    grad_kept: bool = True
    grad_none: bool = False
    output: torch.Tensor | None = None
    several: bool = False
    ids: Any = None
    weak_ids: bool = False
    losses: torch.Tensor | None = None
    seq_first: bool = False  # the model takes sequence-first input (see :func:`sequence_first`)

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any], rng: list[torch.Tensor], autocast: Autocast,
           seq_first: bool = False) -> Capture:
        """A capture of a forward call starting now."""
        return cls(args, dict(kwargs) if kwargs else {}, rng, autocast, call_versions(args, kwargs),
                   seq_first=seq_first)

    def keep_grad(self, grad: torch.Tensor | None) -> None:
        """The gradient arriving at the call's output: kept, or reduced to a finiteness flag; None
        (no gradient came back through the output) is remembered as such.
        """
        if grad is None:
            self.grad_none = True
        elif grad.numel() <= KEEP_GRAD_NUMEL:
            self.grad = grad
        elif not grad.is_sparse:
            # its two ends are finite exactly when every element is (NaN propagates through min and
            # max): one pass without a temporary, where isfinite().all() cost 40x more on a CPU
            # (a GPT-2 logits gradient: 40 ms a step)
            low, high = torch.aminmax(grad.detach())
            self.grad_finite = torch.isfinite(low) & torch.isfinite(high)

    def modified(self) -> bool:
        """Whether an input tensor was changed in place after the forward (a replay would differ)."""
        return call_versions(self.args, self.kwargs) != self.versions

    @property
    def batch(self) -> int | None:
        """The batch size: the number of sample ids, else the first dimension of the first input tensor
        (its second for a sequence-first model's: see :func:`sequence_first`).
        """
        if self.ids is not None:
            return len(self.ids)
        first = next((t for t in tensors((self.args, self.kwargs)) if t.dim() > 0), None)
        if first is None:
            return None
        return int(first.shape[1]) if self.seq_first and first.dim() > 1 else int(first.shape[0])

    def sample_ids(self, indices: list[int]) -> list[Any] | None:
        """The user's ids of the samples at ``indices`` of the batch (None when no ids were given)."""
        if self.ids is None:
            return None
        return [plain(self.ids[i]) if 0 <= i < len(self.ids) else None for i in indices]


def call_versions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    """The version counter of each tensor a forward call was given (see :func:`versions`); taken at
    every captured call, so the usual one (tensors only, by position) takes one pass over them.
    """
    if not kwargs and type(args) is tuple and all(type(a) is torch.Tensor for a in args):
        try:
            return tuple(a._version for a in args)
        except RuntimeError:  # an inference tensor keeps no version counter
            pass
    return versions((args, kwargs))


def versions(obj: Any) -> tuple[int, ...]:
    """The version counter of each tensor in ``obj`` (-1 for inference tensors, which keep none).

    Taken at every forward call: an explicit stack instead of nested generators keeps it to about
    a microsecond for a batch of a few tensors.
    """
    out = []
    stack = [obj]
    while stack:
        x = stack.pop()
        kind = type(x)
        if kind is tuple or kind is list:
            stack.extend(x)
        elif kind is dict:
            stack.extend(x.values())
        elif isinstance(x, torch.Tensor):
            try:
                out.append(x._version)
            except RuntimeError:
                out.append(-1)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, Mapping):
            stack.extend(x.values())
    return tuple(out)


def checked_ids(ids: Any) -> Any:
    """Sample ids as the loop gave them, checked without reading a tensor's values.

    Raises:
        TypeError: neither a sequence nor a 1-D tensor.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise TypeError(f"observe(sample_ids=...) needs one id per sample, got a tensor of shape "
                            f"{tuple(ids.shape)}")
        return ids.detach()
    if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__len__") or not hasattr(ids, "__getitem__"):
        raise TypeError(f"observe(sample_ids=...) needs a sequence of ids (a list, tuple or 1-D tensor), "
                        f"got {type(ids).__name__}")
    return ids


def plain(x: Any) -> Any:
    """One id as a JSON-able value: a number or a string (anything else is written as its ``str``)."""
    if hasattr(x, "item") and callable(x.item):
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, (int, float, str)):
        return str(x)
    return x


def sequence_first(model: nn.Module) -> bool:
    """Whether the model's first recurrent or attention module (in module order) takes sequence-first
    input (``batch_first=False``, the default of ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and
    ``nn.MultiheadAttention``): then a ``(T, B, ...)`` input's batch is its second dimension.
    """
    first = next((m for m in model.modules() if isinstance(m, (nn.RNNBase, nn.MultiheadAttention))), None)
    return first is not None and not first.batch_first
