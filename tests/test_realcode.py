"""The real-code zoo (tests/realcode) through gradwatch with the default rules (issue 15).

Healthy variants: no warning or error, and the losses are bit-identical watched and unwatched.
Planted failures, the way they happen in practice: every warning and error of the run is listed
exactly (kind, step, layer), so each root cause is one finding found where and when it starts,
and its message says what went wrong and what to do.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gradwatch as gw

from . import pool
from .realcode import (
    PAST_THE_HALT,
    Result,
    figures,
    gpt,
    hf_trainer,
    lstm_lm,
    reinforce,
    resnet,
    train,
    unwatched_aside,
    vae,
)

# the real-code zoo: real models and training loops, several seconds each (one thread: small models on a shared machine)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]




def loud(result: Result) -> list[dict[str, Any]]:
    """The run's warnings and errors."""
    return [f for f in result.findings() if f["severity"] != "info"]


def summary(found: list[dict[str, Any]]) -> list[tuple[str, int, str | None]]:
    return [(f["kind"], f["step"], f["layer"]) for f in found]


# ------------------------------------------------------------------------------------ healthy
HEALTHY = {
    "gpt-bf16": (gpt, {"max_iters": 40}),
    "gpt-fp16-gradscaler": (gpt, {"dtype": "float16", "max_iters": 20}),
    "gpt-no-clip-no-warmup": (gpt, {"grad_clip": 0.0, "warmup_iters": 0, "max_iters": 40}),
    "lstm-lm-sgd": (lstm_lm, {"optimizer": "sgd"}),
    "resnet-bn-sgd-momentum": (resnet, {}),
    "vae-summed-loss": (vae, {}),  # healthy global norms of 3e3 to 1.5e4: no absolute limit fires
    "reinforce": (reinforce, {}),
}


@pytest.mark.parametrize("name", list(HEALTHY))
@pytest.mark.slow  # each real-code model trained twice
def test_healthy_real_code_is_quiet_and_bit_identical(name: str, tmp_path: Path) -> None:
    script, config = HEALTHY[name]
    aside = unwatched_aside(script, **config)  # the unwatched run trains in the tests' pool meanwhile
    watched = train(script, tmp_path / "run", **config)
    plain = pool.result(aside)
    assert watched.losses == plain.losses, "watching changes nothing (the default rules took no action)"
    assert loud(watched) == []
    assert sum(plain.losses[-5:]) < sum(plain.losses[:5]) or name == "reinforce", "the script learns"


@pytest.mark.slow  # a Trainer run takes a few seconds to set up
def test_healthy_hf_trainer_is_quiet_and_bit_identical(tmp_path: Path) -> None:
    aside = unwatched_aside(hf_trainer)  # the unwatched run trains in the tests' pool meanwhile
    watched = train(hf_trainer, tmp_path / "run")
    plain = pool.result(aside)
    assert watched.losses == plain.losses
    assert loud(watched) == []


def test_vae_summed_loss_gradient_norms_are_in_the_thousands(tmp_path: Path) -> None:
    """The case an absolute bound on the global norm (the former exploding.limit = 1e4) got wrong."""
    import gradwatch as gw

    result = train(vae, tmp_path / "run")
    with gw.open_run(tmp_path / "run") as run:
        _, norms = run.series("grad_norm")
    assert norms.max() > 1.5e4 and norms.min() > 3e3
    assert result.findings() == []


# ------------------------------------------------------------------ item 1: the learning rate
def test_gpt_lr_100x_is_named_at_step_0(tmp_path: Path) -> None:
    """Before: nothing in 60 steps (the issue's run: one exploding warning at step 121)."""
    found = loud(train(gpt, tmp_path / "run", lr_scale=100))
    assert summary(found) == [("learning_rate", 0, "transformer.h.0.attn.c_proj")]
    message = found[0]["message"]
    assert message.startswith("learning rate too high for transformer.h.0.attn.c_proj (Linear): update is 0.93x "
                              "the weights at step 0 (half the weights move by 0.46x or more; healthy runs: ~1e-3)")
    assert message.endswith("lower it or add warmup.")
    assert found[0]["data"]["direction"] == "high" and found[0]["data"]["cause"] == "learning_rate"


def test_gpt_lr_1000x_diverging_is_named_at_step_0(tmp_path: Path) -> None:
    """Before: nothing. The loss diverges from step 2 (4.1 -> 8.2): the same cause, not a second
    finding; a later explosion of the norm before clipping is still found (and clipped), tied to it."""
    result = train(gpt, tmp_path / "run", lr_scale=1000, watch=PAST_THE_HALT)
    assert max(result.losses[:6]) > 1.9 * result.losses[0]
    found = loud(result)
    assert summary(found[:1]) == [("learning_rate", 0, "transformer.h.0.attn.c_proj")]
    assert "update is 9.3x the weights at step 0" in found[0]["message"]
    assert "loss_spike" not in {f["kind"] for f in found}, "the divergence is the learning rate's"
    # the run then diverged (issue 26): the learning-rate finding becomes an error, once
    assert [(f["kind"], f["step"], f["severity"]) for f in found[1:]] == [("learning_rate", 10, "error")]
    assert found[1]["layer"] == "transformer.h.0.attn.c_proj" and found[1]["data"]["evidence"] == "diverged"
    read = figures(found[1]["message"], "learning rate too high for transformer.h.0.attn.c_proj, named at step 0: "
                                        "the run has diverged since: the loss is {n} at step 10")
    assert read and read[0] > 1.5 * result.losses[0], found[1]["message"]  # diverged: far above where it started


def test_gpt_lr_far_too_low_is_named(tmp_path: Path) -> None:
    found = loud(train(gpt, tmp_path / "run", lr_scale=1e-4))
    assert summary(found) == [("learning_rate", 10, None)]  # sampled steps 0 and 10
    assert found[0]["message"].startswith("learning rate too low (lr 1e-07): the largest update is 6.5e-06x its "
                                          "layer's weights")
    assert found[0]["data"]["direction"] == "low"


def test_resnet_lr_100x_is_named_at_step_0(tmp_path: Path) -> None:
    result = train(resnet, tmp_path / "run", lr_scale=100, watch=PAST_THE_HALT)
    found = loud(result)
    assert summary(found) == [("learning_rate", 0, "layer1.0.conv1"), ("learning_rate", 20, "layer1.0.conv1")]
    assert "learning rate too high for layer1.0.conv1 (Conv2d): update is 3.5x the weights" in found[0]["message"]
    # the loss ends where it started (chance: ln 10): the run never learned, an error (issue 26)
    assert sum(result.losses[-5:]) / 5 > 2.25
    assert found[1]["severity"] == "error" and found[1]["data"]["evidence"] == "no_progress"
    assert re.search(r"named at step 0: the run has not learned since: the loss is [\d.]+ at step 20",
                     found[1]["message"]), found[1]["message"]


def test_resnet_lr_far_too_low_is_one_finding(tmp_path: Path) -> None:
    """The per-layer 'does not learn' findings of the same cause (updates ~1e-9) are not repeated."""
    found = loud(train(resnet, tmp_path / "run", lr_scale=1e-5))
    assert summary(found) == [("learning_rate", 10, None)]
    assert "learning rate too low (lr 9.33e-07)" in found[0]["message"]


def test_word_lm_lr_100x_is_named_at_step_0(tmp_path: Path) -> None:
    found = loud(train(lstm_lm, tmp_path / "run", optimizer="sgd", lr_scale=100, watch=PAST_THE_HALT))
    assert summary(found)[0] == ("learning_rate", 0, "decoder")
    assert "update is 64x the weights at step 0" in found[0]["message"]
    assert (summary(found)[1], found[1]["severity"]) == (("learning_rate", 10, "decoder"), "error")  # diverged
    loss = re.search(r"the run has diverged since: the loss is ([\d.]+) at step 10", found[1]["message"])
    assert loss and 100 < float(loss.group(1)) < 10_000, found[1]["message"]  # from ~7 (ln 1000) by orders
    later = found[2:]  # the wrecked model's gradients later jump back: still clipped, tied to the cause
    assert all(f["kind"] == "exploding" and f["data"]["cause"] == "learning_rate" for f in later), summary(later)


@pytest.mark.slow  # Trainer runs
def test_hf_trainer_lr_100x_is_named(tmp_path: Path) -> None:
    """Before: one exploding warning at step 128 (the issue's run). With the Trainer's default of no
    warmup the first update names it; with a warmup that starts at lr 0, the first sampled step
    after the weights started moving does, by their geometric growth."""
    found = loud(train(hf_trainer, tmp_path / "a", lr_scale=100, warmup_steps=0))
    assert summary(found) == [("learning_rate", 0, "transformer.h.1.attn.c_proj")]
    assert "learning rate too high for transformer.h.1.attn.c_proj (Conv1D): update is 10x" in found[0]["message"]
    found = loud(train(hf_trainer, tmp_path / "b", lr_scale=100))
    assert summary(found) == [("learning_rate", 10, "transformer.h.0.mlp.c_proj")]
    read = figures(found[0]["message"], "its weights grew {n}x in 10 steps up to step 10 (the whole model's {n}x",
                   anywhere=True)
    assert read and read[0] > 5 and 1 < read[1] < read[0], found[0]["message"]  # one layer grew far faster


@pytest.mark.slow  # a Trainer run
def test_hf_trainer_lr_1000x_divergence_is_named_within_3_steps(tmp_path: Path) -> None:
    """Warmup from lr 0: the weights start moving at step 1, the loss rises from step 3 (4.3 -> 6.2 -> 8.3)
    and the divergence is named once its level held for two steps; still diverged 15 steps later, the
    run is lost: an error (issue 26)."""
    result = train(hf_trainer, tmp_path / "run", lr_scale=1000)
    found = loud(result)
    assert summary(found) == [("loss_spike", 5, None), ("learning_rate", 20, None)]
    spike = figures(found[0]["message"], "loss {n} at step 5 (median of the last 3) is {n}x its first values ({n}): "
                    "training is diverging; the learning rate is likely too high")
    assert spike and spike[1] >= 1.5 and spike[0] > spike[2] > 1, found[0]["message"]
    assert found[1]["severity"] == "error"
    lost = figures(found[1]["message"], "learning rate too high, named at step 5: the run has diverged since: the "
                   "loss is {n} at step 20")
    assert lost and lost[0] > 2 * spike[2], found[1]["message"]  # still far above its first values
    assert found[0]["data"]["divergence"] and found[0]["data"]["cause"] == "learning_rate"


# ----------------------------------------------------- huge but finite: a norm that overflows
@pytest.mark.slow  # the overflowing step is replayed to find the samples that carry it
def test_gradients_whose_squares_overflow_are_named_at_step_0_with_a_norm_recorded_right(tmp_path: Path) -> None:
    """A log-variance head that starts at 45: exp() makes gradients up to 5e21, whose squares overflow
    float32: Adam's second moment turns inf, and its update of the head's bias is exactly 0. Before the norms
    were scaled, the float32 sum of squares was inf (an 'exploding' error from gradwatch's own arithmetic);
    before that, nothing, and 'vanishing' on the saturated decoder at step 9. Now the norm is recorded
    right, and the update of 0 is named with its cause (not a learning rate of 0), as an error."""
    result = train(vae, tmp_path / "run", logvar_bias=45.0, steps=2)
    assert result.losses[0] > 1e20
    found = loud(result)
    assert summary(found) == [("unoptimized_parameter", 0, "fc22")]
    assert found[0]["severity"] == "error" and found[0]["data"]["reason"] == "squares_overflow"
    assert found[0]["message"].startswith("fc22.bias (20 elements) gets gradients but never changes (an update of "
                                          "exactly 0 at step 0): gradient elements reach 5.05e+21, beyond 1.8e+19")
    with gw.open_run(result.run) as run:
        norms = run.metrics().query("metric == 'grad_norm' and step == 0")
    assert np.isfinite(norms.value).all() and 1e22 < norms.value.max() < 1e24


# --------------------------------------------- item 5: parameters that no optimizer changes
def test_a_parameter_left_out_of_the_optimizer_is_named_at_step_0(tmp_path: Path) -> None:
    """configure_optimizers' name filter drops the position embedding. Before: nothing."""
    found = loud(train(gpt, tmp_path / "run", left_out="wpe.weight"))
    assert summary(found) == [("unoptimized_parameter", 0, "transformer.wpe")]
    assert found[0]["message"].startswith("transformer.wpe.weight (1,536 elements) gets gradients but no optimizer "
                                          "updates it")
    assert found[0]["data"]["reason"] == "not_in_optimizer" and found[0]["data"]["parameters"] == [
        "transformer.wpe.weight"]


def test_parameters_frozen_by_mistake_with_lr_0_are_one_finding(tmp_path: Path) -> None:
    """The BatchNorm group meant to get weight_decay=0 got lr=0. Before: 9 'does not learn' warnings at step 20."""
    found = loud(train(resnet, tmp_path / "run", frozen_bn=True))
    assert summary(found) == [("unoptimized_parameter", 0, "bn1")]
    data = found[0]["data"]
    assert data["reason"] == "zero_update" and len(data["parameters"]) == 9
    assert all(p.endswith("weight") for p in data["parameters"]), "zero-initialised biases give no ratio"
    assert "never change" in found[0]["message"] and "learning rate is 0" in found[0]["message"]


# ---------------------------------------------------- item 7: one root cause, one finding
def test_clip_max_norm_0_is_named_once_not_as_vanishing(tmp_path: Path) -> None:
    """clip_grad_norm_(..., 0.0): every gradient is zero. Before: 16 vanishing warnings at step 9."""
    found = loud(train(gpt, tmp_path / "run", grad_clip=0.0, clip_always=True))
    assert summary(found) == [("zero_gradient", 2, None)]
    assert found[0]["severity"] == "error"
    assert "for 3 steps up to step 2" in found[0]["message"] and "max_norm=0" in found[0]["message"]


def test_a_block_killed_through_functional_relu_is_named_at_its_batchnorm(tmp_path: Path) -> None:
    """bn1's outputs are all negative and F.relu zeroes them. Before: dead units of the next module
    (conv2) at step 10, and vanishing of conv1, bn1 and conv2 at step 9."""
    found = loud(train(resnet, tmp_path / "run", dead_block="layer1.0"))
    assert summary(found) == [("dead_units", 10, "layer1.0.bn1")]
    message = found[0]["message"]
    assert message.startswith("every output of layer1.0.bn1 (BatchNorm2d) is zeroed by the ReLU applied after it "
                              "(a functional F.relu: 100.0% of what reaches layer1.0.conv2 (Conv2d) is exactly zero)")
    assert found[0]["data"]["zeroed_in"] == "layer1.0.conv2"
    assert found[0]["data"]["no_gradient"] == ["layer1.0.conv1", "layer1.0.conv2"]


def test_a_policy_layer_killed_through_functional_relu_is_named_not_its_dropout(tmp_path: Path) -> None:
    """Before: vanishing of affine1 at step 9 and dead units of 'dropout' at step 10."""
    found = loud(train(reinforce, tmp_path / "run", dead_bias=-100.0))
    assert summary(found) == [("dead_units", 10, "affine1")]
    assert "every output of affine1 (Linear) is zeroed by the ReLU applied after it" in found[0]["message"]
    assert "what reaches dropout (Dropout) is exactly zero" in found[0]["message"]


def test_a_dropped_branch_is_one_finding_for_its_block(tmp_path: Path) -> None:
    """A block whose forward forgot '+=' (out = shortcut(x)). Before: 4 unused_parameter findings."""
    found = loud(train(resnet, tmp_path / "run", dropped_branch="layer2.0"))
    assert summary(found) == [("unused_parameter", 2, "layer2.0")]
    assert found[0]["data"]["layers"] == ["layer2.0.conv1", "layer2.0.bn1", "layer2.0.conv2", "layer2.0.bn2"]
    assert found[0]["message"].startswith("a branch of layer2.0 (conv1, bn1, conv2, bn2: 6 parameters, 3,520 "
                                          "elements) received no gradient in 3 steps")


def test_a_block_without_any_gradient_is_one_finding_under_its_name(tmp_path: Path) -> None:
    found = loud(train(resnet, tmp_path / "run", dropped_branch="layer1.0"))  # an identity shortcut: nothing used
    assert summary(found) == [("unused_parameter", 2, "layer1.0")]
    assert found[0]["message"].startswith("no parameter of layer1.0 (conv1, bn1, conv2, bn2: 6 parameters")


def test_a_fully_masked_attention_row_is_nonfinite_at_the_attention(tmp_path: Path) -> None:
    """A left-padded sample whose first query may attend to nothing: softmax over all -inf (bf16)."""
    result = train(gpt, tmp_path / "run", pad_at=20)
    found = loud(result)
    assert summary(found) == [("nonfinite", 20, "transformer.h.0.attn")]
    assert found[0]["phase"] == "forward" and found[0]["action"] == "skip"
    assert all(torch.isfinite(torch.tensor(result.losses[21:]))), "the default rule skipped the step"
