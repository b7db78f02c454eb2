"""Detectors: observe step records and report findings — one file per kind, listed in REGISTRY.

A detector only observes: :meth:`Detector.check` takes a :class:`~gradwatch.records.StepRecord`
(plain numbers) and returns findings. It keeps whatever history it needs itself. Its tunable
settings are its dataclass fields, set from ``detectors={kind: {field: value}}`` or a
``[detectors.<kind>]`` table in a config file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from gradwatch.errors import ConfigError
from gradwatch.findings import Finding
from gradwatch.records import StepRecord


@dataclasses.dataclass
class Detector:
    """Base of every detector.

    Attributes:
        enabled: run this detector.
    """

    kind: ClassVar[str] = ""
    #: True for detectors that judge a step's update, known one step later (update ratios)
    late: ClassVar[bool] = False

    enabled: bool = True

    def check(self, record: StepRecord) -> list[Finding]:
        """Findings about one step (called once per step, in step order)."""
        raise NotImplementedError

    def finding(self, record: StepRecord, severity: str, layer: str | None, message: str, **kw: Any) -> Finding:
        """A finding of this detector's kind for ``record``'s step."""
        return Finding(kind=self.kind, severity=severity, step=record.step, layer=layer, message=message, **kw)


def _registry() -> dict[str, type[Detector]]:
    from gradwatch.detectors import (
        amp_overflow,
        dead_units,
        exploding,
        loss_spike,
        nonfinite,
        saturation,
        unused_parameter,
        update_ratio,
        vanishing,
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
    ]
    return {cls.kind: cls for cls in classes}


REGISTRY: dict[str, type[Detector]] = _registry()


def settings(kind: str) -> dict[str, Any]:
    """The tunable settings of a detector and their defaults."""
    return {f.name: f.default for f in dataclasses.fields(REGISTRY[kind]) if f.init}


def build(config: Mapping[str, Mapping[str, Any]] | None = None, *, where: str = "detectors") -> list[Detector]:
    """One instance of every detector, with the settings of ``config`` applied.

    Raises:
        ConfigError: an unknown detector or setting, or a value of the wrong type.
    """
    config = dict(config or {})
    for kind in config:
        if kind not in REGISTRY:
            raise ConfigError(f"{where}: unknown detector {kind!r}; valid detectors are: {', '.join(REGISTRY)}")
    out = []
    for kind, cls in REGISTRY.items():
        params = config.get(kind)
        params = {} if params is None else params
        if not isinstance(params, Mapping):
            raise ConfigError(f"{where}.{kind} must be a table of settings, got {params!r}")
        out.append(cls(**{name: check_type(f"{where}.{kind}", name, value, settings(kind))
                          for name, value in params.items()}))
    return out


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
