"""Sinks: where step records go (run store, TensorBoard ...), all called from the writer thread.

Third-party sinks come from the ``gradwatch.sinks`` entry-point group (see
:mod:`gradwatch.plugins`) and are named by the ``sinks`` option: a class built as
``Sink(run_dir, **settings)`` with the methods of :class:`Sink` (``write_findings`` and
``write_meta`` optional). A sink that raises is disabled for the rest of the run and logged;
training and the other sinks go on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gradwatch.errors import ConfigError
from gradwatch.store.findings import SEVERITIES, Finding, rank
from gradwatch.store.records import LAYER, StepRecord, present
from gradwatch.store.verdict import UNFINISHED


class Sink(Protocol):
    """What every sink implements. Sinks run in the writer thread, never in the training thread."""

    def write(self, records: Sequence[StepRecord]) -> None:
        """Write a batch of step records, in step order."""

    def close(self, status: str) -> None:
        """Flush and release resources; ``status`` is the run's final status."""


def sink_settings(value: Any) -> dict[str, dict[str, Any]]:
    """The ``sinks`` option as ``{plugin name: settings}`` (empty when there are none).

    Raises:
        ConfigError: not a list of names or a mapping of names to tables of settings.
    """
    if value is None:
        return {}
    if isinstance(value, Mapping):
        out = {}
        for name, settings in value.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"option sinks: a sink name must be a non-empty string, got {name!r}")
            if settings is None:
                settings = {}
            if not isinstance(settings, Mapping) or not all(isinstance(k, str) for k in settings):
                raise ConfigError(f"option sinks: the settings of sink {name!r} must be a table of "
                                  f"setting = value, got {settings!r}")
            out[name] = dict(settings)
        return out
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value):
        if len(set(value)) != len(value):
            raise ConfigError(f"option sinks names a sink twice: {list(value)!r}")
        return {name: {} for name in value}
    raise ConfigError("option sinks must be a list of sink plugin names, or a mapping "
                      f"{{name: {{setting: value}}}}, got {value!r}")


def plugin_sinks(option: Any, run_dir: Path) -> list[Any]:
    """Build the sink plugins the ``sinks`` option names, each with its settings.

    Raises:
        ConfigError: a plugin that fails to load, lacks ``write``/``close`` or fails to build
            (those built before it are closed).
    """
    from gradwatch import plugins

    built: list[Any] = []
    try:
        for name, settings in sink_settings(option).items():
            cls = plugins.load("sink", name)
            if not callable(cls) or not all(callable(getattr(cls, m, None)) for m in ("write", "close")):
                raise ConfigError(f"sink plugin {name!r} must be a class with write(records) and close(status) "
                                  f"methods, got {cls!r}")
            try:
                built.append(cls(run_dir, **settings))
            except Exception as exc:  # the plugin's own __init__, e.g. a setting it does not take
                said = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"  # its own words
                raise ConfigError(f"sink plugin {name!r} failed to start: {said}") from exc
    except BaseException:
        for sink in built:
            sink.close("crashed")
        raise
    return built


def tally(findings: Iterable[Finding], status: str) -> tuple[dict[str, int], str | None, bool]:
    """A run's findings as a remote tracker's verdict: the occurrences by severity (folded repeats
    counted), the worst severity (None: none), and whether it fails (an error, or a run that did not finish).
    """
    counts = dict.fromkeys(SEVERITIES, 0)
    for f in findings:
        counts[f.severity] += int(f.data.get("repeats", 1))
    worst = max((s for s, n in counts.items() if n), key=rank, default=None)
    return counts, worst, counts["error"] > 0 or status in UNFINISHED


def layer_points(rec: StepRecord, metric: str, vec: np.ndarray, keys: np.ndarray, nonfinite: set[str]) -> np.ndarray:
    """The indices of one per-layer metric's values a remote tracker writes for ``rec``: those measured, and
    of ``grad_nonfinite`` the non-zero counts and a 0 where the key's last written count was not 0 (a flat
    zero series per layer is noise: the store keeps it). ``nonfinite``: the keys whose last written count
    was not 0, kept up to date here.
    """
    shown = present(rec, LAYER, metric)
    if metric == "grad_nonfinite":
        back = shown & (vec == 0) & np.isin(keys, list(nonfinite))
        nonfinite.difference_update(keys[back].tolist())
        nonfinite.update(keys[shown & (vec != 0)].tolist())
        shown &= (vec != 0) | back
    return np.flatnonzero(shown)
