"""Detectors: observe step records and report findings — one file per kind, listed in REGISTRY.

A detector only observes: :meth:`Detector.check` takes a :class:`~gradwatch.store.records.StepRecord`
(plain numbers) and returns findings. It keeps whatever history it needs itself. Its tunable
settings are its dataclass fields, set from ``detectors={kind: {field: value}}`` or a
``[detectors.<kind>]`` table in a config file.

Third-party detectors come from the ``gradwatch.detectors`` entry-point group (see
:mod:`gradwatch.plugins`): a :class:`Detector` dataclass whose ``kind`` is its entry point's name,
run when the settings name it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from gradwatch import plugins
from gradwatch.detectors.base import Bound, Detector
from gradwatch.detectors.causes import Causes
from gradwatch.errors import ConfigError

__all__ = ["REGISTRY", "Bound", "Detector", "build", "check_bounds", "check_type", "lookup", "plugin", "settings"]


def _registry() -> dict[str, type[Detector]]:
    from gradwatch.detectors import (
        adam_epsilon,
        amp_overflow,
        attention_logits,
        dead_units,
        exploding,
        learning_rate,
        loss_spike,
        nonfinite,
        output_growth,
        saturation,
        stale_gradient,
        unoptimized_parameter,
        unused_parameter,
        update_ratio,
        vanishing,
        zero_gradient,
    )

    classes: list[type[Detector]] = [
        nonfinite.NonFinite,
        vanishing.Vanishing,
        exploding.Exploding,
        loss_spike.LossSpike,
        dead_units.DeadUnits,
        saturation.Saturation,
        update_ratio.UpdateRatio,
        unused_parameter.UnusedParameter,
        amp_overflow.AmpOverflow,
        learning_rate.LearningRate,
        zero_gradient.ZeroGradient,
        unoptimized_parameter.UnoptimizedParameter,
        stale_gradient.StaleGradient,
        output_growth.OutputGrowth,
        attention_logits.AttentionLogits,
        adam_epsilon.AdamEpsilon,
    ]
    return {cls.kind: cls for cls in classes}


REGISTRY: dict[str, type[Detector]] = _registry()


def lookup(kind: str, where: str = "detectors") -> type[Detector]:
    """The detector class of a kind: a built-in one, or an installed plugin (loaded now).

    Raises:
        ConfigError: no such detector, or a plugin that fails to load or is not a Detector
            dataclass of that kind.
    """
    if isinstance(kind, str) and kind in REGISTRY:
        return REGISTRY[kind]
    if not isinstance(kind, str) or not plugins.exists("detector", kind):
        valid = [*REGISTRY, *plugins.names("detector")]
        raise ConfigError(f"{where}: unknown detector {kind!r}; valid detectors are: {', '.join(valid)}")
    cls: type[Detector] = plugins.load("detector", kind, Detector)
    if cls.kind != kind or not dataclasses.is_dataclass(cls):
        raise ConfigError(f"{where}: detector plugin {kind!r} must be a @dataclass subclass of "
                          f"gradwatch.detectors.Detector with kind = {kind!r}, got {cls.__qualname__} "
                          f"with kind {cls.kind!r}")
    return cls


def plugin(detector: Detector) -> bool:
    """Whether a detector comes from a plugin rather than being one of gradwatch's own."""
    return REGISTRY.get(detector.kind) is not type(detector)


def settings(kind: str) -> dict[str, Any]:
    """The tunable settings of a detector and their defaults."""
    return {f.name: f.default for f in dataclasses.fields(lookup(kind)) if f.init}


def build(config: Mapping[str, Mapping[str, Any]] | None = None, *, where: str = "detectors") -> list[Detector]:
    """One instance of every built-in detector, and of every plugin detector ``config`` names,
    with the settings of ``config`` applied.

    Raises:
        ConfigError: an unknown detector or setting, a value of the wrong type, or a plugin that
            fails to load or to build.
    """
    config = dict(config or {})
    classes = {**REGISTRY, **{kind: lookup(kind, where) for kind in config}}
    out = []
    for kind, cls in classes.items():
        params = config.get(kind)
        params = {} if params is None else params
        if not isinstance(params, Mapping):
            raise ConfigError(f"{where}.{kind} must be a table of settings, got {params!r}")
        defaults = settings(kind)
        values = {name: check_type(f"{where}.{kind}", name, value, defaults) for name, value in params.items()}
        check_bounds(f"{where}.{kind}", cls, {**defaults, **values}, set(values))
        try:
            out.append(cls(**values))
        except Exception as exc:  # a plugin's own __init__ / __post_init__ (built-ins check their bounds first)
            what = (f"detector plugin {kind!r} failed to build" if REGISTRY.get(kind) is not cls
                    else f"detector {kind!r} cannot be built with these settings")
            raise ConfigError(f"{where}.{kind}: {what}: {type(exc).__name__}: {exc}") from exc
    shared = Causes()  # one cause, one finding: the detectors built together share what they named
    for detector in out:
        detector.causes = shared
    return out


def check_bounds(where: str, cls: type[Detector], values: Mapping[str, Any], given: Iterable[str] = ()) -> None:
    """Raise ConfigError for the first setting outside the range its detector declares (``bounds``).

    ``values`` are every setting (defaults included); ``given`` names those the user set, so that a
    range broken by a related setting the user changed names that one.
    """
    given = set(given)
    for name, bound in cls.bounds.items():
        value = values.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        problem = bound.problem(value, values)
        if problem is None:
            continue
        moved = [r for r in bound.related if r in given]
        if name not in given and moved:
            raise ConfigError(f"{where}: setting {moved[0]!r} = {values[moved[0]]!r} leaves {name!r} = {value!r} "
                              f"out of range: {name!r} must be {problem}; set both")
        raise ConfigError(f"{where}: setting {name!r} must be {problem}, got {value!r}")


def check_type(where: str, name: str, value: Any, defaults: Mapping[str, Any]) -> Any:
    """Validate one setting against the type of its default; ints are accepted for floats."""
    if name not in defaults:
        raise ConfigError(f"{where}: unknown setting {name!r}; valid settings are: {', '.join(defaults)}")
    default = defaults[name]
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value >= 0
        if ok:
            try:
                value = float(value)
            except OverflowError:  # an integer too large for a float
                ok = False
    else:
        ok = True
    if not ok:
        kind = type(default).__name__
        raise ConfigError(f"{where}: setting {name!r} must be a non-negative {kind}, got {value!r}")
    return value
