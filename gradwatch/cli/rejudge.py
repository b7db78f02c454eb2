"""Re-judge a recorded run: run the detectors offline over its store, with other settings.

``gradwatch check --rules FILE`` uses this to answer "would this run pass with these
thresholds?" without training again. Nothing acts: the rules only say which action *would*
have run, and each finding is labelled with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gradwatch import config as config_mod
from gradwatch import detectors
from gradwatch.errors import ConfigError
from gradwatch.judging.gate import text_or_none
from gradwatch.options import Options
from gradwatch.rootcause import words
from gradwatch.rules import decide
from gradwatch.store.findings import Cooldown, Finding
from gradwatch.store.reader import FINDING_COLUMNS, Run
from gradwatch.store.records import LAYER, PARAM, StepRecord


def read_file(path: str | Path) -> tuple[config_mod.Config, dict[str, dict[str, Any]], int | None]:
    """The rules, detector settings and cooldown (if set) of a rules file, validated.

    Raises:
        ConfigError: the file is missing or invalid, names an unknown detector or setting.
    """
    config = config_mod.load(path)
    table = config.options.get("detectors") or {}
    if not isinstance(table, Mapping):
        raise ConfigError(f"{config.source}: detectors must be a table of detector tables")
    detectors.build(table, where=f"{config.source}: detectors")  # unknown names and bad values fail here
    cooldown = None
    if "cooldown" in config.options:
        cooldown = Options.from_kwargs(cooldown=config.options["cooldown"]).cooldown
    return config, {k: dict(v) for k, v in table.items()}, cooldown


def validate(path: str | Path) -> None:
    """Check a rules file before any run is read (raises ConfigError)."""
    read_file(path)


def settings(run: Run, path: str | Path | None) -> tuple[config_mod.Config, dict[str, Any], int]:
    """The rules, detector settings and cooldown to re-judge ``run`` with.

    The run's own recorded settings are the starting point; a rules file (a gradwatch TOML
    file or a pyproject.toml with ``[tool.gradwatch]``) replaces its rules and overrides detector
    settings one by one (``[detectors.vanishing] patience = 5`` changes only that setting).
    """
    recorded = run.meta.get("options") or {}
    merged: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (recorded.get("detectors") or {}).items()
                                         if isinstance(v, Mapping)}
    cooldown = int(recorded.get("cooldown", Options.cooldown))
    if path is None:
        return config_mod.Config(list(config_mod.DEFAULT_RULES), source="default"), merged, cooldown
    config, table, file_cooldown = read_file(path)
    for kind, values in table.items():
        merged.setdefault(kind, {}).update(values)
    return config, merged, cooldown if file_cooldown is None else file_cooldown


def _origins(run: Run) -> dict[int, dict[str, Any]]:
    """Where recorded non-finite values were born, by step (found by replay during training)."""
    out = {}
    for row in run.findings().itertuples():
        if row.kind != "nonfinite" or not isinstance(row.data, dict):
            continue
        origin = {"phase": text_or_none(row.phase), "layer": text_or_none(row.layer),
                  "type": row.data.get("type"), "how": row.data.get("origin", "recorded")}
        if row.data.get("note"):
            origin["note"] = row.data["note"]
        origin.update(words.data(row.data))  # the op, line, cause, samples and replay cost found then
        out[int(row.step)] = origin
        last = row.data.get("last_step")
        if row.data.get("lasting") and isinstance(last, int):  # a lasting state: its folded steps had it too
            for step in range(int(row.step) + 1, last + 1):
                out.setdefault(step, origin)
    return out


def _prepare(record: StepRecord, origins: Mapping[int, dict[str, Any]]) -> StepRecord:
    """Make a stored record look to the detectors as it did during training.

    - ``skipped`` is stored for steps an action skipped too; the detectors judged those before
      the action, so only steps without gradients (GradScaler overflows) stay skipped.
    - Per-parameter gradient counts exist only on detailed steps; elsewhere each parameter
      takes its layer's count (presence and total preserved), which is what the detectors use.
    - A non-finite step gets the origin that was found by replaying it during training.
    """
    record.skipped = record.skipped and "grad_norm" not in record.scalars
    record.origin = origins.get(record.step)
    layer_counts = record.vector("grad_nonfinite", LAYER)
    if layer_counts is not None and record.vector("grad_nonfinite", PARAM) is None:
        counts = np.full(len(record.layout.params), np.nan, dtype=np.float32)
        counted: set[int] = set()  # layers whose count was given to their first parameter
        for layer, param in record.layout.owners:
            if not np.isnan(counts[param]):
                continue  # a tied parameter keeps its first owner's count
            value = layer_counts[layer]
            counts[param] = 0.0 if layer in counted and not np.isnan(value) else value
            counted.add(layer)
        record.vectors[(PARAM, "grad_nonfinite")] = counts
    return record


def _check(detector: detectors.Detector, record: StepRecord) -> list[Finding]:
    """A detector's findings; a plugin detector that fails is one clear error, not a traceback."""
    if not detectors.plugin(detector):
        return detector.check(record)
    try:
        return detector.check(record)
    except Exception as exc:
        raise ConfigError(f"detector plugin {detector.kind!r} failed at step {record.step}: "
                          f"{type(exc).__name__}: {exc}") from exc


def rejudge(run: Run, rules: str | Path | None = None) -> pd.DataFrame:
    """Findings of ``run`` re-computed by the detectors with another rules file's settings.

    Args:
        run: an open run.
        rules: a rules file (TOML, or pyproject.toml with ``[tool.gradwatch]``); None re-judges
            with the run's own detector settings and the default rules.

    Returns:
        a frame shaped like :meth:`Run.findings`; ``action`` is what the rules would have done,
        and repeats within the cooldown are folded into ``data["repeats"]`` as during training.
    """
    config, detector_settings, cooldown = settings(run, rules)
    where = f"{config.source}: detectors" if rules is not None else "detectors"
    active = [d for d in detectors.build(detector_settings, where=where) if d.enabled]
    now = [d for d in active if not d.late]
    late = [d for d in active if d.late]
    fold = Cooldown(cooldown)
    origins = _origins(run)
    kept: list[Finding] = []
    for record in run.records():
        record = _prepare(record, origins)
        if active:  # every step's loss, as the judge tells it during training
            active[0].causes.loss_of(record)
        for group in (now, late):
            found = [f for d in group for f in _check(d, record)]
            if not found:
                continue
            decide(config.rules or [], found).label(record_only=config.rules is None)
            kept.extend(f for f in found if fold.admit(f))
    rows = [(f.step, f.kind, f.severity, f.layer, f.phase, f.message, f.action, f.data) for f in kept]
    frame = pd.DataFrame(rows, columns=FINDING_COLUMNS)
    frame["step"] = frame["step"].astype("int64")
    return frame
