"""A trust trial of gradwatch on two more widely copied training styles of the real-code zoo.

A seq2seq ``nn.Transformer`` trained the way the translation tutorials do it (padding and causal
masks, teacher forcing, label-smoothed cross-entropy ignoring padding, Adam under a Noam warmup
stepped per iteration: ``tests/realcode/seq2seq.py``), a timm-style ConvNeXt (channels_last,
mixup with soft targets, AdamW with a no-decay group, warmup then cosine per iteration,
``clip_grad_norm_``, an ``AveragedModel`` EMA evaluated under ``torch.no_grad``:
``tests/realcode/timm_convnext.py``) and SimCLR-style contrastive pre-training (two augmented
views, NT-Xent with a temperature, SGD with momentum and a cosine schedule:
``tests/realcode/simclr.py``). Read the way a user reads them, through ``gw.open_run`` and
``gradwatch check --format json``: healthy runs are quiet and watching changes no loss; each
planted failure is found at its kind, step and layer, and the gate fails on an error; the same
findings with either order of ``torch.compile`` and ``gw.watch``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import gradwatch as gw

from . import pool
from .realcode import (
    PAST_THE_HALT,
    aside,
    check,
    figures,
    loud,
    seq2seq,
    simclr,
    summary,
    timm_convnext,
    train,
    unwatched_aside,
)

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")]  # nn.Transformer, batch_first=False

ORDERS = ["compile-watched", "watch-compiled"]


# ------------------------------------------------------------------------------------ healthy
def test_a_short_healthy_seq2seq_is_quiet_and_bit_identical(tmp_path: Path) -> None:
    plain = unwatched_aside(seq2seq, steps=40)
    watched = train(seq2seq, tmp_path / "run", steps=40)
    assert watched.losses == pool.result(plain).losses
    assert loud(watched) == []
    assert check(tmp_path / "run", "--fail-on", "warning")[0] == 0


def test_a_short_healthy_timm_loop_is_quiet_bit_identical_and_its_evaluations_are_no_steps(tmp_path: Path) -> None:
    aside = unwatched_aside(timm_convnext, steps=60, eval_every=20)
    watched = train(timm_convnext, tmp_path / "run", steps=60, eval_every=20)
    plain = pool.result(aside)
    assert watched.losses == plain.losses
    assert watched.extra["accuracy"] == plain.extra["accuracy"]
    assert watched.extra["ema_accuracy"] == plain.extra["ema_accuracy"]
    assert loud(watched) == []
    with gw.open_run(tmp_path / "run") as run:
        assert run.steps == 60, "the evaluations under torch.no_grad (model and EMA) are no steps"
    ema = watched.extra["ema"]
    assert not any("gradwatch" in type(m).__module__ for m in ema.modules()), "the EMA copy holds nothing of gradwatch"
    code, report = check(tmp_path / "run", "--fail-on", "warning")
    assert (code, report["verdict"], report["status"], report["findings"]) == (0, "pass", "finished", [])


@pytest.mark.parametrize("warmup_steps", [10_000, 25_000])
def test_a_convnext_under_its_recipes_long_warmup_is_quiet_behind_its_layer_scales(warmup_steps: int,
                                                                                   tmp_path: Path) -> None:
    """The official ConvNeXt recipe: layer scales at 1e-6, AdamW at 4e-3, a linear warmup from 0 over 20
    epochs (about 25,000 iterations) stepped per iteration. The scales barely move, and the gradients of the
    layers they scale stay a millionth of the others': small by design, said once per scale (info)."""
    result = train(timm_convnext, tmp_path / "run", steps=40, warmup_steps=warmup_steps)
    assert loud(result) == []
    small = [f for f in result.findings() if f["kind"] == "vanishing"]
    assert small and all(f["severity"] == "info" and f["data"]["gate"].endswith(".gamma") for f in small)
    assert {f["data"]["gate"] for f in small} == {f["data"]["gate"] for f in small if f["step"] == 9}
    assert check(tmp_path / "run", "--fail-on", "warning")[0] == 0


#: one seed per script, not the same for all: the healthy sweep (``test_healthy_sweep``) is where seeds vary
HEALTHY = {f"{script.__name__.rpartition('.')[2]}-seed{seed}": (script, {"steps": 250, "seed": seed})
           for script, seed in ((seq2seq, 0), (timm_convnext, 1), (simclr, 0))}


@pytest.mark.parametrize("name", list(HEALTHY))
@pytest.mark.slow  # 250 steps, trained twice
def test_healthy_runs_of_250_steps_are_quiet_and_bit_identical(name: str, tmp_path: Path) -> None:
    script, config = HEALTHY[name]
    aside = unwatched_aside(script, **config)  # the unwatched run trains in the tests' pool meanwhile
    watched = train(script, tmp_path / "run", **config)
    plain = pool.result(aside)
    assert watched.losses == plain.losses
    assert loud(watched) == []
    assert sum(plain.losses[-10:]) < 0.6 * sum(plain.losses[:10]), "the script learns"
    code, report = check(tmp_path / "run", "--fail-on", "warning")
    assert (code, report["steps"], report["findings"]) == (0, 250, [])


# ---------------------------------------------------------------------------- seq2seq plants
def test_seq2seq_noam_factor_100x_is_named_then_failed_as_a_run_that_never_learned(tmp_path: Path) -> None:
    """The Noam warmup starts small: the first sampled step after it ramped up names the learning rate."""
    result = train(seq2seq, tmp_path / "run", steps=32, lr_scale=100, watch=PAST_THE_HALT)
    found = loud(result)
    layer = "transformer.decoder.layers.1.self_attn"
    assert summary(found) == [("learning_rate", 10, layer, "warning"), ("learning_rate", 30, layer, "error")]
    grew = figures(found[0]["message"], f"learning rate too high for {layer} (MultiheadAttention): its weights grew "
                   "{n}x in 10 steps up to step 10")
    assert grew and grew[0] >= 2, found[0]["message"]  # geometric growth: the detector's bar is 2x per 10 steps
    assert found[1]["data"]["evidence"] == "no_progress"
    code, report = check(tmp_path / "run")
    assert (code, report["verdict"]) == (1, "fail")
    assert [(f["kind"], f["step"], f["layer"], f["severity"]) for f in report["findings"]] == summary(found)


@pytest.mark.slow
def test_seq2seq_noam_factor_10x_collapses_to_the_unigram_loss_and_is_named(tmp_path: Path) -> None:
    """Peak Adam lr 0.14: the loss falls to 2.6 (the unigram level; healthy runs reach 1.5) and stays; the
    median layer's gradient falls ~2,000x while only the output end still learns. Nothing was said of it. Its
    attention layers' logits grow first (``attention_logits``, 60 steps or more before the collapse)."""
    result = train(seq2seq, tmp_path / "run", steps=200, lr_scale=10)
    assert min(result.losses[100:]) > 2.4, "the plant: the run stalls at the unigram level"
    found = loud(result)
    # the collapse named (its step a sampled one near where it settles); an explosion while the loss still
    # moves may come and go with the trajectory (CPUs, threads, library versions): nothing else is loud
    (collapse,) = [f for f in found if f["kind"] == "vanishing"]
    assert collapse["step"] in range(80, 160, 10) and collapse["severity"] == "warning", summary(found)
    assert {f["kind"] for f in found} <= {"vanishing", "exploding", "attention_logits"} and all(
        f["severity"] == "warning" for f in found), summary(found)
    # the attention logits' growth, where it is named, comes first: the mechanism, seen while the loss still falls
    assert all(f["step"] < collapse["step"] for f in found if f["kind"] == "attention_logits"), summary(found)
    found = [collapse]
    data = found[0]["data"]
    assert data["evidence"] == "collapse" and data["early_rms"] / data["median_rms"] > 1000
    assert data["learning"] == ["transformer.decoder.norm", "generator"]
    assert found[0]["message"].startswith("the gradients of the whole model collapsed: the median layer's RMS is ")
    assert check(tmp_path / "run", "--fail-on", "warning")[0] == 1


def test_seq2seq_batch_of_blank_targets_is_a_nan_loss_born_in_the_loss_function(tmp_path: Path) -> None:
    """Every target of step 30's batch is padding: CrossEntropyLoss(ignore_index=PAD) averages over no token (0/0)."""
    aside = unwatched_aside(seq2seq, steps=34, blank_targets_at=30)
    result = train(seq2seq, tmp_path / "run", steps=34, blank_targets_at=30)
    assert math.isnan(result.losses[30]) and all(math.isfinite(x) for x in result.losses[:30] + result.losses[31:])
    found = loud(result)
    assert summary(found) == [("nonfinite", 30, None, "error")]
    assert found[0]["action"] == "skip"
    assert "the loss is NaN/Inf (born in the loss function) at step 30" in found[0]["message"]
    plain = pool.result(aside)
    assert plain.losses[:30] == result.losses[:30] and math.isnan(plain.losses[30])
    assert all(math.isfinite(x) for x in plain.losses[31:]), "the gradient is zero there: only the loss is NaN"
    code, report = check(tmp_path / "run")
    assert code == 1 and [(f["kind"], f["step"], f["layer"]) for f in report["findings"]] == [("nonfinite", 30, None)]


# ------------------------------------------------------------------------------- timm plants
def test_timm_lr_100x_under_warmup_is_named_then_failed_as_a_run_that_never_learned(tmp_path: Path) -> None:
    """Step 0's update is small (warmup, and Adam's eps dominates the gradients behind the 1e-6 layer
    scales); by step 10 the head's weights grew 126x, the whole model 3.8x. The layer scales grew far more
    (3.3e5x from 1e-6), as any weight starting near zero does: the layer named is one of ordinary weights."""
    result = train(timm_convnext, tmp_path / "run", steps=32, lr_scale=100, watch=PAST_THE_HALT)
    found = loud(result)
    assert summary(found) == [("learning_rate", 10, "head", "warning"),
                              ("learning_rate", 30, "head", "error")]
    read = figures(found[0]["message"], "its weights grew {n}x in 10 steps up to step 10 (the whole model's {n}x",
                   anywhere=True)
    assert read and read[0] > 10 and 1 < read[1] < read[0], found[0]["message"]  # the head grew far faster
    assert found[1]["data"]["evidence"] == "no_progress"
    assert check(tmp_path / "run")[0] == 1


def test_timm_no_decay_group_left_out_is_named_at_step_0(tmp_path: Path) -> None:
    result = train(timm_convnext, tmp_path / "run", steps=12, no_decay_dropped=True)
    found = loud(result)
    assert summary(found[:1]) == [("unoptimized_parameter", 0, "stem.0", "warning")]
    data = found[0]["data"]
    assert data["reason"] == "not_in_optimizer" and len(data["parameters"]) == 21
    model = result.extra["model"]
    shapes = {name: p.ndim for name, p in model.named_parameters()}
    assert all(shapes[name] == 1 for name in data["parameters"]), "norms, biases and layer scales"
    # the layer scales left at 1e-6 keep their blocks' gradients at 1e-6 of what they would be: small by design
    # while the scales are that small (one info finding per scale says so at step 9), not a second cause
    assert found[1:] == [], summary(found[1:])
    small = [f for f in result.findings() if f["kind"] == "vanishing"]
    assert small and all(f["severity"] == "info" and f["step"] == 9 and f["data"]["gate"] in data["parameters"]
                         for f in small), summary(small)


def test_timm_forgotten_zero_grad_is_a_stale_gradient_at_step_2(tmp_path: Path) -> None:
    result = train(timm_convnext, tmp_path / "run", steps=10, zero_grad_removed=True)
    found = loud(result)
    assert summary(found) == [("stale_gradient", 2, None, "warning")]
    assert "no optimizer.zero_grad()" in found[0]["message"]
    assert check(tmp_path / "run")[0] == 0, "a warning passes the default gate"
    code, report = check(tmp_path / "run", "--fail-on", "warning")
    assert (code, report["verdict"]) == (1, "fail")


def test_timm_kl_loss_with_zero_targets_is_nonfinite_at_step_0_and_halts_after_20_skips(tmp_path: Path) -> None:
    """target * target.log() is 0 * -inf = NaN for every mixed one-hot target once smoothing is off. The
    gradient is finite (target.log() takes none), so the loss alone is NaN: every step is skipped, and the
    default rule halts at the 20th skip in a row."""
    with pytest.raises(gw.TrainingHalted) as halted:
        train(timm_convnext, tmp_path / "run", steps=25, kl_loss=True)
    assert halted.value.step == 20 and "20 steps in a row had to be skipped" in str(halted.value)
    with gw.open_run(tmp_path / "run") as run:
        assert run.status == "halted"
        found = sorted((f for f in run.findings().to_dict("records") if f["severity"] != "info"),
                       key=lambda f: f["step"])
    first = found[0]
    assert (first["kind"], first["step"], first["severity"], first["action"]) == ("nonfinite", 0, "error", "skip")
    # one root cause, one finding: the skipped steps leave the layer scales at 1e-6, small by design (no
    # vanishing warning for gradients never applied)
    assert [(f["kind"], f["step"]) for f in found] == [("nonfinite", 0)]
    assert not isinstance(first["layer"], str)
    assert "born in the loss function" in first["message"]
    code, report = check(tmp_path / "run")
    assert (code, report["verdict"], report["status"]) == (1, "fail", "halted")


# ----------------------------------------------------------------------------- SimCLR plants
def test_simclr_lr_100x_is_named_at_step_0(tmp_path: Path) -> None:
    found = loud(train(simclr, tmp_path / "run", steps=12, lr_scale=100))
    assert summary(found) == [("learning_rate", 0, "encoder.2.0", "warning")]
    assert found[0]["message"].startswith("learning rate too high for encoder.2.0 (Conv2d): update is 46x the weights "
                                          "at step 0")


def test_simclr_projection_head_left_out_of_the_optimizer_is_named_at_step_0(tmp_path: Path) -> None:
    """SGD(model.encoder.parameters(), ...): the head gets gradients and never learns."""
    found = loud(train(simclr, tmp_path / "run", steps=12, head_left_out=True))
    assert summary(found) == [("unoptimized_parameter", 0, "projector.0", "warning")]
    assert found[0]["data"]["parameters"] == ["projector.0.weight", "projector.1.weight", "projector.1.bias",
                                              "projector.3.weight", "projector.3.bias"]


def test_simclr_blank_image_standardised_by_its_zero_std_is_nonfinite_input_with_its_sample(tmp_path: Path) -> None:
    """Sample 5 of step 20 is all black: per-image standardisation without an epsilon makes it 0/0. The
    batch is the origin (no layer), sample 5 is blamed, and the default rule's skip keeps the NaN out
    of the weights and of BatchNorm's running statistics, which the unwatched run does not."""
    result = train(simclr, tmp_path / "run", steps=24, blank_image_at=20)
    found = loud(result)
    assert summary(found) == [("nonfinite", 20, None, "error")]
    assert found[0]["action"] == "skip" and found[0]["phase"] == "forward"
    assert found[0]["message"].startswith("The model's input batch holds NaN/Inf at step 20; cause: data")
    assert "samples to blame: sample 5" in found[0]["message"]
    assert all(math.isfinite(x) for x in result.losses[21:]) and result.extra["running_mean"].isfinite().all()
    plain = train(simclr, None, steps=24, blank_image_at=20)
    assert plain.losses[:20] == result.losses[:20]
    assert all(math.isnan(x) for x in plain.losses[20:]) and not plain.extra["running_mean"].isfinite().any()
    code, report = check(tmp_path / "run")
    assert (code, [(f["kind"], f["step"], f["layer"]) for f in report["findings"]]) == (1, [("nonfinite", 20, None)])


# --------------------------------------------------------------------------- torch.compile
COMPILED = {
    "seq2seq-blank-targets": (seq2seq, {"steps": 34, "blank_targets_at": 30}),
    "timm-lr-100x": (timm_convnext, {"steps": 32, "lr_scale": 100, "watch": PAST_THE_HALT}),
    "timm-stale-gradient": (timm_convnext, {"steps": 10, "zero_grad_removed": True}),
    "simclr-blank-image": (simclr, {"steps": 24, "blank_image_at": 20}),
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(COMPILED))
@pytest.mark.slow  # compiles the model (aot_eager), and trains it eagerly too
def test_compiled_in_either_order_gives_the_eager_losses_and_findings(name: str, order: str, tmp_path: Path) -> None:
    import torch._dynamo

    script, config = COMPILED[name]
    watched_eagerly = aside(script, tmp_path / "eager", **config)  # in the tests' pool meanwhile
    torch._dynamo.reset()
    compiled = train(script, tmp_path / "compiled", compile=order, **config)
    eager = pool.result(watched_eagerly)
    same = [a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(eager.losses, compiled.losses, strict=True)]
    assert all(same)
    assert summary(loud(compiled)) == summary(loud(eager)) != []


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.slow  # compiles the model (aot_eager)
def test_a_compiled_transformer_given_a_tgt_mask_recompiles_no_hook_of_gradwatchs(order: str, tmp_path: Path) -> None:
    """``nn.Transformer`` given a ``tgt_mask`` breaks its graph where dynamo cannot resume (torch's own causal
    mask check), so dynamo runs its forward eagerly and meets the leaves' hooks as frames of their own: once
    each compiled on its own, guarded on gradwatch's state, recompiled on every leaf call until dynamo's
    ``recompile_limit`` warned. gradwatch's hooks now run there as plain Python."""
    import logging

    import torch._dynamo

    logged: list[str] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    handler = Kept(logging.WARNING)
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        torch._dynamo.reset()
        result = train(seq2seq, tmp_path / "run", steps=24, compile=order)
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
    assert not [m for m in logged if "recompile" in m], logged
    assert loud(result) == []
