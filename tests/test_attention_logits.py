"""Detector ``attention_logits`` on the scalars of sampled steps: growth found once, steady or slow logits quiet, the
error once the loss follows.
"""

from __future__ import annotations

import math

import numpy as np

from gradwatch.detectors.attention_logits import AttentionLogits
from gradwatch.store.findings import Finding
from gradwatch.store.records import LAYER, Layout, StepRecord

LAYOUT = Layout(version=1, layers=("blocks.0.attn.c_attn",), layer_types=("Linear",), layer_numel=(4,),
                params=("blocks.0.attn.c_attn.weight",), param_numel=(4,), owners=((0, 0),), leaves=(0,),
                trainable=(True,))


def record(step: int, logits: dict[str, float], *, loss: float = 1.0, sampled: bool = True,
           entropy: float = 1.0) -> StepRecord:
    scalars = {"loss": loss}
    for layer, value in logits.items():
        scalars.update({f"attn_logit_max/{layer}": value, f"attn_logit_head/{layer}": 2.0,
                        f"attn_entropy/{layer}": entropy, f"attn_entropy_head/{layer}": 1.0})
    return StepRecord(step=step, time=0.0, layout=LAYOUT, scalars=scalars if sampled else {"loss": loss},
                      vectors={(LAYER, "grad_norm"): np.ones(1, dtype=np.float32)}, sampled=sampled)


def run(detector: AttentionLogits, series: dict[str, list[float]], *, every: int = 10,
        losses: list[float] | None = None) -> list[Finding]:
    found = []
    n = max(len(v) for v in series.values())
    for k in range(n):
        for j in range(every):
            step = k * every + j
            loss = 1.0 if losses is None else losses[min(step, len(losses) - 1)]
            values = {layer: v[k] for layer, v in series.items() if k < len(v)}
            rec = record(step, values, loss=loss, sampled=j == 0, entropy=0.2)
            detector.causes.loss_of(rec)
            found += detector.check(rec)
    return found


def test_growth_is_found_once_at_its_layer_with_head_and_rate() -> None:
    found = run(AttentionLogits(), {"blocks.0.attn": [0.1, 4.0, 48.0, 77.0, 115.0, 160.0, 200.0]})
    assert len(found) == 1
    (f,) = found
    assert (f.kind, f.severity, f.layer, f.step) == ("attention_logits", "warning", "blocks.0.attn", 30)
    assert f.data["head"] == 2 and f.data["entropy_head"] == 1 and f.data["growth"] > 100
    assert 1.0 < f.data["per_step"] < 1.5
    assert "qk-layernorm" in f.message and "head 2" in f.message and "near one-hot" in f.message


def test_steady_high_logits_and_slow_growth_are_quiet() -> None:
    steady = [60.0, 62.0, 61.0, 63.0, 62.5, 64.0, 63.0, 65.0]  # a pretrained model's: high, not growing
    slow = [20.0 * 1.004 ** (10 * k) for k in range(60)]  # 20 -> 210 over 590 steps: x1.5 per 100 steps
    assert run(AttentionLogits(), {"a": steady, "b": slow}) == []


def test_layers_crossing_together_are_one_finding() -> None:
    grow = [1.0, 5.0, 30.0, 60.0, 90.0]
    found = run(AttentionLogits(), {"blocks.0.attn": grow, "blocks.1.attn": grow, "blocks.2.attn": [1.0, 2.0, 2.5]})
    assert [(f.layer, f.data["layers"]) for f in found] == [("blocks.0.attn", ["blocks.0.attn", "blocks.1.attn"])]


def test_an_error_once_the_loss_follows() -> None:
    losses = [3.0 - 0.02 * s for s in range(60)] + [1.8 * 1.05 ** s for s in range(60)]
    found = run(AttentionLogits(), {"blocks.0.attn": [0.1, 4.0, 48.0, 77.0, 115.0, 160.0, 200.0, 250.0, 300.0,
                                                      350.0, 400.0, 450.0]}, losses=losses)
    kinds = [(f.severity, f.step) for f in found]
    assert kinds[0] == ("warning", 30)
    assert [s for s, _ in kinds].count("error") == 1
    error = next(f for f in found if f.severity == "error")
    assert error.step > 60 and error.data["named_at"] == 30 and error.data["loss_level"] >= 1.5 * error.data[
        "loss_lowest"]
    assert "restart from a checkpoint before step 30" in error.message.lower()


def test_non_finite_and_unsampled_values_are_not_judged() -> None:
    detector = AttentionLogits()
    assert run(detector, {"a": [math.nan, math.inf, math.nan]}) == []
    assert detector.check(record(1, {"a": 1e6}, sampled=False)) == []


def test_the_report_shows_the_layers_logits_around_the_finding() -> None:
    """An attention module owns no parameters, so it is no layer of the run: the report's evidence for the
    finding is its ``attn_logit_max/<layer>`` scalar, on the sampled steps before the finding."""
    import pandas as pd

    from gradwatch.report.items import Item, spark

    scalars = pd.DataFrame({"attn_logit_max/blocks.0.attn": [1.0, None, 8.0, None, 60.0, None],
                            "grad_norm": [1.0] * 6}, index=[0, 5, 10, 15, 20, 25])
    item = Item(index=0, step=20, kind="attention_logits", severity="warning", layer="blocks.0.attn", phase=None,
                message="", action=None, hint=None, repeats=0, last_step=None, outcome=None, evidence=[], related=[],
                restored_step=None)
    shown = spark(None, item, scalars)  # type: ignore[arg-type]  # the run is read for layers only
    assert shown is not None and shown.label == "attn_logit_max of blocks.0.attn"
    assert shown.steps.tolist() == [0, 10, 20] and shown.values.tolist() == [1.0, 8.0, 60.0] and shown.step == 20
