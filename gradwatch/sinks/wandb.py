"""Weights & Biases sink: a run's statistics, findings and verdict in the active ``wandb.run``.

``gw.watch(model, sinks=["wandb"])`` (or ``sinks = ["wandb"]`` in a config file) writes, from the
writer thread:

- every step: ``gradwatch/step`` and the global series ``gradwatch/global/<name>`` (``grad_norm``,
  ``loss``, ``lr`` and any observed scalar; ``skipped``: 1 on a skipped step, 0 on any other);
- on sampled steps (and the steps the flight recorder sends when a finding fires, and a step with
  NaN/Inf gradients) also ``gradwatch/<metric>/<layer>`` for every per-layer statistic; with the
  option ``wandb_histograms``, on sampled steps, ``gradients/<param>`` and ``parameters/<param>``
  histograms as ``wandb.watch(model, log="all")`` names them (``<prefix>/gradients/...`` for another
  prefix);
- every finding as a row of the ``gradwatch/findings`` table (kind, severity, layer, step, action,
  message, repeats), logged again when new findings arrive (at most every ``table_every`` seconds)
  and at the end; an alert (``run.alert``) for each error, at most one per kind per ``alert_every``
  seconds;
- at the end, the verdict in the run summary: ``gradwatch/verdict`` (``pass``, or ``fail`` for an
  error finding or a run that did not finish), ``gradwatch/status``, ``gradwatch/steps``,
  ``gradwatch/worst``, ``gradwatch/counts`` and ``gradwatch/run`` (the run directory).

The step axis: ``gradwatch/*`` is declared with ``define_metric(..., step_metric="gradwatch/step")``,
so every gradwatch chart is drawn against the training step, and gradwatch never advances W&B's own
row counter (``_step``) in a run it did not start: in the user's run it merges one step of each writer
batch into the user's next row (``commit=False``): the newest skipped or NaN/Inf step, else the newest
with per-layer values, else the newest (the run store has every step). A run the sink started is
gradwatch's alone: there ``_step`` is the training step (``log(step=)``), every step a row; once rows
of someone else's are logged into it (W&B's step went past gradwatch's row), it is written as a user's run.

Resume: a run the sink started keeps its id in the run's metadata (``wandb_run``); a process that
resumes the run (``gw.watch(..., resume=True)``) continues that W&B run, rewound to the restart
step (``wandb.init(resume_from="<id>?_step=<step - 1>")``, W&B's own semantics for the superseded
steps; ``id=``, ``resume="allow"`` where rewinding is not available, and then the superseded steps
are not logged again). The summary's ``gradwatch/restarts`` marks the restarts as ``check`` does.

``wandb`` is imported when the sink starts: without it, ``gw.watch`` fails with one line saying
how to install it. With no active run, the sink starts one (``wandb.init(name=<run dir name>,
**init)``), says so on the ``gradwatch`` logger, and finishes it when the run closes; a run the
user started is left open for the user to finish.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradwatch.errors import ConfigError
from gradwatch.sinks import layer_points, tally
from gradwatch.store import resume
from gradwatch.store.findings import Finding
from gradwatch.store.records import LAYER, StepRecord
from gradwatch.store.verdict import UNFINISHED

log = logging.getLogger("gradwatch")
#: the clock of the alerts' and the table's rate limits (seconds)
now = time.monotonic

#: the columns of the findings table, in order
COLUMNS = ("kind", "severity", "layer", "step", "action", "message", "repeats")
MISSING = "it needs the wandb package, which is not installed: pip install 'gradwatch[wandb]'"


def _check(name: str, value: Any, ok: bool, wanted: str) -> None:
    if not ok:
        raise ConfigError(f"its setting {name} must be {wanted}, got {value!r}")


def _seconds(name: str, value: Any) -> float:
    _check(name, value, isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
           and value >= 0, "a number of seconds, 0 or more")
    return float(value)


class Wandb:
    """Writes a gradwatch run into the active W&B run (or one it starts).

    Args:
        run_dir: the gradwatch run directory (names a run the sink starts; in the summary).
        init: keyword arguments of ``wandb.init`` for the run the sink starts when none is active
            (``project``, ``entity``, ``mode``, ``dir`` ...); unused when a run is active.
        layer_metrics: the per-layer metrics to write (None: every one the step measured; an empty
            list: none).
        alerts: send a W&B alert for each error finding.
        alert_every: the fewest seconds between two alerts of the same kind (the errors in between
            are counted in the next one).
        table_every: the fewest seconds between two logs of the findings table while training (it
            is always logged at the end).
        prefix: the namespace of every key (two watched models in one W&B run need two).
    """

    def __init__(self, run_dir: Path, *, init: Mapping[str, Any] | None = None,
                 layer_metrics: Sequence[str] | None = None, alerts: bool = True, alert_every: float = 600.0,
                 table_every: float = 60.0, prefix: str = "gradwatch") -> None:
        _check("init", init, init is None or (isinstance(init, Mapping) and all(isinstance(k, str) for k in init)),
               "a table of wandb.init keyword arguments")
        _check("layer_metrics", layer_metrics, layer_metrics is None or (
            isinstance(layer_metrics, (list, tuple)) and all(isinstance(m, str) for m in layer_metrics)),
            "a list of metric names")
        _check("alerts", alerts, isinstance(alerts, bool), "true or false")
        _check("prefix", prefix, isinstance(prefix, str) and bool(prefix.strip("/")) and "*" not in prefix,
               "a non-empty key prefix without '*'")
        self._alert_every, self._table_every = _seconds("alert_every", alert_every), _seconds("table_every",
                                                                                              table_every)
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(MISSING) from exc
        self._wandb = wandb
        self._dir = run_dir
        self._prefix = prefix.strip("/")
        self._step_key = f"{self._prefix}/step"
        self._metrics = None if layer_metrics is None else frozenset(layer_metrics)
        self._alerts = alerts
        self.owned = wandb.run is None
        kept, self._restarts = resume.tracker_run(run_dir, "wandb")
        self.run: Any
        self._at = 0  # a run of its own: the W&B step of the row being written (rows behind it are dropped)
        if self.owned:
            self.run = self._init(wandb, run_dir, dict(init or {}), kept)
        else:
            self.run = wandb.run
        self._name = self.run.name
        self.run.define_metric(self._step_key)
        self.run.define_metric(f"{self._prefix}/*", step_metric=self._step_key, step_sync=True)
        self._keys: dict[tuple[int, str], np.ndarray] = {}  # (layout version, metric) -> key per layer
        self._globals: dict[str, str] = {}
        self._last_step = -1
        self._nonfinite: set[str] = set()  # the NaN/Inf count keys last written non-zero
        self._findings: dict[object, Finding] = {}  # by id: the latest version of each
        self._table_due = False
        self._table_at = -math.inf  # now() of the last table logged
        self._alerted: dict[str, tuple[float, int]] = {}  # kind -> (time of its last alert, errors since)
        self._gone = False  # the W&B run was finished under the sink
        self._shared = False  # a run the sink started that others log into too: written as a user's run

    # ---------------------------------------------------------------- sink
    def write(self, records: Sequence[StepRecord]) -> None:
        """The records' rows: their global series, and their per-layer ones where written (see the module)."""
        rows: list[tuple[int, int, dict[str, Any]]] = []  # rank (2: a skip or NaN/Inf, 1: per-layer values), step, row
        for rec in records:
            row: dict[str, Any] = {self._step_key: rec.step}
            if not rec.flight:
                row.update((self._global(name), value) for name, value in rec.scalars.items())
                row[self._global("skipped")] = 1.0 if rec.skipped else 0.0
            # per-layer series: sampled steps and NaN/Inf steps when they come; a flight-recorder copy of any
            # other step when a finding fires (a copy of one of the former would repeat it)
            first = rec.sampled or not rec.gradients_finite()
            size = len(row)
            if (first and not rec.flight) or (rec.flight and not first):
                self._layers(rec, row)
            if rec.histograms and not rec.flight:  # wandb_histograms: named as wandb.watch names them
                head = "" if self._prefix == "gradwatch" else f"{self._prefix}/"  # two models: apart
                row.update((head + key, self._wandb.Histogram(np_histogram=(counts, edges)))
                           for key, (counts, edges) in rec.histograms.items())
            if len(row) > 1:
                rank = 2 if not rec.flight and (rec.skipped or not rec.gradients_finite()) else int(len(row) > size)
                rows.append((rank, rec.step, row))
        if self.owned and not self._shared and rows and self._others():
            self._shared = True  # someone logs into the run the sink started (wandb.log, Lightning's WandbLogger)
            log.info("gradwatch: rows other than gradwatch's are logged into the W&B run %s: gradwatch merges its "
                     "steps into them from now on (commit=False), as into a run of the user's", self._name)
        if self.owned and not self._shared:
            for _, step, row in rows:
                if step >= self._at and self._log(row, step=step):
                    self._at = step
                    self._last_step = max(self._last_step, step)
        elif rows:
            # one row merged into the user's next one: the newest of a skipped or NaN/Inf step, else the newest with
            # per-layer values, else the newest
            top = max(rank for rank, _, _ in rows)
            if self._log([row for rank, _, row in rows if rank == top][-1], commit=False):
                self._last_step = max(self._last_step, rows[-1][1])
        if self._table_due and now() - self._table_at >= self._table_every:
            self._log_table()

    def write_findings(self, findings: Sequence[Finding]) -> None:
        """Keep the findings (an update replaces its earlier version), alert on new errors, log the table."""
        for f in findings:
            key = f.id if f.id is not None else object()
            if key not in self._findings and f.severity == "error" and self._alerts:
                self._alert(f)
            self._findings[key] = f
        self._table_due = True
        if now() - self._table_at >= self._table_every:
            self._log_table()

    def close(self, status: str) -> None:
        """Log the final findings table and put the verdict in the run summary; finish a run the sink started."""
        if self._table_due:
            self._log_table()
        if not self._gone:
            try:
                summary = self.verdict(status)
                if self._restarts:
                    summary[f"{self._prefix}/restarts"] = self._restarts
                self.run.summary.update(summary)
            except self._wandb.errors.UsageError:
                self._finished_under()
        if self.owned and not self._gone:
            self.run.finish(exit_code=0 if status not in UNFINISHED else 1)

    def verdict(self, status: str) -> dict[str, Any]:
        """The summary entries of a run that closed as ``status`` (``pass`` unless an error or not finished)."""
        counts, worst, failed = tally(self._findings.values(), status)
        p = self._prefix
        return {f"{p}/verdict": "fail" if failed else "pass", f"{p}/status": status,
                f"{p}/steps": self._last_step + 1, f"{p}/worst": worst or "none", f"{p}/counts": counts,
                f"{p}/run": str(self._dir)}

    # ------------------------------------------------------------- helpers
    def _global(self, name: str) -> str:
        key = self._globals.get(name)
        if key is None:
            key = self._globals[name] = f"{self._prefix}/global/{name}"
        return key

    def _layers(self, rec: StepRecord, row: dict[str, Any]) -> None:
        """Add the record's per-layer values (those measured; non-zero NaN/Inf counts only) to ``row``."""
        for (scope, metric), vec in rec.vectors.items():
            if scope != LAYER or (self._metrics is not None and metric not in self._metrics):
                continue
            keys = self._layer_keys(rec, metric)
            index = layer_points(rec, metric, vec, keys, self._nonfinite)
            if len(index):
                row.update(zip(keys[index].tolist(), vec[index].tolist()))

    def _layer_keys(self, rec: StepRecord, metric: str) -> np.ndarray:
        found = self._keys.get((rec.layout.version, metric))
        if found is None:
            found = self._keys[(rec.layout.version, metric)] = np.array(
                [f"{self._prefix}/{metric}/{layer}" for layer in rec.layout.layers], dtype=object)
        return found

    def _log(self, row: dict[str, Any], **how: Any) -> bool:
        """``run.log(row, **how)``; False once the run was finished under the sink."""
        if self._gone:
            return False
        try:
            self.run.log(row, **how)
        except self._wandb.errors.UsageError:
            self._finished_under()
            return False
        return True

    def _others(self) -> bool:
        """Whether W&B's step went past the row the sink is writing: someone else commits rows into its run."""
        try:
            return bool(self.run.step > self._at)
        except self._wandb.errors.UsageError:
            return False  # finished under the sink: said when it next logs

    def _init(self, wandb: Any, run_dir: Path, init: dict[str, Any], kept: str | None) -> Any:
        """Start the sink's own run: the one the run's metadata keeps when this process resumed the run."""
        said = "started one"
        if kept is not None and self._restarts and not {"id", "resume", "resume_from", "fork_from"} & set(init):
            step = self._at = self._restarts[-1]["step"]
            said = f"continued the run's own ({kept}) from step {step}"
            if step > 0 and "resume_from" in inspect.signature(wandb.init).parameters:
                try:  # W&B's rewind: the history from the restart step on is the restart's
                    run = wandb.init(**{"name": run_dir.name, **init, "resume_from": f"{kept}?_step={step - 1}"})
                except Exception as exc:  # a server without rewind: the superseded steps are not logged again
                    log.warning("gradwatch: W&B could not rewind run %s to step %d (%s); it continues it instead, "
                                "from its last step", kept, step, exc)
                else:
                    return self._started(run, run_dir, said)
            init = {**init, "id": kept, "resume": "allow"}
        return self._started(wandb.init(**{"name": run_dir.name, **init}), run_dir, said)

    def _started(self, run: Any, run_dir: Path, said: str) -> Any:
        try:
            resume.keep_tracker_run(run_dir, "wandb", run.id)
        except Exception as exc:  # noqa: BLE001 - a store that cannot take it: only a later resume misses it
            log.warning("gradwatch: the W&B run's id could not be kept in the run %s (%s): a resumed run will "
                        "start another W&B run", run_dir, exc)
        self._at = max(self._at, int(getattr(run, "starting_step", 0) or 0))
        log.warning("gradwatch: no W&B run was active, so the wandb sink %s (%s, %s); it ends with the gradwatch "
                    "run. Call wandb.init() before gw.watch to log into your own run.", said, run.name,
                    run.url or f"offline, in {Path(run.dir).parent}")
        return run

    def _finished_under(self) -> None:
        if not self._gone:
            self._gone = True
            log.warning("gradwatch: the W&B run %s was finished before the gradwatch run %s closed: what gradwatch "
                        "writes after that (its last steps, findings and verdict) is not in W&B. Close the watcher "
                        "(gw.watcher(model).close()) before wandb.finish().", self._name, self._dir)

    def _log_table(self) -> None:
        """Log every finding so far as one table (a new version of ``<prefix>/findings``)."""
        rows = sorted(self._findings.values(), key=lambda f: (f.step, f.id if f.id is not None else 0))
        data = [[f.kind, f.severity, f.layer, f.step, f.action, f.message, int(f.data.get("repeats", 1))]
                for f in rows]
        table = self._wandb.Table(columns=list(COLUMNS), data=data)
        self._log({f"{self._prefix}/findings": table}, commit=False)  # into the row being written
        self._table_due, self._table_at = False, now()

    def _alert(self, f: Finding) -> None:
        """An error alert for ``f``, unless one of its kind went out less than ``alert_every`` seconds ago."""
        moment = now()
        last, since = self._alerted.get(f.kind, (-math.inf, 0))
        if moment - last < self._alert_every:
            self._alerted[f.kind] = (last, since + 1)
            return
        self._alerted[f.kind] = (moment, 0)
        where = f", layer {f.layer}" if f.layer else ""
        action = f" Action: {f.action}." if f.action else ""
        more = f" ({since} more {f.kind} error(s) since the last alert.)" if since else ""
        if self._gone:
            return
        try:
            self.run.alert(title=f"gradwatch: {f.kind}"[:63], text=f"{self._dir.name}, step {f.step}{where}: "
                           f"{f.message}{action}{more}", level="ERROR",
                           wait_duration=self._alert_every or None)
        except self._wandb.errors.UsageError:
            self._finished_under()
