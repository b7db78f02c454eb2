"""MLflow sink: a run's statistics, findings and verdict in an MLflow run (docs/integrations.md#mlflow).

With the training step as MLflow's step: every step ``gradwatch/global/<name>`` (``grad_norm``,
``loss``, ``lr``, observed scalars; ``skipped``: 1 on a skipped step, 0 on any other); on sampled and NaN/Inf steps
(and the flight recorder's copies of other steps) ``gradwatch/<metric>/<layer>``. The tag
``gradwatch.worst`` follows the findings; at the end, the findings as the table artifact
``gradwatch/findings.json`` and the tags ``gradwatch.verdict`` (``fail`` for an error finding or a
run that did not finish), ``.status``, ``.steps`` and ``.findings``; ``gradwatch.run`` (the run
directory) from the start. Layer and scalar names become MLflow-safe keys by :func:`safe_names`.

Resume: a run the sink started keeps its id in the run's metadata (``mlflow_run``); a process that
resumes the run (``gw.watch(..., resume=True)``) continues that MLflow run (RUNNING again, its
verdict tags replaced at the end) and tags the restarts (``gradwatch.restarts``, as ``check`` says
them). MLflow keeps every point logged: a superseded step has the earlier process's point and the
restart's (the later one is its latest value).

``mlflow`` is imported when the sink starts. Only the sink's own thread talks to the tracking
server: the writer thread hands it work and returns, so a slow or dead server never holds the
writer, nor training. At most ``backlog`` points wait for the server (newer ones are dropped, with a
warning); ``log_batch`` calls respect MLflow's limits (1,000 metrics, 100 tags). A call that fails
(after MLflow's own retries) stops the sending, and the sink's next call raises: the writer disables
it with a log line. Closing waits at most ``timeout`` seconds for the server.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradwatch.errors import ConfigError, GradwatchWarning
from gradwatch.sinks import layer_points, tally
from gradwatch.sinks.sending import Sender
from gradwatch.store import resume
from gradwatch.store.findings import Finding, rank
from gradwatch.store.records import LAYER, StepRecord
from gradwatch.store.verdict import UNFINISHED

log = logging.getLogger("gradwatch")

MISSING = ("option sinks: the mlflow sink needs the mlflow package, which is not installed: "
           "pip install 'gradwatch[mlflow]'")
#: the columns of the findings table, in order
COLUMNS = ("kind", "severity", "layer", "step", "action", "message", "repeats")
#: MLflow's limits: characters of a key, metrics and tags in one ``log_batch``, characters of a tag's value
MAX_KEY, METRICS_PER_CALL, TAGS_PER_CALL, MAX_TAG = 250, 1000, 100, 8000
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_PREFIX = re.compile(r"[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*")


def safe_names(names: Sequence[str], room: int, taken: set[str] | None = None) -> list[str]:
    """MLflow-safe, distinct key parts for ``names``, in order.

    ASCII letters, digits, ``_``, ``-`` and ``.`` stay; any other character becomes ``_``
    (``(root)``: ``_root_``); a part of dots only has them as ``_``; one longer than ``room`` is cut
    and ends with ``-`` and 8 hex digits of the name's SHA-1; one an earlier name already has gets
    ``_2``, ``_3`` ...

    Args:
        names: layer or scalar names.
        room: the most characters a part may have.
        taken: the parts already given (updated): a new name never gets one of them.
    """
    taken = set() if taken is None else taken
    out = []
    for name in names:
        part = _UNSAFE.sub("_", name)
        if not part.strip("."):  # "", "." and ".." are not path parts MLflow accepts
            part = part.replace(".", "_") or "_"
        if len(part) > room:
            part = part[:room - 9] + "-" + hashlib.sha1(name.encode("utf-8", "replace")).hexdigest()[:8]
        base, n = part, 1
        while part in taken:
            n += 1
            part = base[:room - len(f"_{n}")] + f"_{n}"
        taken.add(part)
        out.append(part)
    return out


def _check(name: str, value: Any, ok: bool, wanted: str) -> None:
    if not ok:
        raise ConfigError(f"option sinks: the mlflow sink's setting {name} must be {wanted}, got {value!r}")


class MLflow:
    """Writes a gradwatch run into an MLflow run: the active one, the one named, or one it starts.

    Args:
        run_dir: the gradwatch run directory (names a run the sink starts; the tag ``gradwatch.run``).
        tracking_uri: where to log (None: MLflow's own, ``mlflow.get_tracking_uri()`` when ``gw.watch``
            is called). The active run is used only at MLflow's own URI.
        experiment: the experiment (by name, created if missing) of a run the sink starts (None: MLflow's
            active or default experiment).
        run_id: log into this existing run (None: the active run, else a new one).
        run_name: the name of a run the sink starts (None: the run directory's name).
        layer_metrics: the per-layer metrics to write (None: every one the step measured; an empty list:
            none).
        timeout: the most seconds closing waits for the tracking server to take what is left.
        backlog: the most points that wait for the tracking server; newer ones are dropped.
        prefix: the namespace of every key (two watched models in one MLflow run need two); its tags
            are ``<prefix with / as .>.verdict`` ...
    """

    def __init__(self, run_dir: Path, *, tracking_uri: str | None = None, experiment: str | None = None,
                 run_id: str | None = None, run_name: str | None = None,
                 layer_metrics: Sequence[str] | None = None, timeout: float = 30.0, backlog: int = 200_000,
                 prefix: str = "gradwatch") -> None:
        for name, value in (("tracking_uri", tracking_uri), ("experiment", experiment), ("run_id", run_id),
                            ("run_name", run_name)):
            _check(name, value, value is None or (isinstance(value, str) and bool(value)), "a non-empty string")
        _check("layer_metrics", layer_metrics, layer_metrics is None or (
            isinstance(layer_metrics, (list, tuple)) and all(isinstance(m, str) for m in layer_metrics)),
            "a list of metric names")
        _check("timeout", timeout, isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
               and math.isfinite(timeout) and timeout >= 0, "a number of seconds, 0 or more")
        _check("backlog", backlog, isinstance(backlog, int) and not isinstance(backlog, bool) and backlog > 0,
               "a positive integer")
        _check("prefix", prefix, isinstance(prefix, str) and len(prefix) <= 100 and bool(_PREFIX.fullmatch(prefix))
               and all(part.strip(".") for part in prefix.split("/")),
               "a key prefix of letters, digits, '_', '-' and '.' (parts separated by '/')")
        try:
            import mlflow
        except ImportError as exc:
            raise ConfigError(MISSING) from exc
        own = mlflow.get_tracking_uri()
        active = mlflow.active_run() if tracking_uri in (None, own) else None  # thread-local: read it here
        self.tracking_uri: str = tracking_uri or own
        #: the MLflow run's id (None until the sink's thread has started a new one)
        self.run_id: str | None = run_id or (active.info.run_id if active is not None else None)
        self.owned = self.run_id is None  # started by the sink, which ends it
        self._kept, self._restarts = resume.tracker_run(run_dir, "mlflow") if self.owned else (None, [])
        self._nonfinite: set[str] = set()  # the NaN/Inf count keys last written non-zero
        self._dir, self._experiment, self._run_name = run_dir, experiment, run_name or run_dir.name
        self._metrics = None if layer_metrics is None else frozenset(layer_metrics)
        self._timeout, self._backlog = float(timeout), backlog
        self._prefix, self._tag = prefix, prefix.replace("/", ".")
        self._keys: dict[tuple[int, str], np.ndarray] = {}  # (layout version, metric) -> key per layer
        self._globals: dict[str, str] = {}
        self._global_parts: set[str] = set()
        self._steps = 0
        self._findings: dict[object, Finding] = {}  # by id: the latest version of each
        self._worst: str | None = None
        self._lock = threading.Lock()
        self._pending = self._dropped = 0
        self._notices: list[tuple[type[Warning], str]] = []
        self._client: Any = None
        self._sender = Sender(f"gradwatch-mlflow-{run_dir.name}")
        self._sender.put(self._start)

    # ---------------------------------------------------------------- sink
    def write(self, records: Sequence[StepRecord]) -> None:
        """Hand the records' points to the sending thread (global series every step, per-layer where written)."""
        self._raise()
        points: list[tuple[str, float, int, int]] = []
        for rec in records:
            ms = int(rec.time * 1000)
            if not rec.flight:
                points += [(self._global(name), float(value), ms, rec.step) for name, value in rec.scalars.items()]
                points.append((self._global("skipped"), 1.0 if rec.skipped else 0.0, ms, rec.step))
                self._steps = max(self._steps, rec.step + 1)
            # per-layer series: sampled steps and NaN/Inf steps when they come; a flight-recorder copy of any
            # other step when a finding fires (a copy of one of the former would repeat it)
            first = rec.sampled or not rec.gradients_finite()
            if (first and not rec.flight) or (rec.flight and not first):
                self._layers(rec, ms, points)
        if not points:
            return
        with self._lock:
            if self._pending + len(points) > self._backlog:
                self._dropped += len(points)
                if self._dropped == len(points):
                    self._notices.append((GradwatchWarning, (
                        f"gradwatch: the MLflow tracking server at {self.tracking_uri} is not keeping up: "
                        f"{self._pending} points wait for it, so newer ones are dropped until it catches up "
                        f"(the run store keeps them all; how many were dropped is logged when the run closes)")))
                return
            self._pending += len(points)
        self._sender.put(lambda: self._log_points(points))

    def write_findings(self, findings: Sequence[Finding]) -> None:
        """Keep the findings (an update replaces its earlier version); tag a new worst severity."""
        self._raise()
        for f in findings:
            self._findings[f.id if f.id is not None else object()] = f
            if self._worst is None or rank(f.severity) > rank(self._worst):
                self._worst = f.severity
                self._sender.put(functools.partial(self._set_tag, f"{self._tag}.worst", f.severity))

    def close(self, status: str) -> None:
        """Send the findings table and the verdict, end a run the sink started; wait at most ``timeout`` s."""
        tags = self.verdict(status)
        rows = [[f.kind, f.severity, f.layer, f.step, f.action, f.message, int(f.data.get("repeats", 1))]
                for f in sorted(self._findings.values(), key=lambda f: (f.step, f.id if f.id is not None else 0))]
        self._sender.put(lambda: self._finish(status, tags, rows))
        if not self._sender.stop(self._timeout):
            log.warning("gradwatch: the MLflow tracking server at %s did not answer within %g s (the mlflow sink's "
                        "timeout) as the run %r closed: %d points%s and the verdict are not in MLflow; the run store "
                        "has them", self.tracking_uri, self._timeout, str(self._dir), self._pending + self._dropped,
                        ", the findings table" if rows else "")
            return
        if self._dropped:
            log.warning("gradwatch: %d points of the run %r were not sent to MLflow (the tracking server at %s "
                        "did not keep up); the run store has them", self._dropped, str(self._dir), self.tracking_uri)
        self._raise()

    def take_notices(self) -> list[tuple[type[Warning], str]]:
        """The warnings to give the user since the last call (category, message)."""
        with self._lock:
            out, self._notices = self._notices, []
        return out

    def verdict(self, status: str) -> dict[str, str]:
        """The tags of a run that closed as ``status`` (``pass`` unless an error finding, or not finished)."""
        counts, worst, failed = tally(self._findings.values(), status)
        t = self._tag
        return {f"{t}.verdict": "fail" if failed else "pass", f"{t}.status": status, f"{t}.steps": str(self._steps),
                f"{t}.worst": worst or "none", f"{t}.findings": json.dumps(counts)}

    # ------------------------------------------------------------- helpers
    def _raise(self) -> None:
        exc = self._sender.error
        if exc is not None:
            raise RuntimeError(f"sending to MLflow at {self.tracking_uri} failed ({type(exc).__name__}: "
                               f"{str(exc)[:500]}); nothing more is sent to MLflow") from exc

    def _global(self, name: str) -> str:
        key = self._globals.get(name)
        if key is None:
            room = MAX_KEY - len(f"{self._prefix}/global/")
            key = self._globals[name] = f"{self._prefix}/global/" + safe_names([name], room, self._global_parts)[0]
        return key

    def _layers(self, rec: StepRecord, ms: int, points: list[tuple[str, float, int, int]]) -> None:
        """Add the record's per-layer points (those measured; non-zero NaN/Inf counts only)."""
        for (scope, metric), vec in rec.vectors.items():
            if scope != LAYER or (self._metrics is not None and metric not in self._metrics):
                continue
            found = self._layer_keys(rec, metric)
            index = layer_points(rec, metric, vec, found, self._nonfinite)
            if len(index):
                keys = found[index].tolist()
                points += [(key, value, ms, rec.step) for key, value in zip(keys, vec[index].tolist())]

    def _layer_keys(self, rec: StepRecord, metric: str) -> np.ndarray:
        found = self._keys.get((rec.layout.version, metric))
        if found is None:
            head = f"{self._prefix}/" + safe_names([metric], MAX_KEY)[0] + "/"
            parts = safe_names(rec.layout.layers, MAX_KEY - len(head))
            found = self._keys[(rec.layout.version, metric)] = np.array([head + p for p in parts], dtype=object)
        return found

    # --------------------------------------------------- the sending thread
    def _start(self) -> None:
        from mlflow import MlflowClient

        self._client = MlflowClient(self.tracking_uri)
        tags = {f"{self._tag}.run": str(self._dir)[:MAX_TAG]}
        if not self.owned:
            self._client.set_tag(self.run_id, *next(iter(tags.items())))
            return
        if self._kept is not None and self._restarts:  # this process resumed the run: its MLflow run goes on
            self.run_id = self._kept
            self._client.update_run(self.run_id, status="RUNNING")
            self._client.set_tag(self.run_id, f"{self._tag}.restarts", json.dumps(self._restarts)[:MAX_TAG])
            log.warning("gradwatch: the mlflow sink continues the run's own MLflow run (id %s, at %s) from step %d",
                        self.run_id, self.tracking_uri, self._restarts[-1]["step"])
            return
        if self._experiment is None:
            from mlflow.tracking import fluent

            experiment = fluent._get_experiment_id() or "0"  # what mlflow.start_run() would use
        else:
            found = self._client.get_experiment_by_name(self._experiment)
            experiment = found.experiment_id if found else self._client.create_experiment(self._experiment)
        run = self._client.create_run(experiment, run_name=self._run_name, tags=tags)
        self.run_id = run.info.run_id
        try:
            resume.keep_tracker_run(self._dir, "mlflow", self.run_id)
        except Exception as exc:  # noqa: BLE001 - a store that cannot take it: only a later resume misses it
            log.warning("gradwatch: the MLflow run's id could not be kept in the run %s (%s): a resumed run will "
                        "start another MLflow run", self._dir, exc)
        log.warning("gradwatch: no MLflow run was active, so the mlflow sink started one (%r, id %s, experiment %s, "
                    "at %s); it ends with the gradwatch run. Call mlflow.start_run() before gw.watch to log into "
                    "your own run.", run.info.run_name, self.run_id, experiment, self.tracking_uri)

    def _set_tag(self, key: str, value: str) -> None:
        self._client.set_tag(self.run_id, key, value)

    def _log_points(self, points: list[tuple[str, float, int, int]]) -> None:
        from mlflow.entities import Metric

        for i in range(0, len(points), METRICS_PER_CALL):
            chunk = points[i:i + METRICS_PER_CALL]
            self._client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step) for k, v, ms, step in chunk])
            with self._lock:
                self._pending -= len(chunk)

    def _finish(self, status: str, tags: dict[str, str], rows: list[list[Any]]) -> None:
        from mlflow.entities import RunTag

        if rows:
            table = {column: [row[i] for row in rows] for i, column in enumerate(COLUMNS)}
            self._client.log_table(self.run_id, data=table, artifact_file=f"{self._prefix}/findings.json")
        items = [RunTag(k, v[:MAX_TAG]) for k, v in tags.items()]
        for i in range(0, len(items), TAGS_PER_CALL):
            self._client.log_batch(self.run_id, tags=items[i:i + TAGS_PER_CALL])
        if self.owned:
            state = "FINISHED" if status not in UNFINISHED else "KILLED" if status == "terminated" else "FAILED"
            self._client.set_terminated(self.run_id, state)
