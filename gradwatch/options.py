"""Options: the validated settings of one watcher (``gw.watch(..., **options)``)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gradwatch.errors import ConfigError

#: the smallest number of steps between two measurements of the costlier statistics
DEFAULT_SAMPLE_PERIOD = 10


@dataclass(frozen=True)
class Options:
    """Settings of a watcher; see the README's "Options" table for each field.

    Attributes:
        log_every: per-layer series are written on steps that are multiples of it.
        sample_every: the costlier per-layer statistics (activations, max |g|, parameter
            norm, update ratio) are measured on steps that are multiples of it; a multiple of
            ``log_every``. ``None`` picks the smallest multiple of ``log_every`` that is >= 10.
        activations: take activation statistics with forward hooks on sampled steps.
        tensorboard: write TensorBoard event files into the run directory.
        overwrite: replace a finished run already stored in the run directory.
        queue_size: records buffered between the training thread and the writer thread.
        flush_seconds: longest time a record waits in the writer before it is committed.
        detectors: per-detector settings, ``{kind: {setting: value}}`` (``enabled=False``
            turns one off); see the README's detector table.
        cooldown: steps during which a repeat of the same finding (kind, layer, severity) is
            counted instead of written again.
        flight_recorder: steps of full per-layer statistics kept in memory and written when a
            finding fires, whatever ``log_every`` is.
        origin: replay a step with NaN/Inf to find the module where it was born.
        console: print findings to stderr as they happen.
        snapshot_every: healthy steps between rollback snapshots (taken only when a rule rolls back).
        snapshot_keep: rollback snapshots kept.
        snapshot_dir: keep snapshots on disk in this directory instead of in memory.
    """

    log_every: int = 1
    sample_every: int | None = None
    activations: bool = True
    tensorboard: bool = True
    overwrite: bool = False
    queue_size: int = 1024
    flush_seconds: float = 1.0
    detectors: Mapping[str, Mapping[str, Any]] | None = None
    cooldown: int = 100
    flight_recorder: int = 32
    origin: bool = True
    console: bool = True
    snapshot_every: int = 100
    snapshot_keep: int = 2
    snapshot_dir: str | None = None

    @property
    def sample_period(self) -> int:
        """The resolved ``sample_every``."""
        if self.sample_every is not None:
            return self.sample_every
        return self.log_every * max(1, math.ceil(DEFAULT_SAMPLE_PERIOD / self.log_every))

    @classmethod
    def from_kwargs(cls, /, log_every: Any = 1, **kwargs: Any) -> Options:
        """Validate user keyword arguments into Options, with one clear error per problem."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(
                f"unknown option {unknown[0]!r} for gw.watch; valid options are: "
                + ", ".join(sorted(names | {"run", "rules"}))
            )
        opts = cls(log_every=log_every, **kwargs)
        opts.validate()
        return opts

    def validate(self) -> None:
        """Raise ConfigError when a field has the wrong type or value."""
        _positive_int("log_every", self.log_every)
        if self.sample_every is not None:
            _positive_int("sample_every", self.sample_every)
            if self.sample_every % self.log_every:
                raise ConfigError(
                    f"sample_every={self.sample_every} must be a multiple of "
                    f"log_every={self.log_every} so that sampled steps are written"
                )
        for name in ("queue_size", "cooldown", "snapshot_every", "snapshot_keep"):
            _positive_int(name, getattr(self, name))
        recorder = self.flight_recorder
        if isinstance(recorder, bool) or not isinstance(recorder, int) or recorder < 0:
            raise ConfigError(f"option flight_recorder must be a non-negative integer, got {self.flight_recorder!r}")
        if self.snapshot_dir is not None and not isinstance(self.snapshot_dir, (str, os.PathLike)):
            raise ConfigError(f"option snapshot_dir must be a directory path, got {self.snapshot_dir!r}")
        if self.detectors is not None:
            if not isinstance(self.detectors, Mapping):
                raise ConfigError(
                    f"option detectors must be a mapping {{kind: {{setting: value}}}}, got {self.detectors!r}")
            from gradwatch.detectors import build

            build(self.detectors)
        for name in ("activations", "tensorboard", "overwrite", "origin", "console"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"option {name} must be True or False, got {getattr(self, name)!r}")
        if (not isinstance(self.flush_seconds, (int, float)) or isinstance(self.flush_seconds, bool)
                or not 0 < self.flush_seconds < math.inf):
            raise ConfigError(f"option flush_seconds must be a finite positive number, got {self.flush_seconds!r}")

    def to_dict(self) -> dict[str, Any]:
        """The options as plain data, as stored in the run's metadata."""
        data = dataclasses.asdict(self)
        data["sample_every"] = self.sample_period
        data["snapshot_dir"] = None if self.snapshot_dir is None else str(self.snapshot_dir)
        return data


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"option {name} must be a positive integer, got {value!r}")
