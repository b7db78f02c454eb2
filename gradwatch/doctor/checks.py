"""Doctor checks: gradient path, train mode, gradient flow, activations, overfitting one batch."""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from gradwatch.doctor.context import Probe, _Activation, _Context
from gradwatch.doctor.results import FAIL, HINTS, PASS, WARN, CheckResult, DoctorOptions
from gradwatch.doctor.target import _names, compute_loss
from gradwatch.step.origin import tensors
from gradwatch.store.records import ROOT
from gradwatch.wording import layer as _layer
from gradwatch.wording import plural


# ------------------------------------------------------------------------------------------------ the checks
def check_gradient_path(ctx: _Context) -> CheckResult:
    """Trainable parameters that receive no gradient (fail), frozen parameters (warn)."""
    probe = ctx.probe()
    name = "gradient_path"
    data: dict[str, Any] = {"trainable": probe.trainable, "frozen": probe.frozen}
    frozen_names = _names([_layer(n) for n in probe.frozen])
    frozen = f"{len(probe.frozen)} frozen (requires_grad=False): {frozen_names}" if probe.frozen else ""
    if not probe.trainable:
        evidence = "the model has no trainable parameters" + (f"; {frozen}" if frozen else "")
        return CheckResult(name, FAIL, evidence, HINTS["no_params"], data)
    missing = [n for n in probe.trainable if probe.grads[n] is None]
    data["unused"] = missing
    if missing:
        what = ("the loss does not depend on any trainable parameter (it has no grad_fn): "
                if not probe.requires_grad else "")
        evidence = (f"{what}{len(missing)} of {len(probe.trainable)} trainable parameters got no gradient, "
                    f"unused or detached: {_names([_layer(n) for n in missing])}")
        return CheckResult(name, FAIL, evidence + (f"; {frozen}" if frozen else ""), HINTS["unused"], data)
    if probe.frozen:
        return CheckResult(name, WARN, f"{frozen}: frozen by mistake?", HINTS["frozen"], data)
    return CheckResult(name, PASS, f"all {len(probe.trainable)} trainable parameters received a gradient; none frozen",
                       data=data)


def check_train_mode(ctx: _Context) -> CheckResult:
    """The model in eval mode, or submodules in eval mode under a model in train mode (warn)."""
    name = "train_mode"
    model = ctx.model
    if not model.training:
        return CheckResult(name, WARN, f"the model ({type(model).__name__}) is in eval mode (model.training is False)",
                           HINTS["mode"], {"eval": [ROOT]})
    modules = dict(model.named_modules())
    top = [n for n, m in modules.items() if n and not m.training and modules[n.rpartition(".")[0]].training]
    if top:
        listed = [_layer(n, type(modules[n]).__name__) for n in top]
        verb = "is" if len(top) == 1 else "are"
        evidence = (f"the model is in train mode but {plural(len(top), 'submodule')} {verb} in eval mode: "
                    f"{_names(listed)}")
        return CheckResult(name, WARN, evidence, HINTS["mode"], {"eval": top})
    return CheckResult(name, PASS, f"the model and its {len(modules) - 1} submodules are in train mode", data={})


def _layer_norms(probe: Probe) -> list[tuple[str, float, float, bool]]:
    """(layer, gradient norm, per-element RMS, finite) of each layer that received a gradient."""
    out = []
    for layer, params in probe.layers:
        grads = [g for g in (probe.grads[p] for p in params) if g is not None]
        if not grads:
            continue
        squares = sum(float(g.double().pow(2).sum()) for g in grads)
        numel = sum(g.numel() for g in grads)
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        norm = math.sqrt(squares) if math.isfinite(squares) else math.inf
        out.append((layer, norm, norm / math.sqrt(max(numel, 1)), finite))
    return out


def check_gradient_flow(ctx: _Context) -> CheckResult:
    """Per-layer gradient norms at initialisation: non-finite (fail), vanishing, exploding (warn)."""
    name = "gradient_flow"
    probe = ctx.probe()
    opts = ctx.options
    layers = _layer_norms(probe)
    if not layers:
        return CheckResult(name, FAIL, "no layer received a gradient (see gradient_path)", HINTS["unused"])
    data: dict[str, Any] = {"loss": probe.loss, "norms": {layer: norm for layer, norm, _, _ in layers}}
    bad = [layer for layer, _, _, finite in layers if not finite]
    if bad or not math.isfinite(probe.loss):
        evidence = (f"loss {probe.loss:.4g}; non-finite gradients in {plural(len(bad), 'layer')}: "
                    f"{_names([_layer(n) for n in bad])}")
        return CheckResult(name, FAIL, evidence, HINTS["nonfinite_grad"], {**data, "nonfinite": bad})
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in probe.grads.values() if g is not None))
    data["global_norm"] = total
    shown = _flow_summary(probe, layers, total)
    if total < opts.vanishing_norm:
        evidence = f"global gradient norm {total:.3g} < {opts.vanishing_norm:g}: no learning signal; {shown}"
        return CheckResult(name, FAIL, evidence, HINTS["no_signal"], data)
    findings, hints = _flow_findings(layers, total, opts)
    data.update(findings)
    if not hints:
        return CheckResult(name, PASS, shown, data=data)
    sentences = "; ".join(_flow_sentences(findings, total, opts))
    return CheckResult(name, WARN, f"{sentences}; {shown}", "; ".join(HINTS[h] for h in hints), data)


def _flow_summary(probe: Probe, layers: list[tuple[str, float, float, bool]], total: float) -> str:
    (first, first_norm, _, _), (last, last_norm, _, _) = layers[0], layers[-1]
    if len(layers) == 1:
        return f"1 layer, {_layer(first, probe.types.get(first, '?'))} gradient norm {first_norm:.3g}"
    return (f"{len(layers)} layers, gradient norm of the first {_layer(first, probe.types.get(first, '?'))} "
            f"{first_norm:.3g}, of the last {_layer(last, probe.types.get(last, '?'))} {last_norm:.3g}, "
            f"global {total:.3g}")


def _flow_findings(layers: list[tuple[str, float, float, bool]], total: float,
                   opts: DoctorOptions) -> tuple[dict[str, Any], list[str]]:
    rms = [(layer, r) for layer, _, r, _ in layers]
    median = statistics.median(r for _, r in rms)
    vanishing = {layer for layer, r in rms if median > 0 and r < opts.vanishing_ratio * median}
    positive = [(i, r) for i, (_, r) in enumerate(rms) if r > 0]
    # a gradient of exactly zero where other layers have one: the path to them is cut (dead units
    # of a functional ReLU), whatever the median (half the layers or more at zero make it 0)
    zero = [layer for layer, r in rms if r == 0] if positive else []
    vanishing |= set(zero)
    i_min, smallest = min(positive, key=lambda x: x[1], default=(0, 1.0))
    i_max, largest = max(positive, key=lambda x: x[1], default=(0, 1.0))
    spread = largest / smallest
    shrinking = spread > opts.spread_ratio and i_min < i_max
    if shrinking:
        vanishing |= {layer for layer, r in rms if r < largest / opts.spread_ratio}
    findings: dict[str, Any] = {
        "median_rms": median, "largest_rms": largest, "spread": spread, "shrinking": shrinking, "zero": zero,
        "vanishing": [layer for layer, _ in rms if layer in vanishing],
        "exploding": total > opts.exploding_norm or (spread > opts.spread_ratio and not shrinking),
    }
    hints = (["dead"] if zero else []) + (["vanishing"] if vanishing - set(zero) else []) \
        + (["exploding"] if findings["exploding"] else [])
    return findings, hints


def _flow_sentences(findings: dict[str, Any], total: float, opts: DoctorOptions) -> list[str]:
    out = []
    zero = findings.get("zero", [])
    if zero:
        out.append(f"vanishing: {plural(len(zero), 'layer')} with a gradient of exactly 0 while others have "
                   f"one (a path cut by dead units?): {_names([_layer(n) for n in zero])}")
    names = [n for n in findings["vanishing"] if n not in zero]
    if names:
        rule = f"RMS < {opts.vanishing_ratio:g} x the median layer's ({findings['median_rms']:.3g})"
        if findings["shrinking"]:
            rule += (f" or, as the gradient shrinks {findings['spread']:.3g}x towards the input, "
                     f"< 1/{opts.spread_ratio:g} of the largest ({findings['largest_rms']:.3g})")
        out.append(f"vanishing: {plural(len(names), 'layer')} with gradient {rule}: "
                   f"{_names([_layer(n) for n in names])}")
    if findings["exploding"]:
        if total > opts.exploding_norm:
            out.append(f"exploding: global gradient norm {total:.3g} > {opts.exploding_norm:g}")
        if findings["spread"] > opts.spread_ratio and not findings["shrinking"]:
            out.append(f"exploding: the layer gradient RMS grows {findings['spread']:.3g}x towards the input "
                       f"(limit {opts.spread_ratio:g})")
    return out


def check_activations(ctx: _Context) -> CheckResult:
    """Activations at initialisation: non-finite (fail), dead ReLU units, saturated sigmoid/tanh (warn)."""
    name = "activations"
    bad_inputs = [i for i, t in enumerate(tensors(ctx.batch)) if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad_inputs:
        return CheckResult(name, FAIL, f"the batch itself holds non-finite values (tensor #{bad_inputs[0]} in "
                           "traversal order)", HINTS["nonfinite_act"])
    probe = ctx.probe()
    opts = ctx.options
    if probe.first_nonfinite is not None or not math.isfinite(probe.loss):
        return _nonfinite_activation(probe)
    acts = probe.activations
    dead = {n: a.dead / a.units for n, a in acts.items() if a.units}
    saturated = {n: a.saturated / a.elements for n, a in acts.items() if a.elements}
    data = {"dead_fraction": dead, "saturated_fraction": saturated}
    dead_bad = [n for n, f in dead.items() if f > opts.dead_fraction]
    sat_bad = [n for n, f in saturated.items() if f > opts.saturation_fraction]
    if dead_bad or sat_bad:
        parts = []
        if dead_bad:
            listed = [f"{_layer(n, acts[n].type)} {dead[n]:.0%} of {acts[n].units}" for n in dead_bad]
            parts.append(f"dead units (zero for every sample) in {plural(len(dead_bad), 'layer')}: {_names(listed)}")
        if sat_bad:
            listed = [f"{_layer(n, acts[n].type)} {saturated[n]:.0%}" for n in sat_bad]
            parts.append(f"saturated outputs (within 1% of a bound) in {plural(len(sat_bad), 'layer')}: "
                         f"{_names(listed)}")
        hints = ([HINTS["dead"]] if dead_bad else []) + ([HINTS["saturated"]] if sat_bad else [])
        return CheckResult(name, WARN, "; ".join(parts), "; ".join(hints), data)
    return CheckResult(name, PASS, _activation_summary(acts, dead, saturated), data=data)


def _nonfinite_activation(probe: Probe) -> CheckResult:
    if probe.first_nonfinite is None:
        evidence = f"every module's output is finite but the loss is {probe.loss}: the loss computation makes it"
        return CheckResult("activations", FAIL, evidence, HINTS["nonfinite_grad"], {"first_nonfinite": None})
    first, inputs_finite = probe.first_nonfinite
    evidence = f"the first non-finite output is from {_layer(first, probe.types.get(first, '?'))}"
    if inputs_finite:
        evidence += ", whose inputs were finite: it is born there"
    else:
        parent = first.rpartition(".")[0] or ROOT
        evidence += (f", but its inputs were already non-finite: it is born in code between modules, e.g. in the "
                     f"forward of {_layer(parent, probe.types.get(parent, '?'))}")
    return CheckResult("activations", FAIL, evidence, HINTS["nonfinite_act"], {"first_nonfinite": first})


def _activation_summary(acts: dict[str, _Activation], dead: dict[str, float], saturated: dict[str, float]) -> str:
    parts = [f"{len(acts)} leaf modules ran, every module's output finite"]
    if dead:
        worst = max(dead, key=lambda n: dead[n])
        parts.append(f"most dead units {dead[worst]:.0%} in {_layer(worst, acts[worst].type)}")
    if saturated:
        worst = max(saturated, key=lambda n: saturated[n])
        parts.append(f"most saturated {saturated[worst]:.0%} in {_layer(worst, acts[worst].type)}")
    if not dead and not saturated:
        parts.append("no ReLU-family or saturating activation module (functional ones are not seen)")
    return "; ".join(parts)


def check_overfit(ctx: _Context) -> CheckResult:
    """Adam on the one batch: the loss must fall to ``overfit_target`` of its start (or below ``overfit_floor``)."""
    name = "overfit_batch"
    opts = ctx.options
    model = ctx.fresh_model()
    batch = ctx.fresh_batch()
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return CheckResult(name, FAIL, "no trainable parameters to fit", HINTS["no_params"])
    optimizer = torch.optim.Adam(params, lr=opts.lr)
    losses: list[float] = []
    for step in range(opts.steps + 1):
        loss = compute_loss(model, batch, ctx.loss_fn)
        value = float(loss.detach())
        losses.append(value)
        data = {"losses": losses, "steps": step, "lr": opts.lr}
        if not math.isfinite(value) and step == 0:  # before any update: not the learning rate's doing
            return CheckResult(name, FAIL, f"the loss is {value} before any update", HINTS["nonfinite_loss"], data)
        if not math.isfinite(value):
            return CheckResult(name, FAIL, f"the loss became {value} at step {step} (Adam, lr {opts.lr:g}; "
                               f"initial {losses[0]:.4g})", HINTS["diverged"], data)
        if step == 0 and 0 <= value < opts.overfit_floor:
            return CheckResult(name, WARN, f"the initial loss {value:.3g} is already below {opts.overfit_floor:g}: "
                               "nothing to learn on this batch", HINTS["trivial"], data)
        if (step and _fitted(losses[0], value, opts)) or step == opts.steps:
            break
        if not loss.requires_grad:
            return CheckResult(name, FAIL, "the loss does not depend on any trainable parameter", HINTS["unused"], data)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return _overfit_result(losses, opts)


def _fitted(initial: float, value: float, opts: DoctorOptions) -> bool:
    if initial >= opts.overfit_floor and value < opts.overfit_floor:
        return True
    return initial - value >= (1 - opts.overfit_target) * abs(initial)


def _overfit_result(losses: list[float], opts: DoctorOptions) -> CheckResult:
    initial, final, steps = losses[0], losses[-1], len(losses) - 1
    data = {"losses": losses, "steps": steps, "lr": opts.lr}
    ratio = f" ({final / initial:.1%} of the initial)" if initial > 0 else ""
    evidence = f"loss {initial:.4g} -> {final:.4g}{ratio} after {steps} of {opts.steps} Adam steps (lr {opts.lr:g})"
    if _fitted(initial, final, opts):
        return CheckResult("overfit_batch", PASS, evidence, data=data)
    goal = f"goal: {opts.overfit_target:.0%} of the initial or < {opts.overfit_floor:g}"
    if final < initial:
        return CheckResult("overfit_batch", WARN, f"{evidence}; {goal}", HINTS["slow_fit"], data)
    return CheckResult("overfit_batch", FAIL, f"{evidence}: the loss did not fall", HINTS["no_fit"], data)
