"""Prometheus exporter: a run's global numbers, findings and actions as Prometheus metrics.

Turn it on with ``gw.watch(model, prometheus=9108)`` (or ``True``, or a mapping, or
``prometheus = 9108`` in the config file): the run's metrics are then served at
``http://127.0.0.1:9108/metrics`` by ``prometheus_client``'s own HTTP server, from a dedicated
``CollectorRegistry`` (not the process-wide default one). Every watched model of the process that
asks for the same address and port shares one server; each run is told apart by its ``run`` label.

Metrics (labels ``run`` = the run directory's name and ``model`` = the model's class name, plus):

===================================  =======  ==========================================================
``gradwatch_grad_norm``              gauge    global gradient L2 norm of the last recorded step
``gradwatch_loss``                   gauge    last observed loss
``gradwatch_learning_rate``          gauge    last learning rate (``lr``)
``gradwatch_step``                   gauge    0-based index of the last recorded step
``gradwatch_steps_total``            counter  steps recorded
``gradwatch_skipped_steps_total``    counter  steps that changed nothing (GradScaler overflow, ``skip``)
``gradwatch_findings_total``         counter  findings by ``kind`` and ``severity``, folded repeats included
``gradwatch_actions_total``          counter  findings by the ``action`` taken for them (``warn`` included)
``gradwatch_layer_grad_norm``        gauge    per ``layer``; only with ``per_layer=True``, ``max_layers`` at most
===================================  =======  ==========================================================

Cardinality is low by design: a run has 4 gauges, 2 step counters, one finding series per
(kind, severity) and one action series per action (all created at 0 when the run starts, so that
``increase()`` sees the first finding), and no per-layer series unless asked. With
``per_layer=True`` at most ``max_layers`` (default 64) layers are exported: every layer named by
a finding (the most recently flagged first), then the layers with the largest gradient norm,
re-ranked every :data:`RERANK_STEPS` steps; a layer that leaves the set has its series removed.
A finished run's series keep their final values for :data:`FINISHED_SECONDS` (5 minutes, so
that Prometheus scrapes them) and are removed when a run starts on the same exporter after that.

Everything here runs on gradwatch's writer thread: a batch of records sets each gauge once (to
the batch's last value) and adds the batch's counts, so the training thread never pays for it.

Used directly (without ``gw.watch``), :func:`serve` or :func:`for_registry` gives an
:class:`Exporter` and :meth:`Exporter.sink` a sink that takes step records and findings, e.g. of
a stored run::

    from gradwatch.integrations import prometheus
    exporter = prometheus.for_registry(prometheus_client.REGISTRY)   # next to your own metrics
    prometheus.export_run("runs/exp1", exporter)                    # a recorded run's final values
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradwatch.errors import ConfigError
from gradwatch.options import PROMETHEUS_ADDR, PROMETHEUS_INSTALL, PROMETHEUS_MAX_LAYERS, prometheus_settings
from gradwatch.rules import PRECEDENCE
from gradwatch.store.findings import KINDS, SEVERITIES, Finding
from gradwatch.store.records import LAYER, StepRecord, present

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
except ImportError:  # pragma: no cover - exercised by a test that hides the package
    raise ImportError(
        f"gradwatch.integrations.prometheus needs the prometheus_client package: {PROMETHEUS_INSTALL}"
    ) from None

log = logging.getLogger("gradwatch")

#: steps between two re-rankings of the layers exported with ``per_layer=True``
RERANK_STEPS = 100
#: seconds a finished run's series stay exported (so that Prometheus scrapes its final values);
#: they are removed when a run starts on the same exporter after that
FINISHED_SECONDS = 300.0
#: label values of each run's series, before the metric's own labels
RUN_LABELS = ("run", "model")

_lock = threading.RLock()  # held while an exporter is made, so that two threads never bind one port twice
#: exporters serving a dedicated registry, by (addr, requested port); port 0 ones are not shared
_served: dict[tuple[str, int], Exporter] = {}
#: exporters registering into a registry the caller gave, by the registry's id
_by_registry: dict[int, Exporter] = {}
_all: list[Exporter] = []


class Exporter:
    """The gradwatch metrics in one ``prometheus_client`` registry, optionally served over HTTP.

    Get one with :func:`serve` (a dedicated registry on a port) or :func:`for_registry` (a
    registry you already expose); several runs share an exporter, one ``run`` label each.

    Attributes:
        registry: the registry holding the metrics.
        port: the port actually bound (the free one picked for port 0), or None without a server.
        addr: the address the server is bound to, or None without a server.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, port: int | None = None,
                 addr: str = PROMETHEUS_ADDR) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.port: int | None = None
        self.addr: str | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._live: dict[str, PrometheusSink] = {}
        self._closed: dict[str, PrometheusSink] = {}
        self._lock = threading.Lock()
        run = RUN_LABELS
        try:
            self.grad_norm = Gauge("gradwatch_grad_norm", "Global gradient L2 norm of the last recorded step",
                                   run, registry=self.registry)
            self.loss = Gauge("gradwatch_loss", "Last observed loss", run, registry=self.registry)
            self.learning_rate = Gauge("gradwatch_learning_rate", "Last learning rate (lr)", run,
                                       registry=self.registry)
            self.step = Gauge("gradwatch_step", "0-based index of the last recorded optimizer step", run,
                              registry=self.registry)
            self.steps = Counter("gradwatch_steps_total", "Optimizer steps recorded", run, registry=self.registry)
            self.skipped = Counter("gradwatch_skipped_steps_total",
                                   "Steps that changed nothing (GradScaler overflow, or a skip action)", run,
                                   registry=self.registry)
            self.findings = Counter("gradwatch_findings_total", "Findings, folded repeats included",
                                    (*run, "kind", "severity"), registry=self.registry)
            self.actions = Counter("gradwatch_actions_total", "Findings by the action taken for them",
                                   (*run, "action"), registry=self.registry)
            self.layer_grad_norm = Gauge(
                "gradwatch_layer_grad_norm",
                "Gradient L2 norm of a layer at the last recorded step (per_layer=True; flagged and largest layers)",
                (*run, "layer"), registry=self.registry)
        except ValueError as exc:  # "Duplicated timeseries in CollectorRegistry"
            self._unregister()
            raise ConfigError(
                f"this prometheus_client registry already holds gradwatch metrics ({exc}); "
                "share one exporter per registry: gradwatch.integrations.prometheus.for_registry(registry)"
            ) from None
        if port is not None:
            try:
                self._serve(port, addr)
            except BaseException:
                self._unregister()
                raise
        with _lock:
            _all.append(self)

    @property
    def _metrics(self) -> list[Any]:
        names = ("grad_norm", "loss", "learning_rate", "step", "steps", "skipped", "findings", "actions",
                 "layer_grad_norm")
        return [getattr(self, n) for n in names if hasattr(self, n)]

    def _unregister(self) -> None:
        for metric in self._metrics:
            try:
                self.registry.unregister(metric)
            except KeyError:
                pass

    def _serve(self, port: int, addr: str) -> None:
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except socket.gaierror as exc:
            raise ConfigError(f"option prometheus: cannot listen on address {addr!r} ({exc.strerror or exc}); "
                              f"use an IP address or host name of this machine, such as '{PROMETHEUS_ADDR}'") from None
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"option prometheus: port {port} on {addr} is already in use (another exporter or "
                    f"program listens there); pass another port, e.g. prometheus={{'port': {port + 1}}}, "
                    "or 0 to pick a free one") from None
            if exc.errno == errno.EACCES:
                raise ConfigError(f"option prometheus: not allowed to listen on port {port} of {addr} "
                                  "(ports below 1024 need privileges); use a port such as 9108") from None
            raise ConfigError(f"option prometheus: cannot listen on {addr} port {port}: "
                              f"{exc.strerror or exc}") from None
        self.addr, self.port = self._server.server_address[:2]

    @property
    def url(self) -> str | None:
        """The metrics page, ``http://ADDR:PORT/metrics``, or None without a server."""
        if self.port is None or self.addr is None:
            return None
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    @property
    def runs(self) -> list[str]:
        """The ``run`` label values exported, the runs still being written first."""
        with self._lock:
            return [*self._live, *self._closed]

    def sink(self, run: str, *, model: str | None = None, per_layer: bool = False,
             max_layers: int = PROMETHEUS_MAX_LAYERS) -> PrometheusSink:
        """A sink exporting one run under the label ``run`` (a free variant if a live run has it).

        A finished run of the same label on this exporter has its series replaced, and so have
        runs finished more than :data:`FINISHED_SECONDS` ago.
        """
        with self._lock:
            label, n = run, 1
            while label in self._live:
                n += 1
                label = f"{run}-{n}"
            if label != run:
                log.warning("gradwatch: the Prometheus label run=%r is in use by another run of this process; "
                            "exporting this one as run=%r", run, label)
            now = time.monotonic()
            for name, old in list(self._closed.items()):
                if name == label or now - old.finished_at > FINISHED_SECONDS:
                    del self._closed[name]
                    old.remove_series()
            sink = PrometheusSink(self, label, model=model, per_layer=per_layer, max_layers=max_layers)
            self._live[label] = sink
            return sink

    def _finished(self, sink: PrometheusSink) -> None:
        with self._lock:
            sink.finished_at = time.monotonic()
            if self._live.get(sink.run) is sink:
                del self._live[sink.run]
                self._closed[sink.run] = sink

    def close(self) -> None:
        """Stop the HTTP server (if any) and take the gradwatch metrics out of the registry."""
        with _lock:
            for table in (_served, _by_registry):
                for key, value in list(table.items()):
                    if value is self:
                        del table[key]  # type: ignore[arg-type]
            if self in _all:
                _all.remove(self)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = self._thread = None
        self._unregister()

    def __repr__(self) -> str:
        return f"Exporter(url={self.url!r}, runs={self.runs!r})"


class PrometheusSink:
    """A gradwatch sink that exports one run; called on the writer thread only.

    Made by :meth:`Exporter.sink`. It implements the sink methods ``write`` (step records),
    ``write_findings`` and ``close``. After the run closes its series stay exported with their
    final values until a run of the same label starts on the exporter, or a run starts more than
    :data:`FINISHED_SECONDS` after it closed.
    """

    def __init__(self, exporter: Exporter, run: str, *, model: str | None = None, per_layer: bool = False,
                 max_layers: int = PROMETHEUS_MAX_LAYERS) -> None:
        if isinstance(max_layers, bool) or not isinstance(max_layers, int) or max_layers < 1:
            raise ConfigError(f"max_layers must be a positive integer, got {max_layers!r}")
        self.exporter = exporter
        self.run = run
        self.model = model or ""
        self.base = (run, self.model)
        e = exporter
        self._grad_norm = e.grad_norm.labels(*self.base)
        self._loss = e.loss.labels(*self.base)
        self._lr = e.learning_rate.labels(*self.base)
        self._step = e.step.labels(*self.base)
        self._steps = e.steps.labels(*self.base)
        self._skipped = e.skipped.labels(*self.base)
        self._findings: dict[tuple[str, str], Any] = {}
        self._actions: dict[str, Any] = {}
        for kind in KINDS:  # every series exists from the start, at 0, so that increase() sees the first finding
            for severity in SEVERITIES:
                self._finding_series(kind, severity)
        for action in PRECEDENCE:
            self._action_series(action)
        self._counted: dict[int, int] = {}  # finding id -> occurrences counted so far
        self.layers = _Layers(e.layer_grad_norm, self.base, max_layers) if per_layer else None
        self.closed = False
        self.finished_at = math.inf

    def _finding_series(self, kind: str, severity: str) -> Any:
        key = (kind, severity)
        child = self._findings.get(key)
        if child is None:
            child = self._findings[key] = self.exporter.findings.labels(*self.base, kind, severity)
        return child

    def _action_series(self, action: str) -> Any:
        child = self._actions.get(action)
        if child is None:
            child = self._actions[action] = self.exporter.actions.labels(*self.base, action)
        return child

    def write(self, records: Sequence[StepRecord]) -> None:
        """Count the steps and set the gauges to the last values of the batch."""
        steps = skipped = 0
        last: StepRecord | None = None
        values: dict[str, float] = {}
        for rec in records:
            if rec.flight:  # the flight recorder re-sends steps already counted
                continue
            steps += 1
            skipped += rec.skipped
            last = rec
            values.update(rec.scalars)
        if last is None:
            return
        self._steps.inc(steps)
        if skipped:
            self._skipped.inc(skipped)
        self._step.set(last.step)
        for name, gauge in (("grad_norm", self._grad_norm), ("loss", self._loss), ("lr", self._lr)):
            if name in values:
                gauge.set(values[name])
        if self.layers is not None:
            for rec in reversed(records):
                if not rec.flight and (LAYER, "grad_norm") in rec.vectors:
                    self.layers.update(rec)
                    break

    def write_findings(self, findings: Sequence[Finding]) -> None:
        """Count findings; a finding written again (a new repeat count) adds only its new repeats."""
        for f in findings:
            repeats = f.data.get("repeats", 1)
            repeats = repeats if isinstance(repeats, int) and not isinstance(repeats, bool) and repeats > 0 else 1
            if f.id is None:
                delta = repeats
            else:
                first = f.id not in self._counted
                delta = repeats - self._counted.get(f.id, 0)
                if delta > 0:
                    self._counted[f.id] = repeats
                if first and self.layers is not None and f.layer is not None:
                    self.layers.flag(f.layer)
            if delta > 0:
                self._finding_series(f.kind, f.severity).inc(delta)
                self._action_series(f.action or "none").inc(delta)

    def close(self, status: str) -> None:
        """The run ended: its series keep their last values; the label may be reused."""
        self.closed = True
        self.exporter._finished(self)

    def remove_series(self) -> None:
        """Take every series of this run out of the exporter."""
        e = self.exporter
        for metric in (e.grad_norm, e.loss, e.learning_rate, e.step, e.steps, e.skipped):
            _remove(metric, self.base)
        for kind, severity in self._findings:
            _remove(e.findings, (*self.base, kind, severity))
        for action in self._actions:
            _remove(e.actions, (*self.base, action))
        if self.layers is not None:
            self.layers.clear()


class _Layers:
    """The per-layer gauge of one run, capped at ``cap`` layers: flagged first, then the largest."""

    def __init__(self, gauge: Gauge, base: tuple[str, ...], cap: int) -> None:
        self.gauge, self.base, self.cap = gauge, base, cap
        self.flagged: dict[str, None] = {}  # insertion order = order flagged (most recent last)
        self.children: dict[str, tuple[int, Any]] = {}  # layer -> (index in the layout, series)
        self.version: int | None = None
        self.next_rank = 0
        self.dirty = True

    def flag(self, layer: str) -> None:
        self.flagged.pop(layer, None)
        self.flagged[layer] = None
        if layer not in self.children:
            self.dirty = True

    def update(self, rec: StepRecord) -> None:
        if self.dirty or rec.step >= self.next_rank or rec.layout.version != self.version:
            self._select(rec)
        vec = rec.vectors[(LAYER, "grad_norm")]
        has = present(rec, LAYER, "grad_norm")
        for i, child in self.children.values():
            if has[i]:
                child.set(float(vec[i]))

    def _select(self, rec: StepRecord) -> None:
        names = rec.layout.layers
        index = {name: i for i, name in enumerate(names)}
        vec = rec.vectors[(LAYER, "grad_norm")]
        has = present(rec, LAYER, "grad_norm")
        chosen: list[int] = []
        for layer in reversed(self.flagged):  # most recently flagged first
            i = index.get(layer)
            if i is not None and has[i] and len(chosen) < self.cap:
                chosen.append(i)
        if len(chosen) < self.cap:
            size = np.where(np.isnan(vec), np.inf, vec)  # a NaN gradient ranks as the largest
            taken = set(chosen)
            for i in np.argsort(-size, kind="stable").tolist():
                if len(chosen) >= self.cap:
                    break
                if has[i] and i not in taken:
                    chosen.append(i)
        keep = {names[i]: i for i in chosen}
        for layer in list(self.children):
            if layer not in keep:
                del self.children[layer]
                _remove(self.gauge, (*self.base, layer))
        for layer, i in keep.items():
            old = self.children.get(layer)
            self.children[layer] = (i, old[1] if old is not None else self.gauge.labels(*self.base, layer))
        self.version, self.next_rank, self.dirty = rec.layout.version, rec.step + RERANK_STEPS, False

    def clear(self) -> None:
        for layer in self.children:
            _remove(self.gauge, (*self.base, layer))
        self.children.clear()


def _remove(metric: Any, labels: tuple[str, ...]) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass


# ---------------------------------------------------------------------- getting an exporter
def serve(port: int = 9108, addr: str = PROMETHEUS_ADDR) -> Exporter:
    """The exporter serving a dedicated registry at ``http://addr:port/metrics``, started on first use.

    Every call with the same address and port in this process returns the same exporter; port 0
    starts a new server on a free port each time (its :attr:`Exporter.port` says which, and later
    calls with that port return it).

    Raises:
        ConfigError: the port is in use, not allowed, or the address is not this machine's.
    """
    key = (addr, port)
    with _lock:
        found = _served.get(key) if port else None
        if found is not None:
            return found
        exporter = Exporter(port=port, addr=addr)
        if port:
            _served[key] = exporter
        if exporter.port is not None:  # so that a port 0 exporter is found by the port it got
            _served[(addr, exporter.port)] = exporter
    log.info("gradwatch: Prometheus metrics at %s", exporter.url)
    return exporter


def for_registry(registry: CollectorRegistry, *, port: int | None = None, addr: str = PROMETHEUS_ADDR) -> Exporter:
    """The exporter registering gradwatch's metrics into ``registry`` (one per registry).

    Without ``port`` no server is started: expose the registry as you already do. With ``port``,
    the registry is also served there (started on first use).

    Raises:
        ConfigError: ``port`` is in use, or this registry is already served on another port.
    """
    with _lock:
        exporter = _by_registry.get(id(registry))
        if exporter is None:
            exporter = _by_registry[id(registry)] = Exporter(registry)
        if port is not None:
            if exporter.port is None:
                exporter._serve(port, addr)
                log.info("gradwatch: Prometheus metrics at %s", exporter.url)
            elif port not in (0, exporter.port):
                raise ConfigError(f"option prometheus: this registry is already served at {exporter.url}; "
                                  f"use that port, or leave port out")
    return exporter


def exporters() -> list[Exporter]:
    """The exporters of this process (e.g. to find the port picked for ``port=0``)."""
    with _lock:
        return list(_all)


def shutdown() -> None:
    """Stop every exporter of this process (their servers, and their metrics in the registries)."""
    for exporter in exporters():
        exporter.close()


def sink_for(option: Any, *, run: str, model: str | None = None) -> PrometheusSink:
    """The sink for a watcher's ``prometheus`` option (see :func:`gradwatch.options.prometheus_settings`)."""
    settings = prometheus_settings(option)
    if settings is None:
        raise ConfigError("option prometheus is off; nothing to export")
    registry = settings["registry"]
    if registry is not None:
        exporter = for_registry(registry, port=settings["port"], addr=settings["addr"])
    else:
        exporter = serve(settings["port"], settings["addr"])
    return exporter.sink(run, model=model, per_layer=settings["per_layer"], max_layers=settings["max_layers"])


def export_run(path: str | Path, exporter: Exporter, *, per_layer: bool = False,
               max_layers: int = PROMETHEUS_MAX_LAYERS) -> PrometheusSink:
    """Export a recorded run (finished, or as far as it is written) through ``exporter``.

    Replays the stored steps and findings into a sink labelled with the run directory's name,
    so the series hold the run's final values and totals. Returns the (closed) sink.
    """
    from gradwatch.store.reader import open_run

    run = open_run(path)
    sink = exporter.sink(Path(path).resolve().name, model=run.meta.get("model"), per_layer=per_layer,
                         max_layers=max_layers)
    try:
        sink.write_findings(list(_stored_findings(run)))
        batch: list[StepRecord] = []
        for rec in run.records():
            batch.append(rec)
            if len(batch) >= 512:
                sink.write(batch)
                batch = []
        sink.write(batch)
    finally:
        sink.close(str(run.status))
    return sink


def _stored_findings(run: Any) -> Iterable[Finding]:
    for i, row in enumerate(run.findings().itertuples(index=False)):
        yield Finding(kind=row.kind, severity=row.severity, step=int(row.step),
                      layer=row.layer if isinstance(row.layer, str) else None, message=str(row.message),
                      action=row.action if isinstance(row.action, str) else None,
                      data=dict(row.data) if isinstance(row.data, dict) else {}, id=i + 1)
