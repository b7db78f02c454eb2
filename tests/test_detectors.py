"""Detectors on planted pathologies (kind, layer, step exact) and silence on healthy training."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.detectors.nonfinite import NonFinite
from gradwatch.store.records import LAYER, PARAM, Layout, StepRecord


def linears(*names: str) -> Layout:
    """The layout (version 1) of a model of Linear layers of 4 weights each, one parameter per layer."""
    n = len(names)
    return Layout(version=1, layers=names, layer_types=("Linear",) * n, layer_numel=(4,) * n,
                  params=tuple(f"{x}.weight" for x in names), param_numel=(4,) * n,
                  owners=tuple((i, i) for i in range(n)), leaves=tuple(range(n)), trainable=(True,) * n)

def fit(model: nn.Module, run_dir: Path, steps: int, *, lr: float = 0.05, opt: str = "sgd",
        batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None, **kw: object) -> gw.Run:
    gw.watch(model, run=run_dir, console=False, **kw)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr) if opt == "sgd" else torch.optim.Adam(params, lr=lr)
    teacher = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        if batch is not None:
            x, y = batch(step)
        else:
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(32, 8, generator=gen)
            y = torch.tanh(x @ teacher)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        optimizer.step()
    gw.unwatch(model)
    return gw.open_run(run_dir)


def first(run: gw.Run, kind: str) -> tuple[int, str | None]:
    found = run.findings()
    rows = found[found.kind == kind]
    assert len(rows), f"no {kind} finding; found: {list(zip(found.kind, found.step, found.layer))}"
    layer = rows.iloc[0].layer
    return int(rows.iloc[0].step), layer if isinstance(layer, str) else None


def test_vanishing_in_a_deep_sigmoid_stack(run_dir: Path) -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 32), nn.Sigmoid()]
    for _ in range(14):
        layers += [nn.Linear(32, 32), nn.Sigmoid()]
    model = nn.Sequential(*layers, nn.Linear(32, 1))
    run = fit(model, run_dir, 15)
    assert first(run, "vanishing") == (9, "0"), "the first layer, after patience=10 steps from step 0"


@pytest.mark.parametrize("between", [[], [nn.Dropout(0.1)], [nn.Identity()]])
def test_dead_relu_from_a_huge_negative_bias(run_dir: Path, between: list[nn.Module]) -> None:
    """A Dropout after the dead nn.ReLU carries its zeros: still one finding, the ReLU's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), *between, nn.Linear(32, 1))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    run = fit(model, run_dir, 25)
    assert first(run, "dead_units") == (10, "1"), "sampled steps 0 and 10"
    found = run.findings()
    assert list(found.kind) == ["dead_units"], "one root cause, one finding (issue 15): '0' gets no gradient " \
        "because of the dead ReLU, which is not a vanishing gradient of its own"
    assert found.data.iloc[0]["no_gradient"] == ["0"] and "no gradient reaches '0'" in found.message.iloc[0]


def test_saturated_sigmoid(run_dir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Sigmoid(), nn.Linear(32, 1))
    with torch.no_grad():
        model[0].weight.mul_(200.0)
    run = fit(model, run_dir, 15)
    assert first(run, "saturation") == (10, "1")


def test_unused_submodule_and_accidental_detach(run_dir: Path) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
            self.head = nn.Linear(16, 1)
            self.unused = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x).detach())

    run = fit(Model(), run_dir, 5)
    found = run.findings()
    unused = found[found.kind == "unused_parameter"]
    assert set(zip(unused.step, unused.layer)) == {(2, "encoder.0"), (2, "unused")}
    assert set(unused.data.iloc[0]["parameters"]) | set(unused.data.iloc[1]["parameters"]) == {
        "encoder.0.weight", "encoder.0.bias", "unused.weight", "unused.bias"}


def test_frozen_parameters_are_not_unused(run_dir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model[0].requires_grad_(False)
    run = fit(model, run_dir, 5)
    assert "unused_parameter" not in set(run.findings().kind)


@pytest.mark.slow  # a long baseline before the spike
def test_loss_spike_and_exploding_on_a_corrupted_batch(run_dir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    teacher = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        y = torch.tanh(x @ teacher)
        return x, y * (100.0 if step == 70 else 1.0)

    run = fit(model, run_dir, 80, batch=batch, rules=None)
    assert first(run, "loss_spike") == (70, None)
    step, layer = first(run, "exploding")
    assert step == 70 and layer is not None


@pytest.mark.slow  # many sampled steps
def test_update_ratio_too_large(run_dir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    run = fit(model, run_dir, 25, lr=20.0, rules=None, sample_every=1)
    step, layer = first(run, "update_ratio")
    assert step == 1 and layer in {"0", "2"}


@pytest.mark.slow  # a long run of GradScaler overflows
def test_amp_overflow_is_info_and_repeats_are_counted(run_dir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    gw.watch(model, run=run_dir, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for step in range(12):
        x = torch.randn(16, 8)
        opt.zero_grad()
        loss = model(x).pow(2).mean() * (1e35 if step in (3, 4, 5) else 1.0)  # scaled, these overflow
        scaler.scale(loss).backward()
        scaler.step(opt)  # skips the optimizer on an overflow, and the scale backs off
        scaler.update()
    gw.unwatch(model)
    found = gw.open_run(run_dir).findings()
    amp = found[found.kind == "amp_overflow"]
    assert list(zip(amp.step, amp.severity)) == [(3, "info")]
    assert amp.data.iloc[0]["repeats"] == 3 and amp.data.iloc[0]["last_step"] == 5


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.slow  # hundreds of healthy steps
def test_healthy_training_has_no_warnings(run_dir: Path, opt: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    run = fit(model, run_dir, 200, lr=0.05 if opt == "sgd" else 1e-3, opt=opt)
    found = run.findings()
    assert found.empty, list(zip(found.kind, found.step, found.layer, found.message))
    assert run.verdict["worst"] is None


@pytest.mark.slow  # a long run before the finding
def test_flight_recorder_keeps_the_lead_up_at_full_resolution(run_dir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        if step == 57:
            x[0, 0] = float("nan")
        return x, x[:, :1]

    run = fit(model, run_dir, 60, batch=batch, log_every=20, flight_recorder=8)
    logged = set(run.metrics("grad_norm", include_global=False).step)
    assert logged == {0, 20, 40, *range(49, 58)}, sorted(logged)
    assert first(run, "nonfinite") == (57, None)


@pytest.mark.parametrize("passes_preclip", [False, True])
@pytest.mark.slow  # an explosion after a long baseline
def test_a_loop_that_clips_itself_passes_the_preclip_norm_for_exploding(run_dir: Path, passes_preclip: bool) -> None:
    """After clip_grad_norm_ gradwatch sees clipped gradients, yet the exploding detector judges the
    norm before the clip: measured by gradwatch (issue 15), or observed by the loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    gw.watch(model, run=run_dir, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(80):
        scale = 1000.0 if step == 60 else 1.0
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x * scale), y * scale)
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        gw.watcher(model).observe(loss=loss, **({"grad_norm_preclip": total} if passes_preclip else {}))
        opt.step()
    gw.unwatch(model)
    with gw.open_run(run_dir) as run:
        found = run.findings()
        kinds = [(r.step, r.kind) for r in found.itertuples()]
    assert (60, "exploding") in kinds
    explosion = found[(found.step == 60) & (found.kind == "exploding")].iloc[0]
    assert "before clipping" in explosion["message"]
    assert explosion["data"]["hint"].startswith("the loop already clips")  # not "add a clip rule"
    assert (60, "loss_spike") in kinds


def test_a_layer_that_grows_to_a_small_share_of_the_gradient_is_no_explosion() -> None:
    """A layer whose gradient was tiny (a transformer's attention keys before it starts to learn) grows
    100x to a small share of the model's gradient: not an explosion; the same jump carrying most of
    the gradient is one."""
    import numpy as np

    from gradwatch.detectors.exploding import Exploding
    from gradwatch.store.records import LAYER, StepRecord

    layout = linears("a", "b")

    def record(step: int, a: float, b: float) -> StepRecord:
        return StepRecord(step=step, time=0.0, layout=layout, scalars={"grad_norm": float(np.hypot(a, b))},
                          vectors={(LAYER, "grad_norm"): np.array([a, b], dtype=np.float32)})

    for b, found in ((0.3, []), (3.0, ["b"])):  # 0.3 of 1.04 (8% of the squares); 3.0 of 3.2 (90%)
        detector = Exploding()
        for step in range(30):
            assert not detector.check(record(step, 1.0 + 0.01 * (step % 3), 0.003 * (1 + 0.02 * (step % 4))))
        assert [f.layer for f in detector.check(record(30, 1.0, b))] == found


def test_a_layers_explosion_carries_that_layers_norm_and_typical_value() -> None:
    """A layer's gradient norm jumps 100x while the global norm stays as it was: the finding's data
    holds the layer's norm and its typical value (with the global norm beside them)."""
    import numpy as np

    from gradwatch.detectors.exploding import Exploding
    from gradwatch.store.records import LAYER, StepRecord

    layout = linears("a", "b")
    detector = Exploding()

    def record(step: int, b: float) -> StepRecord:
        return StepRecord(step=step, time=0.0, layout=layout, scalars={"grad_norm": 1.0 + 0.01 * (step % 3)},
                          vectors={(LAYER, "grad_norm"): np.array([1.0 + 0.01 * (step % 2), b], dtype=np.float32)})

    assert not [f for step in range(30) for f in detector.check(record(step, 0.01 * (1 + 0.02 * (step % 4))))]
    (found,) = detector.check(record(30, 2.0))
    assert (found.kind, found.layer, found.step) == ("exploding", "b", 30)
    assert found.data["grad_norm"] == pytest.approx(2.0)
    assert found.data["typical"] == pytest.approx(0.0102, rel=0.02)
    assert found.data["global_grad_norm"] == pytest.approx(1.0)


def test_a_long_cut_in_the_graph_lists_the_layers_nearest_it_and_the_first() -> None:
    """22 layers behind a cut get exactly zero: one finding at the last of them, whose data counts them
    all and lists the nearest 19 and the first (the input end)."""
    import numpy as np

    from gradwatch.detectors.vanishing import Vanishing
    from gradwatch.store.records import LAYER, PARAM, StepRecord

    n = 25
    names = tuple(f"l{i}" for i in range(n))
    layout = linears(*names)
    norms = np.array([0.0] * 22 + [1.0, 1.2, 0.9], dtype=np.float32)
    detector = Vanishing()
    found = []
    for step in range(12):
        found += detector.check(StepRecord(step=step, time=0.0, layout=layout, scalars={"grad_norm": 1.8}, vectors={
            (LAYER, "grad_norm"): norms, (LAYER, "grad_nonfinite"): np.zeros(n, dtype=np.float32),
            (PARAM, "grad_nonfinite"): np.zeros(n, dtype=np.float32)}))
    (finding,) = found
    assert (finding.layer, finding.data["count"]) == ("l21", 22)
    assert finding.data["layers"] == [f"l{i}" for i in range(21, 2, -1)] + ["l0"]
    assert "(and 21 layers before it)" in finding.message


def test_baselines_carry_over_a_new_layout_of_the_same_layers() -> None:
    """Parameters frozen or unfrozen give the run a new layout version with the same layers: the layer
    baselines of ``exploding`` and the counts of ``vanishing`` go on (a loop that toggles requires_grad
    would otherwise restart them at every look); new layers start afresh."""
    import dataclasses

    import numpy as np

    from gradwatch.detectors.exploding import Exploding
    from gradwatch.detectors.vanishing import Vanishing
    from gradwatch.store.records import LAYER, StepRecord

    v1 = linears("a", "b", "c")
    v2 = dataclasses.replace(v1, version=2, trainable=(True, False, True))
    v3 = dataclasses.replace(v1, version=3, layers=("a", "b", "d"))

    def record(step: int, layout: Layout, norms: list[float]) -> StepRecord:
        return StepRecord(step=step, time=0.0, layout=layout, scalars={"grad_norm": float(np.linalg.norm(norms))},
                          vectors={(LAYER, "grad_norm"): np.asarray(norms, dtype=np.float32),
                                   (LAYER, "grad_nonfinite"): np.zeros(3, dtype=np.float32)})

    def wobble(step: int) -> float:
        return 0.1 * (1.0 + 0.02 * (step % 3))

    exploding = Exploding()
    for step in range(30):
        assert not exploding.check(record(step, v1, [wobble(step), wobble(step + 1), 0.1 * wobble(step)]))
    for step in range(30, 33):
        assert not exploding.check(record(step, v2, [wobble(step), wobble(step + 1), 0.1 * wobble(step)]))
    (found,) = exploding.check(record(33, v2, [wobble(33), wobble(34), 0.3]))  # 30x: below early_ratio's 100x
    assert (found.kind, found.layer) == ("exploding", "c")
    assert not exploding.check(record(34, v3, [0.1, 0.1, 0.3]))  # a new layer "d": its baseline starts afresh

    vanishing = Vanishing()
    for step in range(6):
        assert not vanishing.check(record(step, v1, [1.0, 1.0, 1e-12]))
    found = [f for step in range(6, 10) for f in vanishing.check(record(step, v2, [1.0, 1.0, 1e-12]))]
    assert [(f.kind, f.layer, f.step) for f in found] == [("vanishing", "c", 9)]  # 10 steps in a row, 2 layouts


def test_after_a_learning_rate_named_too_high_an_update_of_zero_is_not_called_a_learning_rate_of_zero() -> None:
    """Weights that a too-high learning rate blew up round their updates to exactly 0: neither
    ``unoptimized_parameter`` (zero update: "its learning rate is 0") nor ``update_ratio`` (too small:
    "raise the learning rate") may then give the opposite remedy."""
    import numpy as np

    from gradwatch.detectors.causes import LR_HIGH
    from gradwatch.detectors.unoptimized_parameter import UnoptimizedParameter
    from gradwatch.detectors.update_ratio import UpdateRatio
    from gradwatch.store.records import LAYER, PARAM, StepRecord

    layout = linears("a", "b")
    ratio = np.array([0.0, 1e-2], dtype=np.float32)  # "a" does not move at all, "b" does
    tiny = np.array([1e-12, 1e-2], dtype=np.float32)  # "a" moves, far too little
    norms = np.array([1.0, 1.0], dtype=np.float32)

    def record(step: int, r: np.ndarray) -> StepRecord:
        vectors = {(scope, metric): v for scope in (LAYER, PARAM)
                   for metric, v in (("update_ratio", r), ("grad_norm", norms), ("param_norm", norms),
                                     ("grad_nonfinite", np.zeros(2, dtype=np.float32)))}
        return StepRecord(step=step, time=0.0, layout=layout, scalars={"grad_norm": 1.4, "lr": 0.1}, vectors=vectors,
                          sampled=True)

    for blown_up, expected in ((False, [("unoptimized_parameter", "a"), ("update_ratio", "a")]), (True, [])):
        unoptimized, updates = UnoptimizedParameter(), UpdateRatio()
        if blown_up:
            unoptimized.causes.note(LR_HIGH, 0)
            updates.causes.note(LR_HIGH, 0)
        found = unoptimized.check(record(10, ratio))
        found += [f for step in (10, 20, 30) for f in updates.check(record(step, tiny))]
        assert [(f.kind, f.layer) for f in found] == expected


def test_an_activation_norm_that_overflows_is_not_called_nan() -> None:
    """A NaN norm has a NaN element; an Inf one may come from finite values beyond ~1e19 (float32 squares)."""
    layout = linears("a", "b", "c")
    vectors = {(LAYER, "act_norm"): np.array([np.nan, np.inf, np.inf], dtype=np.float32),
               (LAYER, "act_zero_frac"): np.zeros(3, dtype=np.float32),  # every leaf ran
               (LAYER, "grad_norm"): np.ones(3, dtype=np.float32),
               (LAYER, "grad_nonfinite"): np.zeros(3, dtype=np.float32),
               (PARAM, "grad_nonfinite"): np.zeros(3, dtype=np.float32)}
    (found,) = NonFinite().check(StepRecord(step=4, time=0.0, layout=layout, scalars={"grad_norm": 1.7},
                                            vectors=vectors, sampled=True))
    assert "1 layer's activations are NaN, 2 layers' activation norms overflow (Inf elements, or finite ones " \
           "beyond ~1e19)" in found.message
    assert found.layer == "a"  # the first layer whose activations went non-finite


def test_a_heavy_tailed_gradient_is_judged_against_its_own_bursts() -> None:
    """An LSTM's gradient: mostly ~0.1, with a hard sample now and then at 4-6x. A 15x step is within 3x of
    those bursts (no explosion); a 40x one is not. A smooth gradient's 15x step is an explosion."""
    from gradwatch.detectors.exploding import Exploding

    layout = linears("a")

    def record(step: int, norm: float) -> StepRecord:
        return StepRecord(step=step, time=0.0, layout=layout, scalars={"grad_norm": norm},
                          vectors={(LAYER, "grad_norm"): np.array([norm], dtype=np.float32)})

    bursty = [0.1 * (1 + 0.05 * (s % 5)) * (5.5 if s % 9 == 4 else 1.0) for s in range(40)]
    smooth = [0.1 * (1 + 0.05 * (s % 5)) for s in range(40)]
    for history, spike, flagged in ((bursty, 1.5, False), (bursty, 4.0, True), (smooth, 1.5, True)):
        detector = Exploding()
        assert not [f for s, n in enumerate(history) for f in detector.check(record(s, n))]
        assert bool(detector.check(record(40, spike))) == flagged, (spike, flagged)


def test_an_explosion_the_loops_clip_bounded_is_told_once_and_warned_of_when_it_recurs() -> None:
    from gradwatch.detectors.exploding import Exploding
    from gradwatch.store.records import PRECLIP

    layout = linears("a")

    def record(step: int, pre: float) -> StepRecord:
        post = min(pre, 1.0)  # clip_grad_norm_(max_norm=1.0)
        return StepRecord(step=step, time=0.0, layout=layout, scalars={"grad_norm": post, PRECLIP: pre},
                          vectors={(LAYER, "grad_norm"): np.array([post], dtype=np.float32)})

    detector = Exploding()
    found = [f for s in range(120) for f in detector.check(record(s, 30.0 if s in (40, 70, 95, 110) else
                                                                   0.1 * (1 + 0.05 * (s % 5))))]
    assert [(f.step, f.severity) for f in found] == [(40, "info"), (70, "info"), (95, "warning"), (110, "warning")]
    assert "The loop's clip bounded its update (the global norm clipped to 1)." in found[0].message
    assert "The loop clipped 3 explosions in the last 100 steps" in found[2].message
