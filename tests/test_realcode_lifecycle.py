"""The real-code zoo on what the step lifecycle must get right (issue 15 items 2, 3, 4, 6 and the
judge's side of 7): GradScaler non-finite steps, hand-written update loops, copies of a watched
model, the global norm before ``clip_grad_norm_``, and actions that did nothing.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch

import gradwatch as gw

from .realcode import PAST_THE_HALT, Result, gpt, lstm_lm, train, vae

# the real-code zoo: real models and training loops, several seconds each (one thread: small models on a shared machine)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]




def loud(result: Result) -> list[tuple[str, int, str | None]]:
    return [(f["kind"], f["step"], f["layer"]) for f in result.findings() if f["severity"] != "info"]


# ------------------------------------------------------- item 2: non-finite under a GradScaler
@pytest.mark.slow  # a GPT under fp16 autocast
def test_a_masked_attention_row_under_fp16_gradscaler_is_nonfinite_with_its_origin(tmp_path: Path) -> None:
    """Before: 'amp_overflow' info at step 20 (a skipped overflow), and check --fail-on warning passed."""
    result = train(gpt, tmp_path / "run", dtype="float16", pad_at=20, max_iters=24)
    found = result.findings()
    assert loud(result) == [("nonfinite", 20, "transformer.h.0.attn")]
    (nan,) = [f for f in found if f["kind"] == "nonfinite"]
    assert nan["phase"] == "forward" and nan["severity"] == "error"
    assert not [f for f in found if f["kind"] == "amp_overflow" and f["step"] == 20]


# ------------------------------------------------------ item 3: loops that update by hand
def test_a_hand_written_sgd_loop_is_measured_and_quiet(tmp_path: Path) -> None:
    """p.data.add_(p.grad, alpha=-lr), no optimizer. Before: 80 'GradScaler-skipped' steps, a false
    amp_overflow warning at step 19, no gradient statistics."""
    plain = train(lstm_lm, None)
    watched = train(lstm_lm, tmp_path / "run")
    assert watched.losses == plain.losses
    assert loud(watched) == []
    assert not [f for f in watched.findings() if f["kind"] == "amp_overflow"]
    with gw.open_run(tmp_path / "run") as run:
        steps, norms = run.series("grad_norm")
        assert run.steps == len(plain.losses)
        assert steps.tolist() == list(range(1, run.steps)), "measured from the loop's second step on"


def test_a_hand_written_loop_with_a_learning_rate_100x_too_high_is_named_from_its_first_update(tmp_path: Path) -> None:
    """lr 2000 instead of 20. Before: measured from step 1 but its update ratio first at step 10
    (the next sampled step), so the divergence was named at step 5 by a loss spike; the first
    measured step of a hand-written loop is now sampled, and its update names the learning rate."""
    result = train(lstm_lm, tmp_path / "run", lr_scale=100, watch=PAST_THE_HALT)
    found = [f for f in result.findings() if f["severity"] != "info"]
    assert (found[0]["kind"], found[0]["step"], found[0]["layer"]) == ("learning_rate", 1, "rnn")
    assert "update is 8.7x the weights at step 1" in found[0]["message"]
    with gw.open_run(tmp_path / "run") as run:
        sampled = run.step_info().sampled.tolist()
        assert sampled[:3] == [False, True, False], "step 0 is not measured (no optimizer seen yet); 1 is sampled"
        assert sampled[10], "and the schedule goes on"


# ------------------------------------------------------ item 4: a watched model can be copied
def test_a_watched_gpt_can_be_deep_copied_averaged_and_saved(tmp_path: Path) -> None:
    """An EMA of the weights (AveragedModel), a best-model deepcopy and torch.save(model) mid-run."""
    cfg = gpt.Config(max_iters=6, dropout=0.0)
    torch.manual_seed(cfg.seed)
    model = gpt.GPT(cfg)
    gw.watch(model, run=tmp_path / "run", console=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    chain = gpt.markov_chain(cfg.vocab_size, cfg.seed)
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    best, saved = None, io.BytesIO()
    for it in range(cfg.max_iters):
        x, y, _ = gpt.get_batch(cfg, it, 0, chain)
        _, loss = model(x, y)
        assert loss is not None
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update_parameters(model)
        if it == 3:
            best = copy.deepcopy(model)
            torch.save(model, saved)
    gw.unwatch(model)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    x, y, _ = gpt.get_batch(cfg, 99, 0, chain)
    assert best is not None
    for copied in (best, loaded, ema.module):
        with pytest.raises(gw.ConfigError):
            gw.watcher(copied)  # a copy is not watched
        _, check = copied(x, y)
        assert check is not None and torch.isfinite(check)
    with gw.open_run(tmp_path / "run") as run:
        assert run.steps == cfg.max_iters and run.findings().empty


# --------------------------------------- item 6: clip_grad_norm_ does not blind exploding
def test_the_norm_before_clip_grad_norm_is_recorded_for_a_plain_loop(tmp_path: Path) -> None:
    """Before: the recorded global norm was the clipped one (1.0 on most steps of the GPT trainer)."""
    result = train(gpt, tmp_path / "run", max_iters=12)
    with gw.open_run(tmp_path / "run") as run:
        steps, before = run.series("grad_norm_preclip")
    returned = dict(enumerate(result.extra["norms"]))  # what clip_grad_norm_ returned: the norm before clipping
    assert len(steps) > 0 and all(before[i] == pytest.approx(returned[int(s)], rel=1e-5) for i, s in enumerate(steps))


def test_a_clip_to_zero_is_named_as_the_clip(tmp_path: Path) -> None:
    """clip_grad_norm_(..., 0.0): named as the clip that zeroed the gradients (it knows the norm before)."""
    found = [f for f in train(gpt, tmp_path / "run", grad_clip=0.0, clip_always=True).findings()
             if f["severity"] != "info"]
    assert [(f["kind"], f["step"]) for f in found] == [("zero_gradient", 2)]
    assert found[0]["message"].startswith("every gradient was non-zero at the end of backward and scaled to zero "
                                          "before the optimizer step, for 3 steps up to step 2: something between "
                                          "backward() and the step zeroes them, such as clip_grad_value_(..., 0) or "
                                          "clip_grad_norm_(..., max_norm=0)")


# ------------------------------------------ item 7, the judge's side: no "clip" that did nothing
def test_an_explosion_at_step_0_that_no_baseline_can_clip_is_not_labelled_clip(tmp_path: Path) -> None:
    """At step 0 the adaptive clip has no history to clip to (max_norm NaN): the finding's action is
    'warn', not 'clip'. (An absolute bound is what can flag step 0: a norm judged against its history
    cannot, and a huge but finite one is no longer an overflow of gradwatch's own arithmetic.)"""
    result = train(vae, tmp_path / "run", steps=1, watch={"detectors": {"exploding": {"limit": 1.0}}})
    (found,) = result.findings()
    assert (found["kind"], found["step"], found["action"]) == ("exploding", 0, "warn")
