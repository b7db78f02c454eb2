"""The real-code zoo's generative models through gradwatch with the default rules (issue 26 item 4).

A DCGAN (the PyTorch example's loop: two models, each watched into its own run, each with its own
Adam at 2e-4 and betas (0.5, 0.999)) and a DDPM (a small UNet predicting noise, min-SNR weighting,
an EMA copy of the weights). Healthy: no warning or error, and the losses are bit-identical
watched and unwatched. Planted failures, the way they happen in practice: found at the right
kind, step and layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import gradwatch as gw

from . import pool
from .realcode import PAST_THE_HALT, dcgan, ddpm, unwatched_aside

# real models and training loops, a few seconds each (one thread: small models on a shared machine)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]



def loud(run_dir: Path) -> list[dict[str, Any]]:
    """The run's warnings and errors, in step order."""
    with gw.open_run(run_dir) as run:
        found = run.findings()
    return sorted((row for row in found.to_dict("records") if row["severity"] != "info"), key=lambda f: f["step"])


def summary(found: list[dict[str, Any]]) -> list[tuple[str, int, str | None]]:
    return [(f["kind"], f["step"], f["layer"] if isinstance(f["layer"], str) else None) for f in found]


# ------------------------------------------------------------------------------------ DCGAN
@pytest.mark.parametrize("real_label", [1.0, 0.9])  # 0.9: one-sided label smoothing
def test_healthy_dcgan_is_quiet_and_bit_identical(tmp_path: Path, real_label: float) -> None:
    """Before: 'loss 1.069 at step 10 (median of the last 3) is 1.52x its first values (0.7018): training is
    diverging; the learning rate is likely too high' on the generator, whose loss rises as the
    discriminator learns (0.70 -> 1.1 in 10 steps, 2.7 by step 60)."""
    aside = unwatched_aside(dcgan, real_label=real_label)  # the unwatched run trains in the tests' pool meanwhile
    watched = dcgan.train(dcgan.Config(run=tmp_path / "run", real_label=real_label))
    plain = pool.result(aside)
    assert watched.losses == plain.losses
    assert watched.extra["generator_losses"] == plain.extra["generator_losses"]
    generator = plain.extra["generator_losses"]
    assert sum(plain.losses[-5:]) < 0.5 * sum(plain.losses[:5]), "the discriminator learns"
    assert sum(generator[-5:]) > 2 * sum(generator[:5]), "and the generator's loss rises as it does"
    for model in ("D", "G"):
        assert loud(tmp_path / "run" / model) == [], model


def test_a_discriminator_learning_rate_100x_too_high_is_named_at_step_0(tmp_path: Path) -> None:
    """lr 2e-2 for the discriminator (2e-4 meant): its first update rewrites its weights; the
    generator's loss, which the wrecked discriminator decides, runs away from step 1 on."""
    result = dcgan.train(dcgan.Config(run=tmp_path / "run", lr_d_scale=100, watch=PAST_THE_HALT))
    disc = loud(tmp_path / "run" / "D")
    assert summary(disc)[0] == ("learning_rate", 0, "main.5")
    assert disc[0]["data"]["direction"] == "high"
    assert disc[0]["message"].startswith("learning rate too high for main.5 (Conv2d): update is 1x the weights at "
                                         "step 0")
    generator = loud(tmp_path / "run" / "G")
    assert summary(generator)[0] == ("loss_spike", 4, None) and generator[0]["data"]["divergence"]
    assert max(result.extra["generator_losses"][2:8]) > 5.0


# ------------------------------------------------------------------------------------- DDPM
def test_healthy_ddpm_is_quiet_and_bit_identical(tmp_path: Path) -> None:
    aside = unwatched_aside(ddpm)  # the unwatched run trains in the tests' pool meanwhile
    watched = ddpm.train(ddpm.Config(run=tmp_path / "run"))
    plain = pool.result(aside)
    assert watched.losses == plain.losses
    assert sum(plain.losses[-5:]) < 0.5 * sum(plain.losses[:5]), "the model learns to predict the noise"
    assert loud(tmp_path / "run") == []
    ema = watched.extra["ema"]
    assert not any("gradwatch" in type(m).__module__ for m in ema.modules()), "the EMA copy holds nothing of gradwatch"


def test_min_snr_weighting_on_a_zero_terminal_snr_schedule_is_a_nan_in_the_loss_at_its_first_terminal_step(
        tmp_path: Path) -> None:
    """The schedule rescaled to a zero terminal SNR makes min(snr, gamma) / snr = 0/0 for the samples
    drawn at the last timestep: the loss is NaN at the first step that draws one (step 7, sample 3),
    although the model's output is finite. The default rules skip those steps; training goes on."""
    cfg = ddpm.Config(run=tmp_path / "run", zero_terminal_snr=True)
    result = ddpm.train(cfg)
    assert result.extra["terminal"] == 7
    _, _, timesteps = ddpm.batch(cfg, 7)
    assert timesteps.eq(cfg.timesteps - 1).nonzero().flatten().tolist() == [3]
    found = loud(tmp_path / "run")
    assert summary(found) == [("nonfinite", 7, None)]
    assert found[0]["severity"] == "error" and found[0]["action"] == "skip"
    assert "the loss is NaN/Inf (born in the loss function) at step 7" in found[0]["message"]
    assert "sample 3" in found[0]["message"]
    finite = [x for x in result.losses if x == x]
    assert sum(finite[-5:]) < 0.5 * sum(finite[:5]), "the skipped steps left the rest of training to learn"
