"""The compatibility matrix (``tests/matrix``): every cell trains healthy, watched and unwatched, and with a NaN
planted; gradwatch must leave the training as it is, stay quiet, record right numbers and find the NaN."""

from __future__ import annotations

import pytest
import torch

from tests.matrix import (
    Cell,
    autograd,
    check,
    compare,
    dtypes,
    edges,
    findings,
    internal_warnings,
    layouts,
    status,
    styles,
    train,
)

CELLS: list[Cell] = [*dtypes.CELLS, *layouts.CELLS, *autograd.CELLS, *styles.CELLS, *edges.CELLS]


def _params(cells: list[Cell], planted: bool = False) -> list:
    return [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else [])
            for c in cells if not planted or c.plant is not None]


def test_the_matrix_has_no_two_cells_of_one_id() -> None:
    ids = [c.id for c in CELLS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert len(CELLS) >= 40


@pytest.mark.parametrize("cell", _params(CELLS))
def test_a_healthy_cell_trains_as_unwatched_quietly_with_right_numbers(cell: Cell, tmp_path) -> None:
    plain = train(cell, None)
    run = tmp_path / cell.run_name
    watched = train(cell, run)
    assert not internal_warnings(watched), internal_warnings(watched)
    assert status(run) == ("finished", cell.steps)
    loud = [(f["kind"], f["step"], f["layer"], f["message"]) for f in findings(run) if f["severity"] != "info"]
    assert not loud, loud
    code, report = check(run, "--fail-on", "warning")
    assert (code, report["verdict"], report["steps"]) == (0, "pass", cell.steps), report
    assert len(plain.weights) == len(watched.weights)
    changed = [i for i, (a, b) in enumerate(zip(plain.weights, watched.weights)) if not torch.equal(a, b)]
    assert not changed, f"tensors {changed} differ from the unwatched training"
    if cell.reference:
        assert watched.reference, "the reference saw no optimizer step"
        wrong = compare(run, watched.reference, cell.tolerance)
        assert not wrong, wrong[:5]


@pytest.mark.parametrize("cell", _params(CELLS, planted=True))
def test_a_nan_planted_in_a_cell_is_found_at_its_step(cell: Cell, tmp_path) -> None:
    run = tmp_path / cell.run_name
    watched = train(cell, run, plant=cell.plant)
    assert not internal_warnings(watched), internal_warnings(watched)
    assert status(run) == ("finished", cell.steps)
    found = [(f["kind"], f["step"], f["severity"]) for f in findings(run)]
    assert ("nonfinite", cell.plant, "error") in found, found
