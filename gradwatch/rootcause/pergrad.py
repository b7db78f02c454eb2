"""Per-sample blame (judge stage, rare path): the samples that carry a loss spike or an exploding step.

Each sample's share is its per-sample loss when the loop observed them
(``observe(sample_losses=...)``), else the norm of its own contribution to the step's gradient,
``J_i^T g_i`` (``g_i`` its row of the gradient that reached the model's output), computed with
``torch.func`` (``vmap`` of ``grad`` over the batch) or, for models that mix samples
(BatchNorm in training) or that ``vmap`` cannot run, with one backward per sample of the replayed
step. The samples blamed are the fewest that carry half the total, when they are few.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from gradwatch.rootcause.capture import Capture
from gradwatch.rootcause.samples import batch_dim, blamed, concentrated
from gradwatch.rootcause.state import Rng, first_tensor

#: the largest batch blamed per sample
MAX_BATCH = 4096
#: the largest batch blamed with one backward per sample (when torch.func cannot be used)
LOOP_BATCH = 64
#: samples per vmap chunk (bounds the memory of the per-sample gradients)
CHUNK = 16


def _mixes_samples(model: nn.Module) -> bool:
    """Whether a layer computes across the batch (BatchNorm in training): per-sample replays would differ."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())


def _vmapped(model: nn.Module, cap: Capture, grad: torch.Tensor) -> torch.Tensor:
    """``||J_i^T g_i||`` for every sample ``i``, with ``torch.func.vmap(grad(...))`` over the batch."""
    from torch.func import functional_call, vmap
    from torch.func import grad as func_grad

    batch = grad.shape[0]
    train = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    fixed = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    fixed.update(dict(model.named_buffers()))

    def dim(x: Any) -> int | None:
        return 0 if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch else None

    dims = pytree.tree_map(dim, (cap.args, cap.kwargs))

    def one(params: dict[str, torch.Tensor], inputs: Any, g: torch.Tensor) -> torch.Tensor:
        args, kwargs = pytree.tree_map(lambda x, d: x.unsqueeze(0) if d == 0 else x, inputs, dims)
        out = first_tensor(functional_call(model, {**params, **fixed}, tuple(args), dict(kwargs)))
        if out is None:
            raise TypeError("the model's output holds no floating-point tensor")
        return (out * g.unsqueeze(0).to(out.dtype)).sum()

    with cap.autocast.applied():
        per = vmap(func_grad(one), in_dims=(None, dims, 0), randomness="different",
                   chunk_size=CHUNK)(train, (cap.args, cap.kwargs), grad)
    return torch.stack([v.reshape(batch, -1).double().pow(2).sum(1) for v in per.values()]).sum(0).sqrt()


def _looped(model: nn.Module, cap: Capture, grad: torch.Tensor, rng: Rng) -> torch.Tensor:
    """``||J_i^T g_i||`` for every sample ``i``, with one backward per sample through the replayed step."""
    rng.set(cap.rng)
    with cap.autocast.applied(), torch.enable_grad():
        out = first_tensor(model(*cap.args, **cap.kwargs))
    if out is None or not out.requires_grad:
        raise TypeError("the model's output holds no tensor that requires grad")
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for i in range(grad.shape[0]):
        gi = torch.zeros_like(grad)
        gi[i] = grad[i]
        grads = torch.autograd.grad(out, params, grad_outputs=gi, retain_graph=i < grad.shape[0] - 1, allow_unused=True)
        zero = torch.zeros((), dtype=torch.float64)
        norms.append(sum((x.double().pow(2).sum() for x in grads if x is not None), zero))
    return torch.stack(norms).sqrt()


def grad_norms(model: nn.Module, cap: Capture, rng: Rng) -> tuple[torch.Tensor | None, str]:
    """Per-sample gradient norms of one forward call, and how they were computed (or why not)."""
    grad, batch = cap.grad, cap.batch
    if grad is None and cap.grad_none:
        return None, ("no gradient came back through the model's first output (the loss came through another one, "
                      "as a compiled model's own loss does), so per-sample gradients are unknown; "
                      "observe(sample_losses=...) names them")
    if grad is None:
        return None, "the gradient at the model's output was too large to keep, so per-sample gradients are unknown"
    if grad.dim() == 0:  # a Hugging Face model given labels returns its loss first
        return None, ("the model returns a scalar first (its own loss, as a Hugging Face model given labels does), "
                      "which mixes the samples; observe(sample_losses=...) names them")
    if batch is None or batch_dim(grad, batch) != 0:
        return None, "the model's output has no leading batch dimension"
    if batch > MAX_BATCH:
        return None, f"the batch has more than {MAX_BATCH:,} samples"
    reason = "BatchNorm in training mixes the samples of a batch"
    if not _mixes_samples(model):
        try:
            return _vmapped(model, cap, grad), "per-sample gradient norm (torch.func)"
        except Exception as exc:  # vmap refuses some models (in-place ops on inputs, data-dependent flow)
            reason = f"torch.func could not run the model per sample ({type(exc).__name__}: {exc})"
    if batch <= LOOP_BATCH:
        return _looped(model, cap, grad, rng), "per-sample gradient norm (one backward per sample)"
    return None, reason


def blame(model: nn.Module, captures: list[Capture], rng: Rng, *, losses: bool) -> dict[str, Any]:
    """The samples of the step (its micro-batches counted in order) that carry most of it.

    Args:
        model: the watched model.
        captures: the step's forward calls.
        rng: the RNG the replays set.
        losses: use the observed per-sample losses when there are (a loss spike); else per-sample
            gradient norms (an exploding step).

    Returns:
        the ``samples`` record of the findings: ``indices`` (empty when no few samples carry it:
        ``spread`` True), ``ids``, ``how``, ``share`` (of the total they carry), ``values`` (a
        summary of each one's inputs); or ``indices`` empty and ``reason`` when it could not be
        computed.
    """
    scores: list[torch.Tensor] = []
    how = ""
    for cap in captures:
        observed = cap.losses if losses and cap.losses is not None and cap.losses.numel() == cap.batch else None
        if observed is not None:
            score, how = observed.detach().double().reshape(-1).cpu(), "per-sample loss (observed)"
        else:
            found, how = grad_norms(model, cap, rng)
            if found is None:
                return {"indices": [], "ids": None, "how": None, "reason": how}
            score = found.detach().cpu()
        scores.append(score)
    if not scores:
        return {"indices": [], "ids": None, "how": None, "reason": "no forward call of the step was kept"}
    every = torch.cat(scores)
    chosen = concentrated(every)
    total = float(every.clamp(min=0).sum())
    top = [round(float(x) / total, 4) if total > 0 else None for x in torch.sort(every, descending=True).values[:3]]
    if chosen is None:
        return {"indices": [], "ids": None, "how": how, "spread": True, "top_shares": top,
                "batch": int(every.numel())}
    share = round(sum(float(every[i]) for i in chosen) / total, 4) if total > 0 else None
    out: dict[str, Any] = {"indices": [], "ids": [], "values": [], "how": how, "share": share, "top_shares": top,
                           "batch": int(every.numel())}
    start = 0
    for cap, score in zip(captures, scores):
        mine = [i - start for i in chosen if start <= i < start + len(score)]
        if mine:
            part = blamed(cap, mine, how, offset=start)
            out["indices"] += part["indices"]
            out["values"] += part["values"]
            out["ids"] = None if out["ids"] is None or part["ids"] is None else out["ids"] + part["ids"]
        start += len(score)
    return out
