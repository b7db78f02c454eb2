"""loss_spike stays quiet on healthy losses (issue 26 item 4), on hand-made and recorded loss series.

A jump must matter on the loss's own scale (not only as a ratio to a median that went to ~0), and
a divergence runs away from noisy first losses (not a small batch's noise, nor a GAN generator's
loss creeping up while its discriminator learns); the real spikes and divergences stay found.
"""

from __future__ import annotations

import math

from gradwatch.detectors.loss_spike import LossSpike
from gradwatch.store.records import Layout, StepRecord

LAYOUT = Layout(version=1, layers=("a",), layer_types=("Linear",), layer_numel=(10,), params=("a.weight",),
                param_numel=(10,), owners=((0, 0),), leaves=(0,), trainable=(True,))

#: the generator's loss of the DCGAN of tests/realcode/dcgan.py (seed 0, batch 64) on its first 40 steps
GENERATOR = [0.7, 0.68, 0.72, 0.74, 0.84, 0.88, 0.93, 0.94, 0.97, 1.0, 1.02, 0.98, 1.01, 1.03, 1.05, 1.07, 1.21, 1.21,
             1.32, 1.28, 1.38, 1.46, 1.5, 1.54, 1.57, 1.57, 1.61, 1.58, 1.57, 1.63, 1.63, 1.71, 1.79, 1.9, 1.9, 1.97,
             2.01, 2.0, 2.03, 2.08]
#: an MLP regression's loss with Adam and batches of 8 (tests/test_healthy_sweep.py), first 40 steps: the first
#: three batches happen to be easy ones, the loss's level is about 30 and each batch's is 10 to 60
REGRESSION = [11.6, 20.1, 17.9, 9.8, 34.0, 17.4, 29.5, 15.8, 14.3, 32.3, 30.6, 13.6, 32.5, 34.8, 23.0, 33.7, 31.4, 33.8,
              51.4, 37.2, 20.9, 32.4, 40.0, 45.4, 30.8, 47.2, 21.1, 46.5, 12.9, 42.9, 35.8, 46.4, 31.5, 63.1, 37.8,
              34.2, 34.4, 28.2, 18.4, 31.6]


def judged(losses: list[float]) -> list[tuple[int, bool, str]]:
    """(step, whether a divergence, message) of every finding on the series."""
    detector = LossSpike()
    found = []
    for step, loss in enumerate(losses):
        record = StepRecord(step=step, time=0.0, layout=LAYOUT, scalars={"loss": loss}, vectors={}, sampled=False)
        found += [(f.step, bool(f.data.get("divergence")), f.message) for f in detector.check(record)]
    return found


def converged(steps: int, floor: float) -> list[float]:
    """A classifier's loss falling from ln 5 to ``floor``, with a few % of batch noise."""
    return [(1.6 - floor) * math.exp(-k / 25) + floor * (1 + 0.05 * math.sin(1.7 * k)) for k in range(steps)]


def test_one_misclassified_sample_in_a_converged_run_is_no_spike() -> None:
    """The issue's run: 'loss 0.01563 at step 268 is 8.97x its recent median 0.001742' (before)."""
    losses = converged(300, 0.00174)
    losses[268] = 0.01563
    assert judged(losses) == []


def test_a_converged_loss_that_jumps_back_a_tenth_of_its_way_is_a_spike() -> None:
    losses = converged(300, 0.00174)
    losses[268] = 0.3  # a corrupted batch: a fifth of the way back to where training started
    assert [(step, diverged) for step, diverged, _ in judged(losses)] == [(268, False)]


def test_a_loss_that_reached_exactly_zero_is_judged_on_its_scale() -> None:
    """A memorised training set's cross-entropy underflows to 0.0: a blip of 1e-4 after it is no spike
    (before: '19.8 std above its recent median 4.3e-07'); a jump back to 0.5 is one."""
    losses = converged(200, 1e-6)
    losses[150:] = [0.0 if k % 3 else 2e-7 for k in range(50)]
    blips = list(losses)
    blips[170], blips[185] = 1e-4, 3e-4
    assert judged(blips) == []
    losses[185] = 0.5
    assert [step for step, _, _ in judged(losses)] == [185]


def test_a_gan_generators_loss_rising_as_its_discriminator_learns_is_no_divergence() -> None:
    """Before: 'loss 1.07 at step 10 (median of the last 3) is 1.52x its first values: training is diverging'."""
    assert judged(GENERATOR) == []


def test_a_small_batch_loss_whose_first_batches_were_easy_is_no_divergence() -> None:
    """Before: 'loss 30.57 at step 11 (median of the last 3) is 2.64x its first values (11.59)'."""
    assert judged(REGRESSION) == []


def test_a_loss_running_away_from_noisy_first_losses_is_a_divergence() -> None:
    """The same noisy start, then the loss doubles every few steps: found once it has run away."""
    losses = REGRESSION[:12] + [30.0 * 1.3**k for k in range(1, 15)]
    found = judged(losses)
    assert [(step, diverged) for step, diverged, _ in found] == [(16, True)]
    assert "training is diverging; the learning rate is likely too high" in found[0][2]


def test_a_generator_loss_that_runs_away_is_a_divergence() -> None:
    """The GAN's start, then its generator's loss doubling within a few steps (a discriminator whose
    learning rate is far too high wins outright): a divergence."""
    losses = GENERATOR[:8] + [0.94 * 1.25**k for k in range(1, 12)]
    assert [(step, diverged) for step, diverged, _ in judged(losses)][:1] == [(10, True)]
