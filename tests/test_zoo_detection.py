"""The zoo through gradwatch with the default rules: every planted pathology is found at the right
kind, layer and step (and nothing before it); every healthy case stays quiet.

``tests/test_zoo.py`` proves each case's claim with plain PyTorch; this file checks that gradwatch
reaches the same answer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

import gradwatch as gw
from gradwatch import detectors
from gradwatch.cli.rejudge import rejudge
from gradwatch.options import DEFAULT_SAMPLE_PERIOD

from . import pool
from .zoo import CASES, HEALTHY, LR_JUMP, PATHOLOGIES, Case, run

#: planted cases that train for many seconds (marked slow)
SLOW_CASES = {"exploding_lr_jump", "exploding_large_init", "loss_spike_corrupt_batch", "nonfinite_sqrt_backward",
              "vanishing_deep_sigmoid", "nonfinite_div", "nonfinite_poisoned_batch", "nonfinite_log"}

# pathologies that unavoidably bring others along (see the zoo's docstring)
COMPANIONS = {
    "exploding_lr_jump": {"loss_spike", "learning_rate"},
    "update_ratio_high_lr": {"learning_rate"},  # the learning rate is named from step 0 (issue 15)
    "exploding_large_init": {"loss_spike"},
    "loss_spike_corrupt_batch": {"exploding"},
    "dead_relu_bias": {"vanishing"},  # fc1 gets exactly-zero gradients
    "vanishing_deep_sigmoid": {"update_ratio"},  # updates below 1e-8 of the weights
}
# root causes named before the pathology they cause shows (issue 15): (kind, step)
ROOT_CAUSES = {
    "exploding_lr_jump": ("learning_rate", LR_JUMP),  # the 1000x update itself, one step before the explosion
}


def first_report(kind: str, onset: int) -> int:
    """The step at which a pathology present from ``onset`` is due, by the detector's patience."""
    if onset > 0 or kind in ("nonfinite", "exploding", "loss_spike"):
        return onset
    patience = detectors.settings(kind)["patience"]
    if kind in ("dead_units", "saturation", "update_ratio"):  # judged on sampled steps only
        return (patience - 1) * DEFAULT_SAMPLE_PERIOD
    return patience - 1


def replay_matches(path: Path) -> None:
    """Re-judging the stored run offline (``gradwatch check --rules``) finds what training found."""
    with gw.open_run(path) as stored:
        live = stored.findings()
        again = rejudge(stored)
    key = ["step", "kind", "severity", "layer", "phase", "action"]
    assert again[key].fillna("-").values.tolist() == live[key].fillna("-").values.tolist()


def train(case: Case, path: Path) -> tuple[list[dict[str, Any]], list[float], set[str]]:
    """Train a case watched with the default rules; its findings, losses and layer names."""
    model, optimizer, scheduler = case.build()
    watched = gw.watch(model, run=path, console=False)
    watcher = gw.watcher(watched)
    _, _, losses = run(case, model=model, optimizer=optimizer, scheduler=scheduler,
                       observe=lambda loss: watcher.observe(loss=loss))
    gw.unwatch(watched)
    found = gw.open_run(path).findings()
    records = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
               for row in found.to_dict("records")]
    return records, losses, {name for name, _ in model.named_modules()}


def train_case(name: str, path: Path) -> tuple[list[dict[str, Any]], list[float], set[str]]:
    """``train`` of the zoo's case ``name`` (named: a case's build function does not pickle)."""
    return train(CASES[name], path)


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, tuple[Future[Any], Path]]]:
    """The slow cases this session tests, each given to the tests' pool as the module starts
    (``tests/pool.py``: two processes beside this one): what ``train`` returns, to come, and its run."""
    root = tmp_path_factory.mktemp("zoo")
    futures = {c.name: (pool.submit(train_case, c.name, root / c.name / "run"), root / c.name / "run")
               for c in pool.chosen(request, "case", slow=True)}
    yield futures
    for future, _ in futures.values():
        future.cancel()  # a session stopped early (-x) trains no case it no longer tests


def trained_case(case: Case, tmp_path: Path, trained: dict[str, tuple[Future[Any], Path]]
                 ) -> tuple[list[dict[str, Any]], list[float], set[str], Path]:
    """``train(case)`` and the run's path: from the pool for a slow case, trained here for a quick one."""
    if case.name in trained:
        future, path = trained[case.name]
        return (*pool.result(future), path)
    return (*train(case, tmp_path / "run"), tmp_path / "run")


@pytest.mark.slow  # the healthy zoo, hundreds of steps per model
@pytest.mark.parametrize("case", HEALTHY, ids=[c.name for c in HEALTHY])
def test_healthy_zoo_is_quiet(case: Case, tmp_path: Path, trained: dict[str, tuple[Future[Any], Path]]) -> None:
    found, losses, _, path = trained_case(case, tmp_path, trained)
    replay_matches(path)
    loud = [f for f in found if f["severity"] in ("warning", "error")]
    assert loud == [], f"{case.name}: {[(f['step'], f['kind'], f['layer'], f['message']) for f in loud]}"
    assert all(math.isfinite(x) for x in losses)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.name in SLOW_CASES else c
                                  for c in PATHOLOGIES], ids=[c.name for c in PATHOLOGIES])
def test_planted_pathology_is_found_at_its_layer_and_step(case: Case, tmp_path: Path,
                                                          trained: dict[str, tuple[Future[Any], Path]]) -> None:
    assert case.kind is not None and case.onset is not None
    found, losses, layers, path = trained_case(case, tmp_path, trained)
    replay_matches(path)
    kinds = {f["kind"] for f in found}
    assert kinds <= {case.kind} | COMPANIONS.get(case.name, set()), f"unexpected findings: {found}"
    mine = sorted((f for f in found if f["kind"] == case.kind), key=lambda f: f["step"])
    assert mine, f"{case.name}: no {case.kind} finding in {found}"
    first = mine[0]
    seen: dict[tuple, int] = {}
    for f in sorted(found, key=lambda f: f["step"]):
        key = (f["kind"], f["layer"], f["severity"])
        assert key not in seen or f["step"] - seen[key] >= 100, f"a repeat within the cooldown got a row: {f}"
        seen[key] = f["step"]
        assert f["action"] is not None, f"every finding says which action it led to: {f}"
    due = first_report(case.kind, case.onset)
    assert first["step"] == due, f"{case.name}: first {case.kind} at step {first['step']}, expected {due}"
    cause = ROOT_CAUSES.get(case.name)
    early = [f for f in found if f["step"] < min(case.onset, due)]
    assert [(f["kind"], f["step"]) for f in early] == ([cause] if cause else []), "nothing before the onset"
    assert first["severity"] in ("warning", "error")
    if case.kind == "exploding":
        # a global explosion still names the layer whose gradient jumped the most
        assert first["layer"] in layers and first["layer"] != ""
        assert first["action"] == "clip"
    elif case.kind == "loss_spike":
        assert first["layer"] is None
    else:
        assert first["layer"] == case.layer, first
    if case.kind == "nonfinite":
        assert first["phase"] == case.phase and first["action"] == "skip"
        assert first["data"]["origin"] == "replayed"
        assert len(mine) == 1, "after the skip the run stays finite"
        assert all(math.isfinite(x) for x in losses[case.onset + 1:]), "the default rule kept training healthy"
        if case.phase == "forward":
            assert not math.isfinite(losses[case.onset])
