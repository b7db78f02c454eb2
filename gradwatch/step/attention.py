"""Attention (measure stage): each attention call's largest logit and its entropy, on sampled steps.

The attention logits ``q·k/√d`` of a transformer that is about to diverge grow step after step while
its loss still falls, and its attention collapses to one-hot (Dehghani et al. 2023; Wortsman et al.
2023; Zhai et al. 2023). No module holds them: ``F.scaled_dot_product_attention`` never makes them,
``nn.MultiheadAttention`` keeps them inside ``F.multi_head_attention_forward``, and hand-written
attention passes them straight to a softmax. So on a sampled step's forward pass (eager only) a
:class:`torch.overrides.TorchFunctionMode` sees the calls of

- ``F.scaled_dot_product_attention`` (nanoGPT, Hugging Face models' ``sdpa`` attention): the logits are
  made again from its ``query`` and ``key``, with its mask, causal flag, scale and grouped heads;
- ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.Transformer*Layer``): ``q`` and
  ``k`` from its input projection of ``query`` and ``key``, with ``attn_mask`` and ``key_padding_mask``;
- a softmax over the last dimension of a 4-D tensor ``(batch, heads, queries, keys)``, or of a 3-D one
  whose last two sizes are equal ``(batch, queries, keys)`` (hand-written attention, Hugging Face's
  ``eager`` attention): its input is the logits, scaled and masked already.

Each is measured on the first sequence of the batch (every head; at most :data:`BUDGET` logits: an
evenly spaced subset of the queries beyond it), on the device, in float32, with no gradient: per head
the largest logit (masked positions left out) and the mean over queries of the attention's entropy
in nats. The call belongs to the innermost module of the watched model whose forward runs it, a module
with weights or submodules (``blocks.0.attn``, not a ``Softmax`` leaf). Every other function passes
through untouched; the mode is on the stack for the sampled forward call only.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

#: the most logits one call's measurement makes (its first sequence, every head: a subset of its queries beyond)
BUDGET = 1 << 22
#: the frames searched for the module that runs an attention call
DEPTH = 40

SDPA, MHA, SOFTMAX = "sdpa", "mha", "softmax"
_CALLS: dict[Any, str] = {
    F.scaled_dot_product_attention: SDPA,
    F.multi_head_attention_forward: MHA,
    F.softmax: SOFTMAX,
    torch.softmax: SOFTMAX,
    torch.Tensor.softmax: SOFTMAX,
}
_MHA = inspect.signature(F.multi_head_attention_forward)


def stats(logits: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Per head (the first dimension of ``(heads, queries, keys)`` logits), its largest logit where
    ``allowed`` (True: the key takes part) and its mean entropy over queries (nats): one 1-D float32
    tensor ``[largest of each head..., entropy of each head...]``. Queries with no key allowed are left out.
    """
    logits = logits.float()
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -math.inf)
    heads = logits.shape[0]
    largest = logits.reshape(heads, -1).amax(1)
    logp = torch.log_softmax(logits, -1)
    terms = torch.where(logp > -math.inf, logp.exp() * logp, torch.zeros((), device=logits.device))
    entropy = torch.nanmean(-terms.sum(-1), dim=-1)  # a query with no key: log_softmax is NaN there
    return torch.cat([largest, entropy])


def _queries(heads: int, queries: int, keys: int, device: torch.device) -> torch.Tensor | None:
    """The queries measured when all would make more than :data:`BUDGET` logits (evenly spaced), else None."""
    if heads * queries * keys <= BUDGET:
        return None
    n = max(1, BUDGET // max(1, heads * keys))
    return torch.linspace(0, queries - 1, n, device=device).round().long().unique()


def _first(t: torch.Tensor, keep: int) -> torch.Tensor:
    """The first batch entry of ``t`` with its last ``keep`` dimensions, leading ones flattened (heads
    kept: ``(batch, heads, L, E)`` -> ``(heads, L, E)``; ``(batch, L, E)`` -> ``(1, L, E)``).
    """
    if t.dim() <= keep:
        return t.reshape(1, *t.shape)
    if t.dim() == keep + 1:
        return t[:1]
    return t.reshape(-1, *t.shape[-(keep + 1):])[0]


def sdpa(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The statistics of a ``scaled_dot_product_attention`` call (None: not a plain tensor's)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = {**dict(zip(names, args)), **kwargs}
    q, k = bound["query"], bound["key"]
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor:
        return None
    mask = bound.get("attn_mask")
    scale = bound.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q0, k0 = _first(q, 2), _first(k, 2)
    if k0.shape[0] != q0.shape[0]:  # grouped-query attention: each key head serves several query heads
        k0 = k0.repeat_interleave(q0.shape[0] // k0.shape[0], dim=0)
    heads, queries, keys = q0.shape[0], q0.shape[-2], k0.shape[-2]
    rows = _queries(heads, queries, keys, q.device)
    if rows is not None:
        q0 = q0[:, rows]
    logits = q0.float() @ k0.float().transpose(-1, -2) * scale
    allowed = None
    if bound.get("is_causal"):
        allowed = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril()
        allowed = allowed[rows] if rows is not None else allowed
    elif isinstance(mask, torch.Tensor):
        full = _first(mask.expand(*q.shape[:-2], queries, keys), 2)
        full = full[:, rows] if rows is not None else full
        if full.dtype == torch.bool:
            allowed = full
        else:
            logits = logits + full.float()
    return stats(logits, allowed)


def mha(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The statistics of a ``multi_head_attention_forward`` call (``nn.MultiheadAttention``'s)."""
    bound = _MHA.bind(*args, **kwargs).arguments
    query, key = bound["query"], bound["key"]
    if type(query) is not torch.Tensor or bound.get("static_k") is not None:
        return None
    embed, heads = query.shape[-1], int(bound["num_heads"])
    x_q = query[:, 0] if query.dim() == 3 else query  # (L, N, E): the first sequence
    x_k = key[:, 0] if key.dim() == 3 else key
    if bound.get("use_separate_proj_weight"):
        w_q, w_k = bound["q_proj_weight"], bound["k_proj_weight"]
    else:
        w_q, w_k = bound["in_proj_weight"][:embed], bound["in_proj_weight"][embed:2 * embed]
    bias = bound.get("in_proj_bias")
    b_q, b_k = (bias[:embed], bias[embed:2 * embed]) if bias is not None else (None, None)
    d = embed // heads
    q = F.linear(x_q, w_q, b_q).float().reshape(-1, heads, d).transpose(0, 1)  # (heads, L, d)
    k = F.linear(x_k, w_k, b_k).float().reshape(-1, heads, d).transpose(0, 1)
    queries, keys = q.shape[1], k.shape[1]
    rows = _queries(heads, queries, keys, q.device)
    if rows is not None:
        q = q[:, rows]
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)
    allowed = torch.ones_like(logits, dtype=torch.bool)
    mask = bound.get("attn_mask")
    if isinstance(mask, torch.Tensor):  # (L, S) or (N * heads, L, S): True or -inf is a key left out
        mask = mask[:heads] if mask.dim() == 3 else mask
        mask = mask[..., rows, :] if rows is not None else mask
        if mask.dtype == torch.bool:
            allowed = allowed & ~mask
        else:
            logits = logits + mask.float()
    padding = bound.get("key_padding_mask")
    if isinstance(padding, torch.Tensor):  # (N, S)
        pad = padding[0] if padding.dim() == 2 else padding
        if pad.dtype == torch.bool:
            allowed = allowed & ~pad
        else:
            logits = logits + pad.float()
    return stats(logits, allowed)


def softmax(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The statistics of a softmax over attention logits (None: a softmax of anything else)."""
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if type(x) is not torch.Tensor or not x.is_floating_point() or not isinstance(dim, int):
        return None
    n = x.dim()
    if dim % max(n, 1) != n - 1 or not (n == 4 or (n == 3 and x.shape[-1] == x.shape[-2])):
        return None
    z = _first(x, 2)
    rows = _queries(z.shape[0], z.shape[1], z.shape[2], x.device)
    return stats(z[:, rows] if rows is not None else z)


_MEASURES: dict[str, Callable[[tuple[Any, ...], dict[str, Any]], torch.Tensor | None]] = {
    SDPA: sdpa, MHA: mha, SOFTMAX: softmax}


def measure(kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """One attention call's statistics, launched on the device: no gradient, no autocast."""
    cuda = torch.autocast("cuda", enabled=False) if torch.cuda.is_available() else contextlib.nullcontext()
    with torch.no_grad(), torch.autocast("cpu", enabled=False), cuda:
        return _MEASURES[kind](args, kwargs)


def calling_module(names: dict[int, str], frame: Any) -> str | None:
    """The path of the innermost module in ``names`` whose forward runs ``frame`` (its ``self``, or the
    ``module`` a Hugging Face attention function is given), or None.
    """
    for _ in range(DEPTH):
        if frame is None:
            return None
        local = frame.f_locals
        for key in ("self", "module"):
            found = names.get(id(local.get(key)))
            if found is not None:
                return found
        frame = frame.f_back
    return None


def module_names(model: nn.Module, root: str) -> dict[int, str]:
    """The modules an attention call can belong to, by id: those with weights or submodules (a
    ``Softmax`` or ``Dropout`` leaf stands for the module that calls it).
    """
    out = {}
    for name, module in model.named_modules():
        if next(module.children(), None) is not None or next(module.parameters(recurse=False), None) is not None:
            out[id(module)] = name or root
    return out


class Watching(TorchFunctionMode):
    """The mode on the stack during a sampled forward call: hands each attention call to ``seen``."""

    def __init__(self, seen: Callable[[str, tuple[Any, ...], dict[str, Any], Any], None]) -> None:
        super().__init__()
        self._seen = seen

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        try:
            kind = _CALLS.get(func)
        except TypeError:  # an unhashable callable: no attention
            kind = None
        if kind is not None and not torch.compiler.is_dynamo_compiling():
            self._seen(kind, args, kwargs, sys._getframe(1))
        return func(*args, **kwargs)
