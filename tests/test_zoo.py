"""The zoo's claims, checked with plain PyTorch (hooks, torch.isfinite) -- no gradwatch.

Healthy cases must learn and stay clear of every detector's threshold with a margin; each
pathological case must show its pathology at the layer and step its metadata names, and not
before.
"""

from __future__ import annotations

import ast
import math
import statistics
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from . import pool
from .zoo import CASES, HEALTHY, PATHOLOGIES, Case, run

BOUNDED = (nn.Sigmoid, nn.Tanh)  # saturating activations used in the zoo
HEALTHY_IDS = [c.name for c in HEALTHY]
#: cases whose monitored run takes several seconds (marked slow)
SLOW_CASES = {"exploding_lr_jump", "nonfinite_poisoned_batch"}
PATHOLOGY_IDS = [c.name for c in PATHOLOGIES]


def _finite(t: Any) -> bool:
    return all(bool(torch.isfinite(x).all()) for x in _tensors(t))


def _tensors(t: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a (nested) module input/output."""
    if isinstance(t, torch.Tensor):
        return [t] if t.is_floating_point() else []
    if isinstance(t, (tuple, list)):
        return [x for item in t for x in _tensors(item)]
    if isinstance(t, dict):
        return [x for item in t.values() for x in _tensors(item)]
    if hasattr(t, "to_tuple"):  # transformers ModelOutput
        return _tensors(t.to_tuple())
    return []


def _all_tensors(t: Any) -> list[torch.Tensor]:
    if isinstance(t, torch.Tensor):
        return [t]
    return [x for item in t for x in _all_tensors(item)] if isinstance(t, (tuple, list)) else []


def _norm(ts: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in ts)) if ts else 0.0


@dataclass
class Trace:
    """What a plain-torch monitor saw while a case trained (one entry per step)."""

    losses: list[float] = field(default_factory=list)
    loss_finite: list[bool] = field(default_factory=list)
    grads_finite: list[bool] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    layer_norm: list[dict[str, float]] = field(default_factory=list)  # layers with a gradient
    layer_rms: list[dict[str, float]] = field(default_factory=list)
    no_grad: list[set[str]] = field(default_factory=list)  # parameter names without .grad
    update_ratio: list[dict[str, float]] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    input_finite: list[bool] = field(default_factory=list)
    first_bad_forward: list[str | None] = field(default_factory=list)  # first module with a NaN/Inf output
    first_bad_forward_inputs_finite: list[bool | None] = field(default_factory=list)
    all_outputs_finite: list[bool] = field(default_factory=list)
    first_bad_backward: list[str | None] = field(default_factory=list)  # grad_in bad, grad_out finite
    zero_frac: list[dict[str, float]] = field(default_factory=list)  # sampled steps only
    sat_frac: list[dict[str, float]] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)


def monitor(case: Case, *, forward_checks: bool = True, backward_hooks: bool = False,
            sample_every: int = 10) -> tuple[Trace, nn.Module]:
    """Run ``case`` through ``zoo.run`` with plain-torch instrumentation: per-step loss, gradient
    norms (global and per layer = module owning parameters), update ratios, finiteness of every
    module's inputs and outputs (``forward_checks``) and input gradients (``backward_hooks``),
    and on every ``sample_every``-th step the zero / saturated fraction of every leaf's output."""
    model, opt, sched = case.build()
    tr = Trace()
    names = {m: n for n, m in model.named_modules()}
    owners = [(n, list(m.parameters(recurse=False))) for n, m in model.named_modules()
              if any(True for _ in m.parameters(recurse=False))]
    pnames = {id(p): n for n, p in model.named_parameters()}
    leaves = [(n, m) for n, m in model.named_modules() if next(iter(m.children()), None) is None]
    state = {"step": 0}
    fwd: list[tuple[str, bool, bool]] = []  # (module, inputs finite, output finite) in completion order
    bwd: list[tuple[str, bool, bool]] = []  # (module, grad_input finite, grad_output finite)

    def fwd_hook(mod: nn.Module, inp: Any, out: Any) -> None:
        if forward_checks:
            fwd.append((names[mod], _finite(inp), _finite(out)))
        if state["step"] % sample_every == 0 and mod in leaf_set:
            ts = _tensors(out)
            if not ts:
                return
            t = ts[0].detach()
            tr.zero_frac[-1][names[mod]] = float((t == 0).float().mean())
            if isinstance(mod, BOUNDED):
                lo, hi = (0.0, 1.0) if isinstance(mod, nn.Sigmoid) else (-1.0, 1.0)
                eps = 0.01 * (hi - lo)
                tr.sat_frac[-1][names[mod]] = float(((t < lo + eps) | (t > hi - eps)).float().mean())

    def bwd_hook(mod: nn.Module, gin: Any, gout: Any) -> None:
        bwd.append((names[mod], _finite(gin), _finite(gout)))

    leaf_set = {m for _, m in leaves}
    handles = [m.register_forward_hook(fwd_hook) for m in names]
    if backward_hooks:
        handles += [m.register_full_backward_hook(bwd_hook) for m in names]

    orig_batch = case.batch

    def batch(step: int) -> tuple[Any, Any]:
        x, y = orig_batch(step)
        tr.input_finite.append(_finite(x))
        fwd.clear()
        bwd.clear()
        if step % sample_every == 0:
            tr.sampled.append(step)
            tr.zero_frac.append({})
            tr.sat_frac.append({})
        return x, y

    def observe(loss: torch.Tensor) -> None:
        tr.loss_finite.append(bool(torch.isfinite(loss)))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        tr.grads_finite.append(all(bool(torch.isfinite(g).all()) for g in grads))
        tr.grad_norm.append(_norm(grads))
        norms, rms = {}, {}
        for name, ps in owners:
            gs = [p.grad for p in ps if p.grad is not None]
            if gs:
                norms[name] = _norm(gs)
                rms[name] = norms[name] / math.sqrt(sum(g.numel() for g in gs))
        tr.layer_norm.append(norms)
        tr.layer_rms.append(rms)
        tr.no_grad.append({pnames[id(p)] for p in model.parameters() if p.grad is None})
        bad_f = next(((n, i) for n, i, o in fwd if not o), None)
        tr.first_bad_forward.append(bad_f[0] if bad_f else None)
        tr.first_bad_forward_inputs_finite.append(bad_f[1] if bad_f else None)
        tr.all_outputs_finite.append(all(o for _, _, o in fwd))
        bad_b = next((n for n, gi, go in bwd if not gi and go), None)
        tr.first_bad_backward.append(bad_b)
        tr.lr.append(float(opt.param_groups[0]["lr"]))

    before: dict[str, list[torch.Tensor]] = {}

    def pre(*_: Any) -> None:
        before.clear()
        before.update({n: [p.detach().clone() for p in ps] for n, ps in owners})

    def post(*_: Any) -> None:
        ratios = {}
        for n, ps in owners:
            if not any(p.grad is not None for p in ps):
                continue
            den = _norm(before[n])
            num = _norm([p.detach() - b for p, b in zip(ps, before[n])])
            ratios[n] = num / den if den > 0 else math.inf
        tr.update_ratio.append(ratios)
        state["step"] += 1

    handles += [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
    traced = replace(case, batch=batch)
    try:
        with warnings.catch_warnings():  # full backward hooks on modules whose inputs need no grad
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            _, _, tr.losses = run(traced, observe=observe, model=model, optimizer=opt, scheduler=sched)
    finally:
        for h in handles:
            h.remove()
    return tr, model


def _median_before(xs: list[float], t: int, window: int) -> float:
    return statistics.median(xs[max(0, t - window):t])


def _jumps(xs: list[float], ratio: float, z: float = 5.0, warmup: int = 20) -> list[tuple[int, float]]:
    """Steps where a norm leaves its own history, judged like the ``exploding`` detector but
    stricter: log(x) above the median of the logs of the last 50 values by more than
    max(z * spread, log(ratio)), spread = 1.4826 * MAD (at least 0.1). As a baseline that is
    refreshed only now and then lags, the window ending 10 steps earlier is also applied.
    Returns (step, log excess over the bound) for each flagged step."""
    logs = [math.log(x) for x in xs]
    out = []
    for t in range(warmup, len(xs)):
        bounds = []
        for end in (t, t - 10):
            window = logs[max(0, end - 50):end]
            if len(window) < warmup // 2:
                continue
            center = statistics.median(window)
            spread = max(1.4826 * statistics.median(abs(v - center) for v in window), 0.1)
            bounds.append(center + max(z * spread, math.log(ratio)))
        if logs[t] > min(bounds):
            out.append((t, logs[t] - min(bounds)))
    return out


# ------------------------------------------------------------------------------ the interface


def test_zoo_does_not_import_gradwatch() -> None:
    tree = ast.parse((Path(__file__).parent / "zoo.py").read_text())
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in modules if m.split(".")[0] == "gradwatch"]


def test_names_are_unique_and_metadata_consistent() -> None:
    assert len(CASES) == len(HEALTHY) + len(PATHOLOGIES)
    for case in HEALTHY:
        assert case.kind is None and case.layer is None and case.onset is None and case.phase is None
    kinds = {c.kind for c in PATHOLOGIES}
    assert kinds == {"nonfinite", "exploding", "vanishing", "dead_units", "saturation",
                     "unused_parameter", "loss_spike", "update_ratio"}
    for case in PATHOLOGIES:
        assert case.onset is not None and 0 <= case.onset < case.steps
        assert (case.phase in ("forward", "backward")) == (case.kind == "nonfinite")
        if case.layer is not None:
            model, _, _ = case.build()
            assert case.layer in dict(model.named_modules()), case.name


@pytest.mark.parametrize("case", HEALTHY + PATHOLOGIES, ids=HEALTHY_IDS + PATHOLOGY_IDS)
def test_build_and_batch_are_deterministic(case: Case) -> None:
    m1, _, _ = case.build()
    torch.manual_seed(12345)  # the global RNG state must not matter
    m2, _, _ = case.build()
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    for step in (0, 1, case.onset or 2):
        (x1, y1), (x2, y2) = case.batch(step), case.batch(step)
        for a, b in zip(_all_tensors((x1, y1)), _all_tensors((x2, y2)), strict=True):
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert not torch.equal(_all_tensors(case.batch(0))[0], _all_tensors(case.batch(1))[0])


def test_run_is_reproducible_and_uses_given_objects() -> None:
    case = CASES["mlp_adam"]
    short = replace(case, steps=5)
    _, _, a = run(short)
    model, opt, sched = short.build()
    seen: list[float] = []
    m, o, b = run(short, model=model, optimizer=opt, scheduler=sched,
                  observe=lambda loss: seen.append(float(loss.detach())))
    assert m is model and o is opt and a == b == seen and len(a) == 5
    with pytest.raises(ValueError):
        run(short, model=model)


# ----------------------------------------------------------------------------- healthy cases


def healthy_trace(name: str) -> Trace:
    """What the plain-torch monitor saw of the healthy case ``name`` (named: a case's build function does
    not pickle), its forward checks off."""
    return monitor(CASES[name], forward_checks=False)[0]


@pytest.fixture(scope="module")
def healthy_traces(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[Any]]]:
    """The healthy cases this session tests, each given to the tests' pool as the module starts
    (``tests/pool.py``: two processes beside this one), its trace to come."""
    futures = {c.name: pool.submit(healthy_trace, c.name)
               for c in pool.chosen(request, "case", test="test_healthy_case_is_healthy")}
    yield futures
    for future in futures.values():
        future.cancel()  # a session stopped early (-x) trains no case it no longer tests


@pytest.mark.slow  # the healthy zoo, hundreds of steps per model
@pytest.mark.parametrize("case", HEALTHY, ids=HEALTHY_IDS)
def test_healthy_case_is_healthy(case: Case, healthy_traces: dict[str, Future[Any]]) -> None:
    tr = pool.result(healthy_traces[case.name])
    n = case.steps
    assert 150 <= n <= 300
    # finite throughout, and it learns
    assert all(tr.loss_finite) and all(tr.grads_finite)
    first, last = statistics.fmean(tr.losses[:20]), statistics.fmean(tr.losses[-20:])
    assert last < 0.9 * first, (first, last)
    # every parameter gets a gradient
    assert not any(tr.no_grad), tr.no_grad[0]
    # exploding: no norm 5 spreads (detector: 6) and 4x (5x) above its history, layers 8x (10x)
    g = tr.grad_norm
    assert max(g) < 1e3
    assert not _jumps(g, ratio=4)
    assert all(g[t] < 10 * _median_before(g, t, 20) for t in range(20, n))
    for name in tr.layer_norm[0]:
        assert not _jumps([d[name] for d in tr.layer_norm], ratio=8), name
    # loss spike: never 5 std and 0.75x the mean above the EMA (beta 0.98) after 20 losses
    mean, var = tr.losses[0], 0.0
    for t, loss in enumerate(tr.losses[1:], start=1):
        if t >= 20:
            assert loss - mean <= max(5 * math.sqrt(var), 0.75 * abs(mean)), (t, loss, mean, math.sqrt(var))
        diff = loss - mean
        mean += 0.02 * diff
        var = 0.98 * (var + 0.02 * diff**2)
    # vanishing: no layer's gradient RMS below 1e-3x the median layer's (detector: 1e-4x)
    for t, rms in enumerate(tr.layer_rms):
        med = statistics.median(v for v in rms.values() if v > 0)
        assert min(rms.values()) > 1e-3 * med, (t, min(rms, key=rms.__getitem__))
    # update ratio: well below 1 and, where the LR is non-zero, above 1e-7
    for t, ratios in enumerate(tr.update_ratio):
        assert max(ratios.values()) < 0.5, (t, max(ratios, key=ratios.__getitem__), max(ratios.values()))
        if tr.lr[t] > 0:
            assert min(ratios.values()) > 1e-7, (t, min(ratios, key=ratios.__getitem__))
    # dead units and saturation on sampled steps
    for t, zf, sf in zip(tr.sampled, tr.zero_frac, tr.sat_frac):
        assert max(zf.values()) < 0.95, (t, max(zf, key=zf.__getitem__), max(zf.values()))
        if sf:
            assert max(sf.values()) < 0.8, (t, max(sf, key=sf.__getitem__), max(sf.values()))


# ------------------------------------------------------------------------- pathological cases


def _onset(case: Case) -> int:
    assert case.onset is not None
    return case.onset


def _layer(case: Case) -> str:
    assert case.layer is not None
    return case.layer


def _first(flags: list[bool]) -> int | None:
    return next((i for i, f in enumerate(flags) if f), None)


NONFINITE = [c for c in PATHOLOGIES if c.kind == "nonfinite"]


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.name in SLOW_CASES else c
                                  for c in NONFINITE], ids=[c.name for c in NONFINITE])
def test_nonfinite_case_is_born_where_it_says(case: Case) -> None:
    tr, _ = monitor(case, backward_hooks=case.phase == "backward")
    bad = [not (lf and gf) for lf, gf in zip(tr.loss_finite, tr.grads_finite)]
    k = _onset(case)
    assert _first(bad) == k
    assert all(tr.all_outputs_finite[:k]) and all(tr.input_finite[:k])
    assert not tr.grads_finite[k]
    if case.layer is None:  # the batch itself
        assert not tr.input_finite[k]
        assert not tr.loss_finite[k]
        return
    assert all(tr.input_finite), "only the model may make the NaN"
    if case.phase == "forward":
        assert not tr.loss_finite[k]
        assert tr.first_bad_forward[k] == case.layer
        assert tr.first_bad_forward_inputs_finite[k] is True
    else:
        assert tr.loss_finite[k] and tr.all_outputs_finite[k], "the forward pass stays finite"
        assert tr.first_bad_backward[k] == case.layer
        assert all(b is None for b in tr.first_bad_backward[:k])


EXPLODING = [c for c in PATHOLOGIES if c.kind == "exploding"]


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.name in SLOW_CASES else c
                                  for c in EXPLODING], ids=[c.name for c in EXPLODING])
def test_exploding_case_explodes_at_onset(case: Case) -> None:
    tr, _ = monitor(case)
    g, k = tr.grad_norm, _onset(case)
    assert k >= 30
    assert all(tr.loss_finite) and all(tr.grads_finite)  # exploded, but never NaN/Inf
    for t in range(20, k):  # a quiet history
        assert g[t] < 5 * _median_before(g, t, 30), (t, g[t])
    typical = _median_before(g, k, 30)
    assert g[k] >= 20 * typical, (g[k], typical)
    for t in range(k, min(k + 3, case.steps)):  # and it stays exploded
        assert g[t] >= 20 * typical, (t, g[t], typical)
    if case.name == "exploding_large_init":
        assert g[k] > 1e6  # also beyond any absolute bound


def test_vanishing_case() -> None:
    (case,) = [c for c in PATHOLOGIES if c.kind == "vanishing"]
    tr, _ = monitor(case)
    assert all(tr.loss_finite) and all(tr.grads_finite)
    for rms in tr.layer_rms:
        med = statistics.median(rms.values())
        assert rms[_layer(case)] < 1e-5 * med, (rms[_layer(case)], med)


def test_dead_units_case() -> None:
    (case,) = [c for c in PATHOLOGIES if c.kind == "dead_units"]
    tr, _ = monitor(case, sample_every=1)
    assert all(tr.loss_finite) and all(tr.grads_finite)
    assert len(tr.zero_frac) == case.steps
    assert all(zf[_layer(case)] == 1.0 for zf in tr.zero_frac)


def test_saturation_case() -> None:
    (case,) = [c for c in PATHOLOGIES if c.kind == "saturation"]
    tr, _ = monitor(case, sample_every=1)
    assert all(tr.loss_finite) and all(tr.grads_finite)
    assert len(tr.sat_frac) == case.steps
    assert all(sf[_layer(case)] > 0.95 for sf in tr.sat_frac), [sf[_layer(case)] for sf in tr.sat_frac]
    assert all(zf[_layer(case)] < 0.9 for zf in tr.zero_frac)  # saturated, not "dead"


UNUSED = [c for c in PATHOLOGIES if c.kind == "unused_parameter"]


@pytest.mark.parametrize("case", UNUSED, ids=[c.name for c in UNUSED])
def test_unused_parameter_case(case: Case) -> None:
    tr, model = monitor(case)
    owned = {f"{_layer(case)}.{n}" for n, _ in model.get_submodule(_layer(case)).named_parameters()}
    assert owned
    assert all(no_grad == owned for no_grad in tr.no_grad)
    assert all(tr.loss_finite) and all(tr.grads_finite)


@pytest.mark.slow  # hundreds of steps
def test_loss_spike_case() -> None:
    (case,) = [c for c in PATHOLOGIES if c.kind == "loss_spike"]
    tr, _ = monitor(case)
    L, k = tr.losses, _onset(case)
    assert all(tr.loss_finite) and all(tr.grads_finite)
    for t in range(20, k):
        assert L[t] < 2 * statistics.fmean(L[t - 20:t]), t
    assert L[k] > 50 * statistics.fmean(L[k - 20:k])
    assert statistics.fmean(L[-10:]) < 2 * statistics.fmean(L[k - 10:k])  # it recovers


def test_update_ratio_case() -> None:
    (case,) = [c for c in PATHOLOGIES if c.kind == "update_ratio"]
    tr, _ = monitor(case)
    assert case.steps >= 30
    assert all(tr.loss_finite) and all(tr.grads_finite)
    ratios = [r[_layer(case)] for r in tr.update_ratio]
    assert min(ratios) > 1.0, ratios
