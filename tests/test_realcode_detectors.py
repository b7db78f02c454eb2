"""The issue 15 detector logic on hand-made records (fast, exact), and on real-code runs re-judged offline."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch import detectors
from gradwatch.cli.rejudge import rejudge
from gradwatch.detectors.causes import EXPLOSION, LR_HIGH
from gradwatch.detectors.learning_rate import LearningRate
from gradwatch.detectors.loss_spike import LossSpike
from gradwatch.detectors.unoptimized_parameter import HELD, UnoptimizedParameter
from gradwatch.detectors.unused_parameter import group
from gradwatch.detectors.vanishing import Vanishing
from gradwatch.detectors.zero_gradient import ZeroGradient
from gradwatch.store.records import CLOSURE_EVALUATIONS, LAYER, PARAM, Layout, StepRecord

from .realcode import PAST_THE_HALT, gpt, reinforce, resnet


def layout(layers: dict[str, int]) -> Layout:
    """One parameter per layer, ``{layer: numel}``, every one trainable."""
    names = tuple(layers)
    return Layout(version=1, layers=names, layer_types=("Linear",) * len(names),
                  layer_numel=tuple(layers.values()), params=tuple(f"{n}.weight" for n in names),
                  param_numel=tuple(layers.values()), owners=tuple((i, i) for i in range(len(names))),
                  leaves=tuple(range(len(names))), trainable=(True,) * len(names))


def record(lay: Layout, step: int = 0, scalars: dict[str, float] | None = None, **vectors: Any) -> StepRecord:
    """``vectors`` by metric name, the same values for the layer and the parameter scope."""
    out = {}
    for metric, values in vectors.items():
        v = np.asarray(values, dtype=np.float32)
        out[(LAYER, metric)] = out[(PARAM, metric)] = v
    return StepRecord(step=step, time=0.0, layout=lay, scalars=scalars or {}, vectors=out, sampled=True)


# ----------------------------------------------------------------------- learning_rate
def test_a_small_output_layer_rescaling_itself_is_not_a_learning_rate_too_high() -> None:
    """Half the parameters move by 3%: the head's 0.63 is not the model's learning rate (SGD regression)."""
    lay = layout({"hidden": 288, "head": 33})
    found = LearningRate().check(record(lay, update_ratio=[0.031, 0.63], param_norm=[3.2, 0.58],
                                        grad_norm=[1.0, 5.0], grad_nonfinite=[0, 0]))
    assert found == []


def test_most_weights_rewritten_is_a_learning_rate_too_high_naming_the_largest() -> None:
    lay = layout({"attn": 6912, "proj": 2304, "ln": 96})
    found = LearningRate().check(record(lay, update_ratio=[0.46, 0.93, 0.009], param_norm=[1.0, 0.5, 9.8],
                                        grad_norm=[1.0, 1.0, 1.0], grad_nonfinite=[0, 0, 0], scalars={"lr": 0.009}))
    assert [(f.kind, f.layer, f.value) for f in found] == [("learning_rate", "proj", pytest.approx(0.93))]
    assert found[0].message.startswith("learning rate too high for proj (Linear): update is 0.93x the weights at "
                                       "step 0 (half the weights move by 0.46x or more")


def test_a_large_update_on_a_step_whose_gradient_exploded_is_the_explosions() -> None:
    lay = layout({"attn": 6912, "proj": 2304})
    detector = LearningRate()
    detector.causes.note(EXPLOSION, 0)
    assert detector.check(record(lay, update_ratio=[0.46, 0.93], param_norm=[1.0, 0.5], grad_norm=[1.0, 1.0],
                                 grad_nonfinite=[0, 0])) == []


def test_a_large_update_sized_by_a_line_search_is_not_a_learning_rate_too_high() -> None:
    """L-BFGS: the step's closure ran several times and the line search chose the step's size."""
    lay = layout({"attn": 6912, "proj": 2304})
    vectors = {"update_ratio": [0.46, 0.93], "param_norm": [1.0, 0.5], "grad_norm": [1.0, 1.0],
               "grad_nonfinite": [0, 0]}
    assert LearningRate().check(record(lay, scalars={CLOSURE_EVALUATIONS: 4.0}, **vectors)) == []
    assert len(LearningRate().check(record(lay, scalars={CLOSURE_EVALUATIONS: 1.0}, **vectors))) == 1


def test_a_single_large_update_after_healthy_ones_at_the_same_lr_is_not_the_learning_rate() -> None:
    """A corrupted batch: one huge gradient, one huge update; the learning rate did not change."""
    lay = layout({"a": 1000, "b": 100})
    detector = LearningRate()
    common = {"param_norm": [1.0, 1.0], "grad_norm": [1.0, 1.0], "grad_nonfinite": [0, 0]}
    assert detector.check(record(lay, 0, scalars={"lr": 0.01}, update_ratio=[0.01, 0.01], **common)) == []
    assert detector.check(record(lay, 10, scalars={"lr": 0.01}, update_ratio=[0.6, 0.9], **common)) == []
    (found,) = detector.check(record(lay, 20, scalars={"lr": 0.01}, update_ratio=[0.6, 0.9], **common))
    assert found.step == 20, "a large update that lasts is the learning rate's"
    raised = LearningRate()
    raised.check(record(lay, 0, scalars={"lr": 0.01}, update_ratio=[0.01, 0.01], **common))
    (found,) = raised.check(record(lay, 10, scalars={"lr": 10.0}, update_ratio=[0.6, 0.9], **common))
    assert found.data["lr"] == 10.0, "a learning rate raised 1000x is named at once"


def test_a_learning_rate_raised_tenfold_is_too_high_at_a_lower_bar_when_the_updates_grew_with_it() -> None:
    """A 100x learning rate between two sampled steps: half the weights move by 14% (below ``high_median``),
    47x the previous step's. A warmup's tenfold raise from near 0 moves them by a few % and is not named."""
    lay = layout({"a": 1000, "b": 100})
    common = {"param_norm": [1.0, 1.0], "grad_norm": [1.0, 1.0], "grad_nonfinite": [0, 0]}
    detector = LearningRate()
    assert detector.check(record(lay, 140, scalars={"lr": 1.5e-3}, update_ratio=[0.004, 0.01], **common)) == []
    assert detector.check(record(lay, 150, scalars={"lr": 1.3e-3}, update_ratio=[0.003, 0.01], **common)) == []
    (found,) = detector.check(record(lay, 160, scalars={"lr": 0.118}, update_ratio=[0.142, 0.169], **common))
    assert (found.kind, found.step, found.data["median"]) == ("learning_rate", 160, pytest.approx(0.142))
    assert "after it was raised 90.8x (0.0013 -> 0.118) since the previous sampled step" in found.message
    warmup = LearningRate()
    assert warmup.check(record(lay, 0, scalars={"lr": 1e-4}, update_ratio=[0.005, 0.005], **common)) == []
    assert warmup.check(record(lay, 10, scalars={"lr": 1.1e-3}, update_ratio=[0.055, 0.06], **common)) == []
    same = LearningRate()  # the same updates without a raise: a lasting lr is judged by the usual bar
    assert same.check(record(lay, 0, scalars={"lr": 0.1}, update_ratio=[0.003, 0.01], **common)) == []
    assert same.check(record(lay, 10, scalars={"lr": 0.1}, update_ratio=[0.142, 0.169], **common)) == []


@pytest.mark.parametrize(("schedule", "raised"), [
    ([0.0, 1e-4, 2e-4, 3e-4, 4e-4, 5e-4], None),  # a linear warmup from 0
    ([1e-4, 2e-4, 3e-4, 4e-4, 5e-4, 6e-4], None),  # one from base / warmup: at most 2x a step
    ([1e-3, 9e-4, 8e-4, 1e-1, 1e-1, 1e-1], (3, 8e-4, 1e-1)),  # multiplied by hand at step 3
])
def test_a_raised_learning_rate_is_a_tenfold_jump_from_one_step_to_the_next(
        schedule: list[float], raised: tuple[int, float, float] | None) -> None:
    lay = layout({"a": 10})
    spike = LossSpike()
    for step, lr in enumerate(schedule):
        spike.check(record(lay, step, scalars={"lr": lr}))
    assert spike.causes.raised(len(schedule) - 1) == raised
    assert spike.causes.raised(len(schedule) - 1 + 20) is None  # more than 10 steps later: not blamed


def test_a_loss_spike_right_after_a_raised_learning_rate_names_it() -> None:
    lay = layout({"a": 10})
    spike = LossSpike()
    losses = [1.0 - 0.01 * k for k in range(15)] + [6.0]
    found = [f for step, loss in enumerate(losses)
             for f in spike.check(record(lay, step, scalars={"loss": loss, "lr": 1e-3 if step < 14 else 0.1}))]
    (finding,) = found
    assert (finding.step, finding.data["cause"], finding.data["lr_raised_at"]) == (15, "learning_rate", 14)
    assert finding.message.endswith("The learning rate was raised 100x at step 14 (0.001 -> 0.1): the likely cause.")
    assert spike.causes.named(LR_HIGH, 15)
    named = LossSpike()  # the learning rate named too high earlier (at 0.001): the raise is still told
    named.causes.note(LR_HIGH, 0)
    found = [f for step, loss in enumerate(losses)
             for f in named.check(record(lay, step, scalars={"loss": loss, "lr": 1e-3 if step < 14 else 0.1}))]
    assert found[0].data["lr_raised_at"] == 14 and "raised 100x at step 14" in found[0].message


def test_weights_growing_geometrically_name_the_learning_rate() -> None:
    lay = layout({"a": 100, "b": 100})
    detector = LearningRate()
    common = {"update_ratio": [0.05, 0.05], "grad_norm": [1.0, 1.0], "grad_nonfinite": [0, 0]}
    assert detector.check(record(lay, 0, param_norm=[1.0, 1.0], **common)) == []
    (found,) = detector.check(record(lay, 10, param_norm=[1.2, 3.0], **common))
    assert (found.kind, found.layer, found.data["evidence"]) == ("learning_rate", "b", "weight_growth")
    assert "its weights grew 3x in 10 steps up to step 10 (the whole model's 2.28x" in found.message


def test_loss_divergence_after_the_learning_rate_was_named_is_not_a_second_finding() -> None:
    """Detectors built together share the causes they named: one cause, one finding."""
    built = {d.kind: d for d in detectors.build()}
    assert built["loss_spike"].causes is built["learning_rate"].causes
    built["learning_rate"].causes.note(LR_HIGH, 0)
    lay = layout({"a": 10})
    found = [f for step, loss in enumerate([4.1, 4.1, 4.2, 8.0, 9.0, 9.5])
             for f in built["loss_spike"].check(record(lay, step, scalars={"loss": loss}))]
    assert found == []
    alone = LossSpike()  # built on its own: a private record of causes
    found = [f for step, loss in enumerate([4.1, 4.1, 4.2, 8.0, 9.0, 9.5])
             for f in alone.check(record(lay, step, scalars={"loss": loss}))]
    assert [(f.step, f.data["divergence"]) for f in found] == [(5, True)]  # a level above 6.2 on steps 4 and 5


def test_a_loss_that_creeps_up_is_not_a_divergence_and_one_that_runs_away_is() -> None:
    """A GAN generator's loss rises from ln 2 to 1.1 over 200 steps as its discriminator learns: not a
    divergence; the same start running away (x2 within 10 steps) is one."""
    lay = layout({"a": 10})
    creeping = [0.69 + 0.002 * k for k in range(200)]
    running = [0.69 + 0.001 * (k % 3) for k in range(60)] + [0.7 * 1.08 ** k for k in range(1, 20)]
    for losses, diverged in ((creeping, False), (running, True)):
        spike = LossSpike()
        found = [f for step, loss in enumerate(losses) for f in spike.check(record(lay, step, scalars={"loss": loss}))]
        assert any(f.data.get("divergence") for f in found) == diverged, [(f.step, f.message) for f in found]


def test_a_loss_that_can_be_negative_never_diverges() -> None:
    """A policy-gradient loss: no scale to diverge from."""
    lay = layout({"a": 10})
    detector = LossSpike()
    losses = [-0.16, 0.01, -0.44, 0.44, 0.08, 0.46, 2.1, 0.9, 0.92]
    assert [f for step, loss in enumerate(losses) for f in detector.check(record(lay, step, scalars={"loss": loss}))] \
        == []


# ------------------------------------------------------------------ unoptimized_parameter
def test_a_parameter_no_optimizer_holds_is_inferred_from_its_unmeasured_update() -> None:
    lay = layout({"a": 100, "b": 100, "c": 100})
    found = UnoptimizedParameter().check(record(lay, update_ratio=[0.01, np.nan, 0.0], grad_norm=[1.0, 1.0, 1.0],
                                                param_norm=[1.0, 1.0, 1.0]))
    assert [(f.layer, f.data["reason"]) for f in found] == [("b", "not_in_optimizer"), ("c", "zero_update")]


def test_optimizer_membership_is_read_from_the_record_when_it_carries_it() -> None:
    """An optimizer that did not step this iteration (a GAN's generator) is not 'no optimizer'."""
    lay = layout({"a": 100, "b": 100, "c": 100})
    found = UnoptimizedParameter().check(record(lay, update_ratio=[0.01, np.nan, np.nan], grad_norm=[1.0, 1.0, 1.0],
                                                param_norm=[1.0, 1.0, 1.0], **{HELD: [1.0, 1.0, 0.0]}))
    assert [(f.layer, f.data["parameters"]) for f in found] == [("c", ["c.weight"])]


def test_nothing_moving_or_updates_too_small_to_tell_from_rounding_are_not_judged() -> None:
    lay = layout({"a": 100, "b": 100})
    detector = UnoptimizedParameter()
    assert detector.check(record(lay, update_ratio=[0.0, 0.0], grad_norm=[1.0, 1.0], param_norm=[1.0, 1.0])) == []
    assert detector.check(record(lay, update_ratio=[5e-6, 0.0], grad_norm=[1.0, 1.0], param_norm=[1.0, 1.0])) == []


def test_an_update_of_0_in_bfloat16_or_float16_is_rounding_not_a_learning_rate_of_0() -> None:
    """Adam at lr 1e-3 moves a LayerNorm gain of 1.0 by less than half a bfloat16 digit (0.0039): 0."""
    for eps, judged in ((float(torch.finfo(torch.float32).eps), True), (float(torch.finfo(torch.bfloat16).eps), False),
                        (float(torch.finfo(torch.float16).eps), False)):
        lay = dataclasses.replace(layout({"a": 100, "b": 100}), eps=(eps, eps))
        found = UnoptimizedParameter().check(record(lay, update_ratio=[0.01, 0.0], grad_norm=[1.0, 1.0],
                                                    param_norm=[1.0, 1.0]))
        assert [f.data["reason"] for f in found] == (["zero_update"] if judged else []), eps


# -------------------------------------------------------------------------- zero_gradient
def test_every_gradient_exactly_zero_is_one_error_after_patience() -> None:
    lay = layout({"a": 10, "b": 10})
    detector = ZeroGradient()
    found = [f for step in range(5) for f in detector.check(record(lay, step, scalars={"loss": 1.0},
                                                                   grad_norm=[0.0, 0.0]))]
    assert [(f.step, f.severity, f.layer) for f in found] == [(2, "error", None)]
    assert ZeroGradient().check(record(lay, scalars={"loss": 0.0}, grad_norm=[0.0, 0.0])) == []


# ------------------------------------------------------------------------ unused_parameter
@pytest.mark.parametrize(("unused", "expected"), [
    (["block.conv1", "block.bn1"], [("block", ["block.conv1", "block.bn1"])]),  # a branch of a block
    (["block.conv1", "block.bn1", "block.down.conv"], [("block", ["block.conv1", "block.bn1", "block.down.conv"])]),
    (["head2.fc1", "head2.fc2"], [("head2", ["head2.fc1", "head2.fc2"])]),  # a whole submodule
    (["enc.0"], [("enc.0", ["enc.0"])]),  # a lone layer keeps its own name
    (["enc.0", "extra"], [("enc.0", ["enc.0"]), ("extra", ["extra"])]),  # unrelated: one finding each
])
def test_unused_layers_are_grouped_by_where_they_sit(unused: list[str], expected: list[tuple[str, list[str]]]) -> None:
    lay = layout({"enc.0": 10, "block.conv1": 10, "block.bn1": 10, "block.down.conv": 10, "block.out": 10,
                  "head2.fc1": 10, "head2.fc2": 10, "extra": 10})
    assert group(lay, unused) == expected


# --------------------------------------------------------- real code, re-judged offline
@pytest.mark.slow  # real models and training loops, several seconds each
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("script", "config"), [
    (gpt, {"lr_scale": 1000, "max_iters": 30, "watch": PAST_THE_HALT}),
    (resnet, {"dead_block": "layer1.0", "steps": 25}),
    (resnet, {"frozen_bn": True, "steps": 25}),
    (reinforce, {"dead_bias": -100.0, "episodes": 25}),
], ids=["gpt-lr-1000x", "resnet-dead-block", "resnet-frozen-bn", "reinforce-dead"])
def test_real_code_findings_are_the_same_re_judged_offline(script: Any, config: dict[str, Any],
                                                           tmp_path: Path) -> None:
    """The detectors that share causes reach the same findings live and over the stored run."""
    script.train(script.Config(run=tmp_path / "run", **config))
    with gw.open_run(tmp_path / "run") as run:
        live, again = run.findings(), rejudge(run)
    key = ["step", "kind", "severity", "layer"]
    assert len(live) and again[key].fillna("-").values.tolist() == live[key].fillna("-").values.tolist()


def _warmup_cosine_loop(run: Path, raise_at: int | None) -> None:
    """AdamW with a linear warmup and a cosine decay, clip_grad_norm_, the loss observed after the step:
    the usual transformer recipe, on a small regression; the learning rate multiplied by 100 at ``raise_at``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    total, warm = 120, 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + np.cos(np.pi * (s - warm) / (total - warm))))
    gw.watch(model, run=run, console=False, **PAST_THE_HALT)  # followed past the wrecked run's error
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=gen)
    for step in range(total):
        if step == raise_at:
            for group in opt.param_groups:
                group["lr"] *= 100
        x = torch.randn(32, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x @ w)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if raise_at is None or step < raise_at:
            sched.step()
        gw.watcher(model).observe(loss=loss)
    gw.unwatch(model)


@pytest.mark.parametrize("raise_at", [None, 80, 85])  # on a sampled step, and between two
def test_a_learning_rate_multiplied_mid_run_is_named_whichever_step_it_lands_on(tmp_path: Path,
                                                                              raise_at: int | None) -> None:
    _warmup_cosine_loop(tmp_path / "run", raise_at)
    with gw.open_run(tmp_path / "run") as run:
        findings = run.findings()
    if raise_at is None:
        assert findings.empty, findings[["step", "kind", "message"]]
        return
    assert not (findings["step"] < raise_at).any()
    first = findings.iloc[0]
    assert first.step <= (raise_at // 10 + 1) * 10, "named by the next sampled step at the latest"
    assert first.data["cause"] == "learning_rate", findings[["step", "kind", "message"]]
    assert "raised" in first.message


# ----------------------------------------------------------- issue 26, item 5: fine-tuning
def test_a_relu_is_not_blamed_when_the_carrier_got_a_weight_gradient() -> None:
    """lora_A's outputs reach a lora_B still at zero: lora_B outputs zeros and lora_A gets no gradient,
    as behind a dead functional ReLU; but lora_B's weights got a gradient, so its input was not all
    zeros (and zero weights make zeros by design): no ReLU is blamed and nothing is dead."""
    from gradwatch.detectors.dead_units import DeadUnits

    lay = layout({"lora_A": 64, "lora_B": 64})
    detector = DeadUnits()
    for step in (0, 10):
        found = detector.check(record(lay, step, act_zero_frac=[0.0, 1.0], grad_norm=[0.0, 0.3],
                                      param_norm=[1.2, 0.0], grad_nonfinite=[0, 0]))
        assert found == []
    # the same zeros reaching a Linear whose weights are not zero and got no gradient: a dead ReLU before it
    detector = DeadUnits()
    found = [f for step in (0, 10) for f in detector.check(record(lay, step, act_zero_frac=[0.0, 1.0],
                                                                  grad_norm=[0.0, 0.0], param_norm=[1.2, 0.8],
                                                                  grad_nonfinite=[0, 0]))]
    assert [(f.step, f.layer, f.data["zeroed_in"]) for f in found] == [(10, "lora_A", "lora_B")]


def test_parameters_in_no_optimizer_are_named_even_when_nothing_moves() -> None:
    """The optimizer holds only frozen weights (ratio NaN: not measured for them either, their norm is
    not taken): the trainable parameters with gradients are in no optimizer, and nothing trains."""
    lay = dataclasses.replace(layout({"base": 100, "lora_B": 100, "head": 100}), trainable=(False, True, True))
    found = UnoptimizedParameter().check(record(lay, update_ratio=[np.nan, np.nan, np.nan],
                                                grad_norm=[np.nan, 0.5, 1.0], param_norm=[np.nan, 0.0, 1.0]))
    assert [(f.layer, f.severity, f.data["parameters"]) for f in found] == [
        ("lora_B", "error", ["lora_B.weight", "head.weight"])]
    # some trainable parameter is held (and moves): the one left out is a warning
    lay = dataclasses.replace(lay, trainable=(True, True, True))
    found = UnoptimizedParameter().check(record(lay, update_ratio=[0.0, np.nan, np.nan],
                                                grad_norm=[1.0, 0.5, 1.0], param_norm=[1.0, 0.0, 1.0]))
    assert [(f.layer, f.severity) for f in found] == [("lora_B", "warning")]


def _lr_run(detector: LearningRate, steps: range, losses: Any, ratios: Any) -> list[Any]:
    """Feed every step's loss to the shared causes (as the judge does) and judge every 10th step."""
    lay = layout({"a": 100, "b": 100})
    found = []
    for step in steps:
        rec = record(lay, step, scalars={"loss": losses(step), "lr": 1e-2}, update_ratio=ratios(step),
                     param_norm=[1.0, 1.0], grad_norm=[1.0, 1.0], grad_nonfinite=[0, 0])
        detector.causes.loss_of(rec)
        if step % 10 == 0:
            found += detector.check(rec)
    return found


def test_large_updates_with_a_loss_that_stopped_falling_are_a_learning_rate_too_high_then_an_error() -> None:
    found = _lr_run(LearningRate(), range(50), lambda s: 0.69 + 0.01 * (s % 3), lambda s: [0.08, 0.1])
    assert [(f.step, f.severity, f.data["evidence"]) for f in found] == [
        (10, "warning", "update_ratio_no_progress"), (30, "error", "no_progress")]
    # the same updates with a loss that falls (a small model trained from scratch, the word LM): quiet
    assert _lr_run(LearningRate(), range(50), lambda s: 4.6 - 0.05 * s, lambda s: [0.08, 0.1]) == []
    # a loss that is flat with healthy updates: not the learning rate's
    assert _lr_run(LearningRate(), range(50), lambda s: 0.69, lambda s: [0.01, 0.01]) == []


def test_a_learning_rate_named_too_high_whose_loss_diverges_is_an_error_once() -> None:
    found = _lr_run(LearningRate(), range(60), lambda s: 2.3 * (1 + s), lambda s: [5.0, 8.0])
    assert [(f.step, f.severity, f.layer) for f in found] == [(0, "warning", "b"), (10, "error", "b")]
    assert found[1].message.startswith("learning rate too high for b, named at step 0: the run has diverged since")
    # named too high, then the loss fell: the warning stands alone
    found = _lr_run(LearningRate(), range(60), lambda s: 2.3 / (1 + s), lambda s: [5.0, 8.0] if s == 0 else [1e-3] * 2)
    assert [(f.step, f.severity) for f in found] == [(0, "warning")]


def test_the_wrecked_runs_error_sends_the_restart_to_before_the_raise_not_to_a_later_mention(tmp_path: Path) -> None:
    """A learning rate raised 1000x at step 53: the spike at 54 names the raise; the explosions after it mention
    it again, and the error must still say where the weights were last sound (before step 53)."""
    import gradwatch as gw

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
    gw.watch(model, run=tmp_path / "run", console=False, **PAST_THE_HALT)  # followed past the error
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    x_all = torch.randn(4096, 20, generator=gen)
    y_all = x_all[:, :5].argmax(1)
    for step in range(100):
        if step == 53:
            opt.param_groups[0]["lr"] *= 1000
        i = torch.randint(0, 4096, (64,), generator=gen)
        loss = nn.functional.cross_entropy(model(x_all[i]), y_all[i])
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)
    found = gw.open_run(tmp_path / "run").findings()
    first = found[found.message.str.contains("raised 1e\\+03x at step 53")]
    assert len(first) and first.step.min() == 54, list(zip(found.kind, found.step, found.message))
    error = found[found.severity == "error"]
    assert list(error.kind) == ["learning_rate"], list(zip(found.kind, found.step, found.message))
    assert error.iloc[0].data["named_at"] == 54 and error.iloc[0].data["restart_before"] == 53
    assert "named at step 54 (raised at step 53)" in error.iloc[0].message
    assert error.iloc[0].message.endswith("restart from before step 53.")


def test_an_embedding_row_gone_nan_is_one_finding_for_the_whole_stretch(tmp_path: Path) -> None:
    """One row of an embedding becomes NaN at step 15 (written outside a step); batches that miss the row
    stay finite, the weights do not: one nonfinite finding with its repeats, and no claim that the
    embedding is in no optimizer (its update ratio is NaN because its weights are)."""
    import gradwatch as gw

    torch.manual_seed(0)
    vocab = 100
    model = nn.Sequential(nn.Embedding(vocab, 16), nn.Linear(16, vocab))
    gw.watch(model, run=tmp_path / "run", console=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(80):
        x = torch.randint(0, vocab, (8,), generator=gen)
        if step == 15:
            x[0] = 7
            with torch.no_grad():
                model[0].weight[7] = float("nan")
        loss = nn.functional.cross_entropy(model(x), (x * 3) % vocab)
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)
    found = gw.open_run(tmp_path / "run").findings()
    assert [(f.kind, f.step, f.layer) for f in found.itertuples()] == [("nonfinite", 15, "0")], \
        list(zip(found.kind, found.step, found.message))
    data = found.iloc[0].data
    assert data["lasting"] == "weights NaN/Inf from step 15" and data["repeats"] >= 3 and data["last_step"] > 50


def _dropping_nan_batches(run: Path | None, bad: int) -> list[float]:
    """A loop that drops a NaN batch itself (``if not torch.isfinite(loss): continue``, before backward)."""
    import gradwatch as gw

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    if run is not None:
        gw.watch(model, run=run, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for batch in range(60):
        x = torch.randn(16, 8, generator=gen)
        y = 2 * x[:, :1]
        if batch == bad:
            x[3, 2] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        if not torch.isfinite(loss):
            continue
        opt.zero_grad()
        loss.backward()
        if run is not None:
            gw.watcher(model).observe(loss=loss)
        opt.step()
        losses.append(loss.item())
    if run is not None:
        gw.unwatch(model)
    return losses


@pytest.mark.parametrize("bad", [30, 33])  # its forward joins a sampled step's (30), or an unsampled one's
def test_a_nan_batch_the_loop_drops_itself_costs_no_healthy_step(tmp_path: Path, bad: int) -> None:
    """The dropped batch's forward joins the next step's, whose loss and gradients are finite: its update is
    sound and the default rules must not skip it (they did: a healthy batch's update lost)."""
    import gradwatch as gw

    assert _dropping_nan_batches(tmp_path / "run", bad) == _dropping_nan_batches(None, bad)
    found = gw.open_run(tmp_path / "run").findings()
    loud = found[found.severity != "info"]
    assert all(loud.severity == "warning") and all(loud.action == "warn"), list(zip(loud.kind, loud.action))
    if len(loud):  # seen where the activations were measured: said for what it is
        assert list(zip(loud.kind, loud.step)) == [("nonfinite", bad)]
        assert loud.iloc[0].data["reached_update"] is False
        assert "the NaN reached neither, so its update is sound" in loud.iloc[0].message
    if bad == 30:
        assert len(loud) == 1


def _collapsing(losses: Callable[[int], float], rms: Callable[[int], float], steps: int = 120,
                named_lr_at: int | None = None) -> list[Any]:
    """A vanishing detector fed ``steps`` steps of three layers, every 10th sampled; the output layer keeps
    a gradient of 1e-2 while the other two follow ``rms``."""
    lay = layout({"enc": 100, "dec": 100, "out": 100})
    detector = Vanishing()
    found = []
    for step in range(steps):
        if step == named_lr_at:
            detector.causes.note(LR_HIGH, step)
        rec = record(lay, step, scalars={"loss": losses(step), "lr": 1e-3}, grad_norm=[10 * rms(step)] * 2 + [0.1])
        rec.sampled = step % 10 == 0
        detector.causes.loss_of(rec)
        found += detector.check(rec)
    return found


def test_a_model_whose_gradients_collapse_while_its_loss_stalls_is_named_once() -> None:
    collapse = lambda s: 1e-2 if s < 20 else 1e-6  # noqa: E731
    found = _collapsing(lambda s: 2.6 + 0.01 * (s % 3) if s > 5 else 3.5, collapse)
    assert [(f.step, f.severity, f.layer, f.data["evidence"]) for f in found] == [(40, "warning", None, "collapse")]
    assert found[0].data["learning"] == ["out"] and found[0].data["early_rms"] == pytest.approx(1e-2)
    # the same fall of the gradients with a loss that fell with them: a model that converged
    assert _collapsing(lambda s: 3.5 * 0.9 ** s, collapse) == []
    # a stalled loss with gradients 10x smaller: not a collapse
    assert _collapsing(lambda s: 2.6, lambda s: 1e-2 if s < 20 else 1e-3) == []
    # the learning rate named too high already: the collapse is its doing, said there
    assert _collapsing(lambda s: 2.6, collapse, named_lr_at=15) == []
    # the loss not observed: not judged
    assert _collapsing(lambda s: float("nan"), collapse) == []
