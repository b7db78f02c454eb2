"""Smoke test: a few training steps under gradwatch.

The gradwatch pytest plugin (installed with gradwatch) watches the model these tests train and
fails a test whose gradients go wrong: a NaN/Inf, an exploding gradient, or — with
``fail_on="warning"`` — vanishing gradients, dead or saturated units and the like. The failure
lists each finding with its step and layer and the run directory to look at.
"""

from __future__ import annotations

import pytest
from smoke_train import train


@pytest.mark.gradwatch  # the marker alone is enough: the model train() creates is watched automatically
def test_smoke_training_learns() -> None:
    losses = train(steps=50)
    assert losses[-1] < losses[0] / 4


@pytest.mark.gradwatch(fail_on="warning", sample_every=1)  # stricter: warnings fail too; every statistic every step
def test_smoke_training_has_healthy_gradients(gradwatch) -> None:
    train(steps=50)
    assert len(gradwatch.runs) == 1  # one model was trained, and watched
