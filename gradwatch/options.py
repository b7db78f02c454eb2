"""Options: the validated settings of one watcher (``gw.watch(..., **options)``)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradwatch.errors import ConfigError
from gradwatch.sinks import sink_settings

#: the smallest number of steps between two measurements of the costlier statistics
DEFAULT_SAMPLE_PERIOD = 10
#: the most steps the flight recorder keeps (each holds a step's per-layer statistics in memory)
MAX_FLIGHT_RECORDER = 100_000
#: the longest name of one file or folder, and the longest path, that file systems take (bytes)
NAME_MAX, PATH_MAX = 255, 4096

#: the longest ``flush_seconds`` accepted: an hour (longer waits overflow the thread timeouts)
MAX_FLUSH_SECONDS = 3600.0


@dataclass(frozen=True)
class Options:
    """Settings of a watcher; docs/configuration.md's "Options" table explains each field.

    Attributes:
        log_every: per-layer series are written on steps that are multiples of it.
        sample_every: the costlier per-layer statistics (activations, max |g|, parameter
            norm, update ratio) are measured on steps that are multiples of it; a multiple of
            ``log_every``. ``None`` picks the smallest multiple of ``log_every`` that is >= 10.
        activations: take activation statistics with forward hooks on sampled steps.
        attention: on sampled steps (eager), measure each attention call's largest logit and entropy
            (``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``, a softmax over attention logits).
        tensorboard: write TensorBoard event files into the run directory.
        overwrite: replace a finished run already stored in the run directory.
        resume: continue the run stored in the run directory (a job restarted from a checkpoint);
            without one there, a new run starts. See docs/watching.md, "Runs that resume".
        start_step: the number of the first step this process trains (a resumed job: its
            checkpoint's step); stored steps from it on are superseded. None: 0 for a new run, the
            step after the last stored one for a resumed run.
        queue_size: records buffered between the training thread and the writer thread.
        flush_seconds: longest time a record waits in the writer before it is committed
            (at most an hour).
        detectors: per-detector settings, ``{kind: {setting: value}}`` (``enabled=False``
            turns one off); see the detector table of docs/findings.md.
        cooldown: steps during which a repeat of the same finding (kind, layer, severity) is
            counted instead of written again.
        flight_recorder: steps of full per-layer statistics kept in memory and written when a
            finding fires, whatever ``log_every`` is.
        origin: replay a step with NaN/Inf to find the module where it was born.
        console: print findings to stderr as they happen.
        snapshot_every: healthy steps between rollback snapshots (taken only when a rule rolls back).
        snapshot_keep: rollback snapshots kept.
        snapshot_dir: keep snapshots on disk in this directory instead of in memory.
        replica_check_every: in a multi-process run, compare the model replicas across ranks every
            this many steps (0: never).
        replica_tolerance: the relative difference of a parameter's norm or sum across ranks
            beyond which replicas count as diverged.
        prometheus: export metrics for Prometheus (needs ``prometheus_client``): None/False
            (off), True (port 9108), a port number, or a mapping with ``port``, ``addr``,
            ``per_layer``, ``max_layers`` and ``registry``; see :func:`prometheus_settings`.
        sinks: installed sink plugins that also receive the run's records (see
            :mod:`gradwatch.plugins`): a list of names, or ``{name: {setting: value}}``.
        wandb_histograms: on sampled steps, each parameter's gradient and value histogram for the
            wandb sink (``gradients/<param>``, ``parameters/<param>``, as ``wandb.watch(log="all")``).
    """

    log_every: int = 1
    sample_every: int | None = None
    activations: bool = True
    attention: bool = True
    tensorboard: bool = True
    overwrite: bool = False
    resume: bool = False
    start_step: int | None = None
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
    replica_check_every: int = 100
    replica_tolerance: float = 1e-5
    prometheus: Any = None
    sinks: Any = None
    wandb_histograms: bool = False

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
        if isinstance(recorder, bool) or not isinstance(recorder, int) or not 0 <= recorder <= MAX_FLIGHT_RECORDER:
            raise ConfigError(f"option flight_recorder must be an integer from 0 to {MAX_FLIGHT_RECORDER} (steps kept "
                              f"in memory), got {self.flight_recorder!r}")
        if self.snapshot_dir is not None:
            directory_path("option snapshot_dir", self.snapshot_dir)
        if self.detectors is not None:
            if not isinstance(self.detectors, Mapping):
                raise ConfigError(
                    f"option detectors must be a mapping {{kind: {{setting: value}}}}, got {self.detectors!r}")
            from gradwatch.detectors import build

            build(self.detectors)
        for name in ("activations", "attention", "tensorboard", "overwrite", "resume", "origin", "console",
                     "wandb_histograms"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"option {name} must be True or False, got {getattr(self, name)!r}")
        if self.resume and self.overwrite:
            raise ConfigError("options resume=True and overwrite=True contradict each other: resume continues the "
                              "stored run, overwrite replaces it; pass one of them")
        start = self.start_step
        if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
            raise ConfigError(f"option start_step must be a step number >= 0 (the checkpoint's step) or None, "
                              f"got {start!r}")
        if (not isinstance(self.flush_seconds, (int, float)) or isinstance(self.flush_seconds, bool)
                or not 0 < self.flush_seconds <= MAX_FLUSH_SECONDS):
            raise ConfigError(f"option flush_seconds must be a finite positive number of seconds, at most "
                              f"{MAX_FLUSH_SECONDS:g}, got {self.flush_seconds!r}")
        prometheus_settings(self.prometheus)
        for name in sink_settings(self.sinks):
            from gradwatch import plugins

            plugins.load("sink", name)
        every = self.replica_check_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ConfigError(f"option replica_check_every must be a non-negative integer (0: never), got {every!r}")
        tol = self.replica_tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < math.inf:
            raise ConfigError(f"option replica_tolerance must be a finite number >= 0, got {tol!r}")

    def to_dict(self) -> dict[str, Any]:
        """The options as plain data, as stored in the run's metadata."""
        data = {f.name: copy.deepcopy(getattr(self, f.name))
                for f in dataclasses.fields(self) if f.name != "prometheus"}
        data["sample_every"] = self.sample_period
        data["snapshot_dir"] = None if self.snapshot_dir is None else str(self.snapshot_dir)
        settings = prometheus_settings(self.prometheus)
        if settings is not None and settings["registry"] is not None:
            settings["registry"] = type(settings["registry"]).__name__  # an object, not data: its kind only
        data["prometheus"] = settings
        # a sink plugin's settings may hold any object (a Path, a client): kept as text where JSON cannot
        data["sinks"] = json.loads(json.dumps(sink_settings(self.sinks), default=str)) if self.sinks else None
        return data


#: the port the Prometheus exporter listens on by default (``prometheus=True``)
PROMETHEUS_PORT = 9108
#: the address it binds by default: this machine only
PROMETHEUS_ADDR = "127.0.0.1"
#: the most layers exported with ``per_layer=True`` unless ``max_layers`` says otherwise
PROMETHEUS_MAX_LAYERS = 64
_PROMETHEUS_KEYS = ("port", "addr", "per_layer", "max_layers", "registry")
PROMETHEUS_INSTALL = "pip install 'gradwatch[prometheus]'"


def prometheus_settings(value: Any) -> dict[str, Any] | None:
    """The ``prometheus`` option resolved to ``{port, addr, per_layer, max_layers, registry}``, or None (off).

    ``True`` serves on :data:`PROMETHEUS_PORT`; an int is the port (0 picks a free one); a mapping
    may set any of the keys. With a ``registry`` (a ``prometheus_client`` registry of your own)
    and no ``port``, the metrics are registered there and no server is started.

    Raises:
        ConfigError: a wrong type or value, an unknown key, or ``prometheus_client`` is not installed.
    """
    if value is None or value is False:
        return None
    if value is True:
        settings: dict[str, Any] = {}
    elif isinstance(value, int) and not isinstance(value, bool):
        settings = {"port": value}
    elif isinstance(value, Mapping):
        settings = dict(value)
        unknown = sorted(str(k) for k in settings if k not in _PROMETHEUS_KEYS)
        if unknown:
            raise ConfigError(f"option prometheus: unknown key {unknown[0]!r}; valid keys are: "
                              + ", ".join(_PROMETHEUS_KEYS))
    else:
        raise ConfigError(
            f"option prometheus must be True, a port number or a mapping such as "
            f"{{'port': {PROMETHEUS_PORT}, 'addr': '{PROMETHEUS_ADDR}', 'per_layer': False}}, got {value!r}"
        )
    registry = settings.get("registry")
    port = settings.get("port", None if registry is not None else PROMETHEUS_PORT)
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise ConfigError(f"option prometheus: port must be an integer from 0 to 65535 (0 picks a free port), "
                          f"got {port!r}")
    addr = settings.get("addr", PROMETHEUS_ADDR)
    if not isinstance(addr, str) or not addr:
        raise ConfigError(f"option prometheus: addr must be a host name or IP address such as "
                          f"'{PROMETHEUS_ADDR}', got {addr!r}")
    per_layer = settings.get("per_layer", False)
    if not isinstance(per_layer, bool):
        raise ConfigError(f"option prometheus: per_layer must be True or False, got {per_layer!r}")
    max_layers = settings.get("max_layers", PROMETHEUS_MAX_LAYERS)
    if isinstance(max_layers, bool) or not isinstance(max_layers, int) or max_layers < 1:
        raise ConfigError(f"option prometheus: max_layers must be a positive integer, got {max_layers!r}")
    if registry is not None and not (callable(getattr(registry, "register", None))
                                     and callable(getattr(registry, "collect", None))):
        raise ConfigError(
            f"option prometheus: registry must be a prometheus_client CollectorRegistry, got {registry!r}")
    if importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError(f"option prometheus needs the prometheus_client package: {PROMETHEUS_INSTALL}")
    return {"port": port, "addr": addr, "per_layer": per_layer, "max_layers": max_layers, "registry": registry}


def run_path(run: Any) -> Path:
    """The ``run=`` argument of ``gw.watch`` as a Path, checked (see :func:`directory_path`).

    Raises:
        ConfigError: not a path, empty, or a path no file system takes.
    """
    return directory_path("run", run)


def directory_path(label: str, value: Any) -> Path:
    """A directory path given by the user, checked before anything is created there.

    Args:
        label: how the message names it (``run``, ``option snapshot_dir``).
        value: a ``str`` or ``os.PathLike``.

    Raises:
        ConfigError: not a path, empty (which would mean the working directory), holding a NUL
            character, or with a name longer than :data:`NAME_MAX` bytes or a whole longer than
            :data:`PATH_MAX` bytes.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{label} must be a directory path (str or os.PathLike), got {value!r}")
    text = os.fsdecode(os.fspath(value))
    if not text:
        raise ConfigError(f"{label} must be a non-empty directory path, got ''; "
                          "pass '.' to mean the working directory")
    if "\x00" in text:
        raise ConfigError(f"{label} must not contain a NUL character, got {text[:60]!r}")
    for name in Path(text).parts:
        if len(os.fsencode(name)) > NAME_MAX:
            raise ConfigError(f"{label}: the name {name[:16] + '...'!r} ({len(os.fsencode(name))} bytes) is longer "
                              f"than {NAME_MAX} bytes, the most a file system takes; choose a shorter path")
    if len(os.fsencode(text)) >= PATH_MAX:
        raise ConfigError(f"{label}: the path {text[:40] + '...'!r} is longer than {PATH_MAX - 1} bytes, "
                          "the most a file system takes; choose a shorter path")
    return Path(text)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"option {name} must be a positive integer, got {value!r}")
