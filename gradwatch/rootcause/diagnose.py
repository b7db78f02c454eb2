"""Diagnose (judge stage, rare path): from the module the first replay located to the op, line, cause and samples."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradwatch.rootcause import cause, inputs, nodes, ops
from gradwatch.rootcause.capture import Capture
from gradwatch.rootcause.locate import Located
from gradwatch.rootcause.samples import blamed, concentrated, nonfinite_rows, outliers
from gradwatch.rootcause.state import Rng
from gradwatch.store.records import ROOT
from gradwatch.watching.parametrized import layers_of
from gradwatch.wording import layer


def _rank() -> int | None:
    """The rank of this process in distributed training, or None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return int(dist.get_rank())
    return None


def not_reproducible(replayed: int, seen_in: str) -> dict[str, Any]:
    """The origin of a step whose replay stayed finite.

    Args:
        replayed: how many forward calls were replayed.
        seen_in: ``output`` when the step's own output was NaN/Inf (the fault happened here, in
            the forward pass), ``gradients`` when only its gradients were (in backward, or, on
            several ranks, arrived through the gradient all-reduce from another rank).
    """
    rank = _rank()
    on = f" on rank {rank}" if rank is not None else ""
    what = "the step's own output was NaN/Inf" if seen_in == "output" else "the step's gradients were NaN/Inf"
    detail = (f"the replay of the step{on} (same batch, same RNG state, {replayed} forward call(s)) stayed finite "
              f"where {what}: a non-deterministic kernel, a race, or faulty hardware (silent data corruption)"
              "; a forward pass with side effects that a replay cannot repeat looks the same")
    if rank is not None and seen_in == "gradients":
        detail += "; this rank's own output was finite, so the NaN/Inf may have come from another rank through " \
                  "the gradient all-reduce"
    root: dict[str, Any] = {"cause": cause.NOT_REPRODUCIBLE, "cause_detail": detail, "seen_in": seen_in}
    if rank is not None:
        root["rank"] = rank
    return {"how": "attributed", "root_cause": root,
            "note": "the replay did not reproduce the NaN/Inf: the layer is the latest with a NaN/Inf gradient"}


def poisoned(model: nn.Module) -> dict[str, Any] | None:
    """The origin of a step whose weights already hold NaN/Inf, or None when they are finite.

    An earlier update that applied non-finite gradients leaves NaN/Inf in the weights, and from then
    on every forward pass is NaN/Inf from its first op: no replay can find a birth place, and a cause
    read off the replay ("reproducible with a finite batch") would be wrong. Only the parameters that
    received a gradient this step are checked (an unused one cannot have made it), in one host read.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    if not named:
        return None
    try:
        with torch.no_grad():
            ok = torch.stack([torch.isfinite(p.detach()).all().to("cpu") for _, p in named]).tolist()
    except Exception:  # sharded (DTensor) or scattered parameters: no claim about the weights
        return None
    bad = [n for (n, _), fine in zip(named, ok) if not fine]
    if not bad:
        return None
    owners: dict[str, tuple[str, str]] = {}  # parameter name -> (its layer's path, the layer's class)
    of = layers_of(model)  # a parametrization's original is its parametrized module's
    for path, module in model.named_modules():
        at, owner = of[id(module)]
        for name, _ in module.named_parameters(recurse=False):
            owners.setdefault(f"{path}.{name}" if path else name, (at or ROOT, type(owner).__name__))
    layers = list(dict.fromkeys(owners.get(n, (ROOT, ""))[0] for n in bad))
    first = owners.get(bad[0], (ROOT, type(model).__name__))
    root = {"cause": cause.WEIGHTS, "params": bad[:cause.NAMED], "params_nonfinite": len(bad),
            "layers": layers[:cause.NAMED]}
    return {"how": "inspected", "phase": "forward", "layer": first[0], "type": first[1], "source": "weights",
            "root_cause": root}


def diagnose(model: nn.Module, cap: Capture, located: Located, rng: Rng, reference: dict[str, float]) -> dict[str, Any]:
    """The full origin of a reproduced NaN/Inf: today's module-level fields plus ``root_cause`` and ``samples``."""
    origin = located.origin()
    batch = cap.batch
    if located.source == "input":
        origin["samples"] = blamed(cap, nonfinite_rows((cap.args, cap.kwargs), batch) or [],
                                   "samples of the batch holding NaN/Inf")
        named = inputs.held(model, cap)  # by name, in which rows (a sparse adjacency's too)
        origin["root_cause"] = {"cause": cause.DATA, "cause_detail": inputs.words(named) or "the batch itself "
                                "holds NaN/Inf", **({"inputs": named} if named else {})}
        return origin
    if located.source == "loss":
        loss_rows = nonfinite_rows(located.output, batch) if located.output is not None else None
        if loss_rows:
            origin["samples"] = blamed(cap, loss_rows, "rows of the loss's gradient at the model's output that are "
                                       "NaN/Inf")
        origin["root_cause"] = {"cause": None, "cause_detail": "born in the loss function, which runs outside the "
                                "model and is not replayed: check it for log/division of zero and for exp of a "
                                "large value (a VAE's logvar.exp())"}
        return origin
    assert located.module is not None
    search = ops.search if located.phase == "forward" else nodes.search
    born, call = search(model, cap, located, rng)
    root: dict[str, Any] = born.to_json() if born is not None else {
        "op": None, "note": f"no single op inside {layer(located.name)} gave birth to the NaN/Inf in the replay"}
    if born is not None and born.layer not in (None, located.name):
        origin["layer"] = born.layer
        origin["type"] = type(dict(model.named_modules()).get(born.layer, located.module)).__name__
        origin["note"] = (f"{layer(located.name, located.kind)} returns -inf/inf by design; the first NaN/Inf "
                          f"that was not meant was born in {layer(born.layer)}")
    rows = None
    if born is not None and born.rows is not None:
        rows = nonfinite_rows(born.rows, batch)
    if rows is None and located.phase == "forward":
        rows = nonfinite_rows(located.output, batch)
    if rows is None and located.phase == "backward" and born is not None and born.param is not None:
        rows = _weight_rows(born, batch)
    if rows:
        how = ("rows of the op's output that are NaN/Inf" if located.phase == "forward"
               else "rows whose products input x grad_output carry the overflowing weight gradient"
               if born is not None and born.param is not None and born.rows is None
               else "rows of the gradient the op made that are NaN/Inf")
        origin["samples"] = blamed(cap, rows, how)
    root.update(_cause(model, cap, located, call, rng, reference, rows, born))
    origin["root_cause"] = root
    return origin


def _weight_rows(born: ops.Born, batch: int | None) -> list[int] | None:
    """Samples carrying an overflowing weight gradient: the fewest rows whose ``|x_i| |g_i|`` carry
    half of it (see :func:`gradwatch.rootcause.nodes._row_scores`).
    """
    if born.scores is None or batch is None or born.scores.numel() != batch:
        return None
    return concentrated(born.scores)


def _cause(model: nn.Module, cap: Capture, located: Located, call: dict[str, Any], rng: Rng,
           reference: dict[str, float], rows: list[int] | None, born: ops.Born | None) -> dict[str, Any]:
    """The cause class and its detail: outlier samples are data (even when a wider type would survive
    them), else a wider type that stays finite is precision, else some samples whose own values hit
    the op (its offending input carries no trainable weight) are data, else the model.
    """
    module = located.module
    assert module is not None
    op = born.op if born is not None else None
    dtype: str | None = None
    wider: bool | None = None
    note: str | None = "the origin module's call was not seen again in the replay"
    if call:
        wider, dtype = cause.precision(module, call, located, cap.autocast, rng)
        note = None
        if wider is None:
            note, dtype = dtype, None
    batch = cap.batch
    stand_out = outliers(cap, rows) if rows and batch is not None and len(rows) < batch else None
    if stand_out is not None:
        assert rows is not None
        detail = f"only {len(rows)} of the batch's {batch} samples went NaN/Inf and {stand_out}"
        if wider:
            detail += f" (in {dtype} they would stay finite)"
        return {"cause": cause.DATA, "cause_detail": detail, **({"precision_replay": dtype} if dtype else {})}
    if wider:
        return {"cause": cause.PRECISION, "cause_detail": cause.words_precision(located, str(dtype), cap.autocast, op),
                "precision_replay": dtype}
    if born is not None and born.weightless and rows and batch is not None and (len(rows) < batch or batch == 1):
        line = born.line.short() if born.line is not None else None
        return {"cause": cause.DATA, "cause_detail": cause.words_batch(rows, batch, born.culprit, line),
                "culprit": born.culprit, **({"precision_replay": dtype} if dtype else {})}
    kept = inputs.buffers(model)  # reproducible with a finite batch, from NaN/Inf the model keeps (an adjacency)
    if kept:
        return {"cause": cause.DATA, "cause_detail": inputs.words(kept), "inputs": kept}
    # every sample made it at an op no trainable weight enters: the code (or the whole batch), no weight to name
    everyone = born is not None and born.weightless and bool(rows) and batch is not None and len(rows or []) >= batch
    grew = [] if everyone else cause.grown(model, reference)
    out: dict[str, Any] = {"cause": cause.MODEL, "cause_detail": cause.words_model(grew, dtype, everyone)}
    if grew:
        out["grew"] = grew
    if dtype:
        out["precision_replay"] = dtype
    if note:
        out["cause_note"] = note
    return out


def reference_norms(model: nn.Module) -> dict[str, float]:
    """Every parameter's norm now (one host read; taken once, when watching begins)."""
    named = [(n, p) for n, p in model.named_parameters() if not p.is_meta]
    if not named:
        return {}
    try:
        with torch.no_grad():
            # a complex parameter's norm is of its magnitudes: real, no cast that drops the imaginary part
            values = torch.stack([(p.detach().abs() if p.is_complex() else p.detach()).float().norm().to("cpu")
                                  for _, p in named]).tolist()
    except Exception:  # parameters on several devices, sharded (DTensor), or not materialised: no reference
        return {}
    return dict(zip((n for n, _ in named), values))
