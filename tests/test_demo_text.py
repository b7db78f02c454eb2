"""``gradwatch demo`` says first that its bad batches are planted on purpose, and after the findings which
of them the planted batches explain (the text alone; tests/test_cli.py runs the whole demo)."""

from __future__ import annotations

import pandas as pd
import pytest

from gradwatch.cli.demo import intro, outro
from gradwatch.store.summary import Summary


@pytest.mark.parametrize(("steps", "lines"), [
    (300, ["Two batches are bad on purpose, to show what gradwatch finds and how its rules rescue training:",
           "  step 100: one point sits exactly at the origin", "  step 180: the points are 1000x too large"]),
    (150, ["One batch is bad on purpose, to show what gradwatch finds:", "  step 100: "]),
    (40, ["(The batches made bad on purpose come at steps 100 and 180: run with more --steps"]),
])
def test_intro_says_which_batches_are_planted(steps: int, lines: list[str]) -> None:
    text = intro(steps, 100, 180).splitlines()
    assert text[0].startswith(f"gradwatch demo: a small Tanh MLP learns three interleaved spirals for {steps} steps")
    assert len(text) == 1 + len(lines)
    for got, expected in zip(text[1:], lines):
        assert got.startswith(expected), (got, expected)
    if steps == 150:
        assert "180" not in "\n".join(text)


def _summary(first: float, last: float) -> Summary:
    fields = {name: 0 for name in Summary.__dataclass_fields__}
    return Summary(**{**fields, "loss_first": first, "loss_last": last})  # type: ignore[arg-type]


def test_outro_names_the_planted_steps_found() -> None:
    found = pd.DataFrame({"step": [100, 180, 180], "kind": ["nonfinite", "exploding", "loss_spike"]})
    assert outro(found, _summary(1.11, 0.00054), 100, 180) == (
        "The findings at steps 100 and 180 come from the batches made bad on purpose; the rules acted inside those "
        "steps and training went on (loss 1.11 -> 0.00054).")
    assert outro(found[found["step"] == 100], _summary(1.0, 0.5), 100, 180).startswith("The findings at step 100 come")
    assert outro(pd.DataFrame({"step": [], "kind": []}), _summary(1.0, 0.5), 100, 180) == ""
