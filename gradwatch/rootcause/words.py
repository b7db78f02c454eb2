"""Words (judge stage): how a finding says where a NaN/Inf was born, why, and which samples carry it."""

from __future__ import annotations

from typing import Any

from gradwatch.wording import layer

#: the keys of an origin (see :class:`gradwatch.step.origin.Tracker`) that a finding's data carries as they are
CARRIED = ("root_cause", "samples", "replay_ms", "source")
#: sample indices and ids named in a message at most
NAMED = 5

CAUSES = {
    "data": "data",
    "precision": "precision",
    "not_reproducible": "not reproducible",
    "model": "model",
    "weights": "weights",
}


def _listed(values: list[Any]) -> str:
    shown = ", ".join(repr(v) if isinstance(v, str) else str(v) for v in values[:NAMED])
    return shown + (f" and {len(values) - NAMED} more" if len(values) > NAMED else "")


def samples_phrase(samples: dict[str, Any] | None) -> str | None:
    """``sample 5 (id 'img-5')`` / ``samples 2, 7 (ids 'a', 'b')``, or None when none is blamed."""
    if not samples or not samples.get("indices"):
        return None
    indices = samples["indices"]
    batch = samples.get("batch")
    if isinstance(batch, int) and batch > 1 and len(indices) == batch:
        return f"every sample of the batch ({batch}): not a few bad samples"
    text = f"sample{'s' if len(indices) > 1 else ''} {_listed(indices)}"
    ids = samples.get("ids")
    if ids and any(i is not None for i in ids):
        text += f" (id{'s' if len(ids) > 1 else ''} {_listed(ids)})"
    if samples.get("call") is not None:
        text += f" (forward call {samples['call'] + 1} of the step; samples counted across its calls)"
    return text


def cause_phrase(root: dict[str, Any]) -> str | None:
    """``cause: precision (finite in float32)``: the class and its evidence in a few words (the full
    detail is the finding's ``root_cause.cause_detail``), or None when no cause was decided.
    """
    name = CAUSES.get(str(root.get("cause")))
    if name is None:
        return None
    wider = root.get("precision_replay")
    if name == "precision":
        why = f"finite when replayed in {wider}"
    elif name == "not reproducible":
        why = "the replay stayed finite" + (f" on rank {root['rank']}" if root.get("rank") is not None else "")
    elif name == "model":
        why = f"reproducible in {wider} with a finite batch" if wider else "reproducible with a finite batch"
        grew = root.get("grew") or []
        if grew:
            why += "; weights that grew: " + ", ".join(f"{layer(d['param'])} x{d['ratio']:.3g}" for d in grew)
    elif name == "weights":
        why = ""  # the message's head says it all (see weights_head)
    else:
        why = str(root.get("cause_detail") or "")
    return f"cause: {name}" + (f" ({why})" if why else "")


def _poisoned_params(root: dict[str, Any]) -> str:
    """``3 parameters in layers '0', '2' are NaN/Inf ('0.weight', '0.bias', '2.weight')``."""
    n = int(root.get("params_nonfinite") or 0)
    names = [layer(str(p)) for p in root.get("params") or []]
    layers = [layer(str(x)) for x in root.get("layers") or []]
    shown = ", ".join(names) + (f" and {n - len(names):,} more" if n > len(names) else "")
    where = f" in layer{'s' if len(layers) > 1 else ''} {', '.join(layers)}" if layers else ""
    return f"{n:,} parameter{'s' if n != 1 else ''}{where} {'are' if n != 1 else 'is'} NaN/Inf ({shown})"


def weights_detail(root: dict[str, Any], step: int) -> str:
    """The detail of a ``weights`` cause: since which step's update the weights hold NaN/Inf, and which."""
    since = root.get("poisoned_at")
    if since is not None:
        return (f"the weights hold NaN/Inf since step {since}'s update applied non-finite gradients: "
                f"{_poisoned_params(root)}")
    return (f"the weights already held NaN/Inf when step {step} began, and no step gradwatch saw before applied "
            f"non-finite gradients (NaN/Inf before watching began, or written outside an optimizer step): "
            f"{_poisoned_params(root)}")


def weights_head(root: dict[str, Any], step: int) -> str:
    """The head of a finding whose weights already held NaN/Inf when its step began."""
    since = root.get("poisoned_at")
    how = (f"step {since}'s update applied non-finite gradients (that step's finding has their cause)"
           if since is not None else
           "no step gradwatch saw before applied non-finite gradients (NaN/Inf before watching began, or "
           "written outside an optimizer step)")
    return (f"The weights hold NaN/Inf at step {step}: {how}, and {_poisoned_params(root)}; every step from here "
            "on is NaN/Inf until the weights are restored")


def op_phrase(origin: dict[str, Any]) -> str | None:
    """``NaN born in `aten::log` at model.py:12 `y = torch.log(x)` in the forward pass of feat (LogFeatures)``."""
    root = origin.get("root_cause") or {}
    if not root.get("op"):
        return None
    what = f"{root.get('born') or 'NaN/Inf'} born in "
    if root.get("param"):
        what += f"the gradient of {layer(root['param'])}, in "
    what += f"`{root['op']}`"
    if root.get("node"):
        what += f" ({root['node']})"
    if root.get("line") is not None and root.get("file"):
        import os

        what += f" at {os.path.basename(str(root['file']))}:{root['line']}"
        if root.get("code"):
            what += f" `{root['code']}`"
    if origin.get("layer") is not None:
        what += f" in the {origin.get('phase')} pass of {layer(origin['layer'], origin.get('type'))}"
    return what


def nonfinite_message(origin: dict[str, Any], step: int, what: list[str]) -> str | None:
    """The message of a non-finite finding whose step was replayed to its op (or found not reproducible),
    or None to keep the module-level message.
    """
    root = origin.get("root_cause") or {}
    head = op_phrase(origin)
    parts: list[str] = []
    if head is not None:
        head = f"{head} at step {step}: {root.get('fact')}"
    elif root.get("cause") == "not_reproducible":
        head = f"NaN/Inf at step {step} did not come back when the step was replayed"
        if origin.get("layer"):
            head += f" (latest layer with a NaN/Inf gradient: {layer(origin['layer'])})"
    elif root.get("cause") == "weights":
        head = weights_head(root, step)
    elif root.get("cause") == "data" and origin.get("source") == "input":
        head = f"The model's input batch holds NaN/Inf at step {step}"
    elif origin.get("source") == "loss":
        head = ("The gradient of the loss with respect to the model's output is already NaN/Inf (born in the loss)"
                if origin.get("phase") == "backward" else
                "The model's output is finite but the loss is NaN/Inf (born in the loss function)")
        head += f" at step {step}"
    elif root.get("cause") is None and root.get("cause_detail") and origin.get("how") == "attributed":
        head = f"NaN/Inf at step {step} was not reproduced by the replay"  # the calls or outputs it could replay
        if origin.get("layer"):
            head += f" (attributed to {layer(origin['layer'])}, {origin.get('phase')})"
        head += f": {root['cause_detail']}"
    elif origin.get("layer") is not None and root.get("note"):  # the module is known, no single op in it
        where = layer(origin["layer"], origin.get("type"))
        head = f"NaN/Inf first appeared in the {origin.get('phase')} pass of {where} at step {step}: {root['note']}"
    else:
        return None
    cause = cause_phrase(root)
    if cause is not None:
        parts.append(cause)
    blamed = samples_phrase(origin.get("samples"))
    if blamed is not None:
        parts.append(f"samples to blame: {blamed}")
    if what:
        parts.append(", ".join(what))
    return head + "; " + "; ".join(parts) + "."


def blame_sentence(samples: dict[str, Any]) -> str:
    """One sentence appended to a loss spike's or exploding step's message."""
    blamed = samples_phrase(samples)
    if blamed is not None:
        share = samples.get("share")
        verb = "carries" if len(samples["indices"]) == 1 else "carry"
        carried = f" {verb} {share:.1%} of the step's {samples.get('how')}" if isinstance(share, (int, float)) else ""
        return f"Samples to blame: {blamed}{carried}."
    if samples.get("spread"):
        return f"No few samples carry it: the {samples.get('how')} is spread over the batch."
    return f"No samples blamed: {samples.get('reason')}."


def data(origin: dict[str, Any]) -> dict[str, Any]:
    """What a finding's ``data`` keeps of an origin: ``root_cause``, ``samples`` and ``replay_ms``."""
    return {k: origin[k] for k in CARRIED if origin.get(k) is not None}


def rows(data: dict[str, Any]) -> list[tuple[str, str]]:
    """A finding's root cause and samples as ``(label, text)`` rows for people (the report and the
    dashboard): the op, the source line and its code, the fact, the cause, the samples with a summary
    of each one's values, and the replay's cost. Empty when the finding has none.
    """
    import os

    out: list[tuple[str, str]] = []
    root: dict[str, Any] = data["root_cause"] if isinstance(data.get("root_cause"), dict) else {}
    if root.get("op"):
        where = ", ".join(x for x in (root.get("node"), root.get("phase")) if x)
        op = f"{root['op']}" + (f" ({where})" if where else "")
        if root.get("layer"):
            op += f" in {layer(root['layer'])}"
        out.append(("op", op))
        if root.get("param"):
            out.append(("parameter", f"the gradient of {layer(root['param'])}"))
        if root.get("file"):
            mine = "" if root.get("user_code", True) else " (inside torch: no line of yours ran it)"
            out.append(("line", f"{os.path.basename(str(root['file']))}:{root.get('line')}{mine}"))
            if root.get("code"):
                out.append(("code", str(root["code"])))
        if root.get("fact"):
            out.append(("input fact", str(root["fact"])))
    elif root.get("note"):
        out.append(("op", str(root["note"])))
    name = CAUSES.get(str(root.get("cause")))
    if name is not None:
        detail = root.get("cause_detail")
        out.append(("cause", name + (f": {detail}" if detail else "")))
    samples: dict[str, Any] = data["samples"] if isinstance(data.get("samples"), dict) else {}
    blamed = samples_phrase(samples)
    if blamed is not None:
        share = samples.get("share")
        carried = f", {share:.1%} of the step's" if isinstance(share, (int, float)) else ", by"
        out.append(("samples", f"{blamed}{carried} {samples.get('how')}"))
        out.extend(("sample values", str(v)) for v in samples.get("values") or [])
    elif samples.get("spread"):
        out.append(("samples", f"none to blame: the {samples.get('how')} is spread over the batch"))
    elif samples.get("reason"):
        out.append(("samples", f"none blamed: {samples['reason']}"))
    if isinstance(data.get("replay_ms"), (int, float)):
        out.append(("replay", f"{data['replay_ms']:g} ms"))
    return out
