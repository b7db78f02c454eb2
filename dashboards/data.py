"""Dashboard data: JSON-ready views of the runs under a root folder, each bounded in size.

Every view reads the run store read-only (``Run`` opens SQLite with ``mode=ro``) and returns plain
dicts and lists. Whatever the run's length, a curve has at most ``MAX_POINTS`` points and a
heatmap at most ``MAX_COLUMNS`` x ``MAX_ROWS`` cells.

Per-layer views over long step ranges come from :class:`Envelopes`: per (run, metric), the low
and high of every layer in buckets of steps (:class:`gradwatch.store.downsample.Envelope`), kept up to
date by reading only the vectors written since the last request. Short ranges (a zoom) are read
from the store at full resolution.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pandas as pd

from gradwatch import encoding
from gradwatch.errors import DamagedStoreError
from gradwatch.report import items as explained
from gradwatch.report import marks
from gradwatch.report import summary as report_summary
from gradwatch.report.data import CHUNK, HEATMAPS, MAX_COLUMNS, MAX_POINTS, MAX_ROWS, select_rows
from gradwatch.report.remedies import explain
from gradwatch.store import downsample, verdict
from gradwatch.store.listing import describe_run, find_runs, updated
from gradwatch.store.reader import Run, open_run
from gradwatch.store.schema import DB_NAME

#: a zoomed range is read from the store at full resolution when it spans at most this many steps
#: and the envelope holds fewer than ``RAW_BUCKETS`` buckets of it
RAW_STEPS = 8192
RAW_BUCKETS = 64
#: most findings one response lists (the most severe first)
MAX_FINDINGS = 1000
#: most skipped steps marked on the timeline (an even sample beyond)
MAX_SKIPPED = 2000
#: global curves on the run page
CURVES = ("grad_norm", "loss", "lr")
#: per-layer metrics: heatmap choices and the layer detail's series, with title and log scale
METRICS = {m: (title, log) for m, title, log in HEATMAPS}


class NotFound(Exception):
    """No run with this name under the root (or a name that points outside it)."""


class BadRequest(Exception):
    """A parameter out of its range (the message says which and why)."""


def _finite(values: np.ndarray, digits: int = 6) -> list[float | None]:
    """Numbers for JSON: rounded to ``digits`` significant digits, NaN and infinities as null."""
    return [float(f"{v:.{digits}g}") if math.isfinite(v) else None
            for v in np.asarray(values, dtype=np.float64).tolist()]


def _cells(table: np.ndarray, decimals: int) -> list[list[float | None]]:
    """Heatmap cells for JSON: rounded to ``decimals`` places (colour needs no more), NaN as null."""
    rounded = np.round(np.asarray(table, dtype=np.float64), decimals)
    cells = rounded.astype(object)
    cells[~np.isfinite(rounded)] = None
    return cells.tolist()


# ------------------------------------------------------------------ the runs under a root
class Root:
    """The folder the dashboard serves; runs are addressed by their path relative to it."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self._rows: dict[Path, tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def resolve(self, run_id: str) -> Path:
        """The run directory named ``run_id`` (``.`` when the root is itself a run).

        Raises:
            NotFound: an empty or absolute name, one with ``..`` or a NUL, one that resolves (through
                links too) outside the root, or a directory that holds no run.
        """
        if not run_id or "\x00" in run_id or "\\" in run_id:
            raise NotFound(run_id)
        rel = PurePosixPath(encoding.native(run_id))  # its name as the filesystem has it (see run_id)
        if rel.is_absolute() or ".." in rel.parts:
            raise NotFound(run_id)
        path = (self.root / rel).resolve()
        if not path.is_relative_to(self.root) or self.store(path) is None:
            raise NotFound(run_id)
        return path

    def store(self, run_dir: Path) -> Path | None:
        """The run's store file, resolved; None when there is none, or when a link leads out of the root.

        The files SQLite opens beside the store (``-wal``, ``-shm``, ``-journal``) are checked too.
        """
        db = (run_dir / DB_NAME).resolve()
        if not db.is_relative_to(self.root) or not db.is_file():
            return None
        for suffix in ("-wal", "-shm", "-journal"):
            beside = db.with_name(db.name + suffix)
            if beside.is_symlink() and not beside.resolve().is_relative_to(self.root):
                return None
        return db

    def run_id(self, path: Path) -> str:
        """The name a run directory is addressed by: text whatever the filesystem encoding (a non-ASCII
        name under a C locale with UTF-8 mode off is its UTF-8 characters, not lone surrogates).
        """
        return encoding.readable(path.relative_to(self.root).as_posix())

    def open(self, run_id: str) -> Run:
        """Open a run by name, read-only (the store file it opens is the one :meth:`store` resolved)."""
        db = self.store(self.resolve(run_id))
        if db is None:  # changed since it was resolved
            raise NotFound(run_id)
        return open_run(db)

    def runs(self) -> list[dict[str, Any]]:
        """One row per run (id, steps, status, findings, last update), newest update first.

        A run is read again only when its store changed since the last call.
        """
        rows = []
        with self._lock:
            seen = set()
            for path in find_runs(self.root):
                if self.store(path) is None:  # a store linked in from outside the root is not shown
                    continue
                seen.add(path)
                stamp = updated(path)
                cached = self._rows.get(path)
                if cached is None or cached[0] != stamp or cached[1].get("status") == "running":
                    row = describe_run(path, self.root)
                    row.pop("path", None)
                    row["id"] = self.run_id(path)
                    row["run"] = row["id"] if row["id"] != "." else encoding.readable(path.name)
                    self._rows[path] = cached = (stamp, row)
                rows.append(cached[1])
            for gone in set(self._rows) - seen:
                del self._rows[gone]
        return sorted(rows, key=lambda r: (-r["updated"], r["id"]))


# ------------------------------------------------------------------ per-layer envelopes
@dataclass
class _Entry:
    envelope: downsample.Envelope
    names: list[str]
    row: int = 0  # newest vector row folded in
    lock: threading.Lock = field(default_factory=threading.Lock)


class Envelopes:
    """Per (run, metric) envelopes of every layer, shared by requests, least recently used evicted.

    Args:
        budget: bytes the envelopes may hold together.
        capacity: buckets per envelope.
    """

    def __init__(self, budget: int = 512 * 2**20, capacity: int = 1024) -> None:
        self.budget = budget
        self.capacity = capacity
        self._entries: OrderedDict[tuple[Path, str, int], _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, run: Run, metric: str) -> _Entry:
        """The envelope of ``metric`` over ``run``'s layers, brought up to date with the store."""
        key = (run.path.resolve(), metric, run.restart_count())  # a restart supersedes steps: read afresh
        names = run.layers
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.names != names:
                entry = _Entry(downsample.Envelope(len(names), self.capacity), names)
                self._entries[key] = entry
            self._entries.move_to_end(key)
            while sum(e.envelope.nbytes for e in self._entries.values()) > self.budget and len(self._entries) > 1:
                self._entries.popitem(last=False)
        with entry.lock:
            new = run.written_since(metric, entry.row)
            if new is not None:
                first, last, newest = new
                for start in range(first, last + 1, CHUNK):
                    frame = run.matrix(metric, steps=slice(start, min(start + CHUNK, last + 1)))
                    if list(frame.columns) != entry.names:  # the model grew meanwhile: next request starts over
                        entry.names = list(frame.columns)
                        break
                    if len(frame):
                        entry.envelope.add(frame.index.to_numpy(dtype=np.int64), frame.to_numpy(dtype=np.float32))
                else:
                    entry.row = newest
        return entry


# ------------------------------------------------------------------ global series
class Curves:
    """Per (run, name) global series held in memory, extended by reading only the steps not read yet.

    Args:
        limit: series kept together (least recently used dropped).
    """

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._series: OrderedDict[tuple[Path, Any, int, str], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, run: Run, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of a global scalar, up to date with the store."""
        # a run written again afresh is another run; a restart supersedes steps: read afresh
        key = (run.path.resolve(), run.meta.get("created"), run.restart_count(), name)
        with self._lock:
            cached = self._series.get(key)
        if cached is None:
            steps, values = run.series(name)
        else:
            old_steps, old_values = cached
            start = int(old_steps[-1]) if len(old_steps) else 0  # the newest step is read again: it may have changed
            new_steps, new_values = run.series(name, slice(start, None))
            keep = old_steps < start
            steps = np.concatenate([old_steps[keep], new_steps])
            values = np.concatenate([old_values[keep], new_values])
        with self._lock:
            self._series[key] = (steps, values)
            self._series.move_to_end(key)
            while len(self._series) > self.limit:
                self._series.popitem(last=False)
        return steps, values


# ------------------------------------------------------------------ views of one run
def _range(start: int | None, stop: int | None) -> tuple[int, int | None]:
    lo = 0 if start is None else start
    if lo < 0 or (stop is not None and stop <= lo):
        raise BadRequest(f"the step range {start}..{stop} is empty or negative")
    return lo, stop


def _stop(run: Run, lo: int, hi: int | None) -> int:
    """The end of a step range: ``hi``, or one past the run's last step when the range is open."""
    if hi is not None:
        return hi
    last = run.progress()["last_step"]
    return last + 1 if last is not None else lo


def summary(run: Run, run_id: str) -> dict[str, Any]:
    """The run's header: name, status, verdict, headline, facts and its layers in model order."""
    meta = run.meta
    progress = run.progress()
    status = progress["status"]
    found = run.findings()
    counts = report_summary.counts(found)
    state = report_summary.state(status, counts)
    listed = explained.items(run, found)
    steps_info = run.step_info()
    lr_steps, lr = run.series("lr")
    scalars = pd.DataFrame({"lr": lr}, index=lr_steps)
    info = run.layer_info()
    return {
        "id": run_id,
        "name": encoding.readable(run.path.name) if run_id == "." else run_id,
        "model": meta.get("model"),
        "status": status,
        "status_detail": verdict.describe(ended := run.ended),
        "state": state,
        "counts": counts,
        "headline": report_summary.headline(state, status, counts, listed, progress["steps"], live=True,
                                            halted=verdict.halted(run.path) if status == "halted" else None,
                                            ended=ended),
        "facts": [[k, v] for k, v in report_summary.facts(run, meta, status, steps_info, scalars)],
        "layers": [{"name": n, "type": t, "params": int(p)}
                   for n, t, p in zip(info["layer"], info["type"], info["params"])],
        "metrics": [{"metric": m, "title": t, "log": lg} for m, (t, lg) in METRICS.items()],
        **progress,
    }


def curves(run: Run, cache: Curves, start: int | None = None, stop: int | None = None) -> dict[str, Any]:
    """Global curves (gradient norm, loss, learning rate) over a step range, the skipped steps and the restarts."""
    lo, hi = _range(start, stop)
    steps = slice(lo, hi)
    out: dict[str, Any] = {}
    log_loss = False
    for name in CURVES:
        s, v = cache.get(run, name)
        if name == "loss":
            log_loss = marks.loss_log(v)  # over the whole run, as the report decides it
        a, b = np.searchsorted(s, lo), (len(s) if hi is None else np.searchsorted(s, hi))
        s, v = s[a:b], v[a:b]
        if len(s):
            s, v = downsample.minmax(s, v, MAX_POINTS)
            out[name] = {"steps": s.tolist(), "values": _finite(v)}
            if name == "loss":
                out[name]["log"] = log_loss
    skipped = run.skipped_steps(steps)
    if len(skipped) > MAX_SKIPPED:
        skipped = skipped[np.linspace(0, len(skipped) - 1, MAX_SKIPPED).astype(np.int64)]
    restarts = [r["step"] for r in run.restarts if lo <= r["step"] and (hi is None or r["step"] < hi)]
    return {"start": lo, "stop": hi, "curves": out, "skipped": skipped.tolist(), "restarts": restarts}


def findings(run: Run) -> dict[str, Any]:
    """The findings explained (outcome, hint, remedies), most severe first, at most ``MAX_FINDINGS``."""
    listed = explained.items(run, run.findings())
    return {"total": len(listed), "findings": _explained(listed)}


def _explained(listed: list[explained.Item]) -> list[dict[str, Any]]:
    """Findings for JSON, most severe first, at most ``MAX_FINDINGS``."""
    out = []
    for item in explained.card_order(listed)[:MAX_FINDINGS]:
        kind = explain(item.kind)
        out.append({
            "index": item.index, "step": item.step, "kind": item.kind, "title": kind.title,
            "severity": item.severity, "layer": item.layer, "phase": item.phase, "where": item.where,
            "message": item.message, "action": item.action, "outcome": item.outcome, "hint": item.hint,
            "repeats": item.repeats, "last_step": item.last_step, "restored_step": item.restored_step,
            "remedies": list(kind.remedies), "root_cause": [list(pair) for pair in item.root_cause],
        })
    return out


def flow(run: Run, step: int | None = None) -> dict[str, Any]:
    """Per-layer gradient norm at ``step`` (default: the latest step) and at the first step, in model order."""
    names = run.layers
    last = run.progress()["last_step"]
    if last is None:
        return {"step": None, "first_step": None, "layers": [], "values": [], "first": []}
    at = last if step is None else step
    if at < 0:
        raise BadRequest(f"step must not be negative, got {at}")
    row = run.measured_at("grad_norm", at)  # the newest step at or before ``at`` with gradient norms
    stored = run.written_since("grad_norm")
    if row is None or stored is None:
        return {"step": None, "first_step": None, "layers": names, "values": [], "first": []}
    first = stored[0]
    now = run.matrix("grad_norm", steps=slice(row, row + 1))
    then = run.matrix("grad_norm", steps=slice(first, first + 1)).reindex(columns=now.columns)
    if not (len(now) and len(then)):  # the store's index named a step whose vectors it does not return
        raise DamagedStoreError(f"the run store of {str(run.path)!r} is damaged: the gradient norms of steps "
                                f"{first} and {row} are indexed but cannot be read")
    values, before = now.to_numpy()[0], then.to_numpy()[0]
    keep = np.isfinite(values) | np.isfinite(before)  # layers with parameters that had a gradient
    layers = [n for n, k in zip(now.columns, keep) if k]
    flagged, earlier = marks.flow_marks(run.findings(), int(row), layers)  # the state of the step shown
    bad = run.matrix("grad_nonfinite", steps=slice(row, row + 1)).reindex(columns=now.columns).to_numpy()
    nonfinite = [n for n, k, b in zip(now.columns, keep, bad[0] if len(bad) else []) if k and b > 0]
    return {"step": int(row), "first_step": int(first), "layers": layers, "values": _finite(values[keep]),
            "first": _finite(before[keep]), "flagged": flagged, "earlier": earlier, "nonfinite": nonfinite}


def _metric(metric: str) -> tuple[str, bool]:
    if metric not in METRICS:
        raise BadRequest(f"unknown metric {metric!r}; valid metrics are: {', '.join(METRICS)}")
    return METRICS[metric]


def _raw(run: Run, metric: str, lo: int, hi: int | None) -> tuple[np.ndarray, np.ndarray] | None:
    """Full-resolution rows of a short range, or None when the range is long."""
    end = _stop(run, lo, hi)
    if end - lo > RAW_STEPS:
        return None
    frame = run.matrix(metric, steps=slice(lo, end))
    return frame.index.to_numpy(dtype=np.int64), frame.to_numpy(dtype=np.float32)


def heatmap(run: Run, cache: Envelopes, metric: str, start: int | None = None,
            stop: int | None = None) -> dict[str, Any]:
    """Layers x steps of one metric (log10 for norms and ratios), at most ``MAX_ROWS`` x ``MAX_COLUMNS``."""
    title, log = _metric(metric)
    lo, hi = _range(start, stop)
    entry = cache.get(run, metric)
    names = entry.names
    steps, low, high = entry.envelope.view(lo, hi)
    raw = _raw(run, metric, lo, hi) if len(steps) < RAW_BUCKETS and entry.envelope.scale > 1 else None
    exact = raw is not None or entry.envelope.scale == 1  # buckets of one step hold the values themselves
    if raw is not None:
        steps, table = raw
        if list(run.layers) != names:  # the model grew: columns follow the newest layout
            names = run.layers
    else:
        table = downsample.largest(low, high)
    steps, table = downsample.columns(steps, table, MAX_COLUMNS) if len(steps) else (steps, table)
    z = table.T
    if log:
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(z > 0, np.log10(np.where(z > 0, z, 1.0)), np.nan)
    rows = np.flatnonzero(np.isfinite(z).any(axis=1)) if z.size else np.zeros(0, dtype=np.int64)
    note = ""
    if len(rows) > MAX_ROWS:
        listed = explained.items(run, run.findings())
        rows, note = select_rows(rows, z, names, listed)
    width = int(steps[1] - steps[0]) if len(steps) > 1 else 1
    if width > 1:
        note = (note + " " if note else "") + f"Each column covers about {width:,} steps and shows its largest value."
    return {
        "metric": metric, "title": title, "log": log, "start": lo, "stop": hi, "exact": bool(exact),
        "steps": steps.tolist(), "layers": [names[r] for r in rows],
        "z": _cells(z[rows], 2 if log else 3), "note": note,
    }


def layer(run: Run, cache: Envelopes, name: str, start: int | None = None, stop: int | None = None) -> dict[str, Any]:
    """One layer's series of every per-layer metric over a step range, and its findings.

    Short ranges are exact (``values``); long ones give each bucket's ``low`` and ``high``.
    """
    lo, hi = _range(start, stop)
    names = run.layers
    if name not in names:
        raise NotFound(name)
    series: dict[str, Any] = {}
    end = _stop(run, lo, hi)
    exact = end - lo <= RAW_STEPS
    if exact:
        try:
            frame = run.metrics(list(METRICS), layers=[name], steps=slice(lo, end), include_global=False)
        except ValueError as exc:  # a layer run.layers lists and the store does not know: its indexes disagree
            raise DamagedStoreError(f"the run store of {str(run.path)!r} is damaged: {exc}") from None
        for metric, group in frame.groupby("metric", sort=False):
            s, v = downsample.minmax(group["step"].to_numpy(), group["value"].to_numpy(), MAX_POINTS)
            series[str(metric)] = {"steps": s.tolist(), "values": _finite(v)}
    else:
        for metric in METRICS:
            entry = cache.get(run, metric)
            if name not in entry.names:
                continue
            steps, low, high = entry.envelope.view(lo, hi)
            k = entry.names.index(name)
            keep = ~(np.isnan(low[:, k]) & np.isnan(high[:, k]))
            if keep.any():
                series[metric] = {"steps": steps[keep].tolist(), "low": _finite(low[keep, k]),
                                  "high": _finite(high[keep, k])}
    found = _explained([i for i in explained.items(run, run.findings()) if i.layer == name])
    info = run.layer_info().set_index("layer").loc[name]
    return {"layer": name, "type": str(info["type"]), "params": int(info["params"]), "start": lo, "stop": hi,
            "exact": exact, "series": {m: series[m] for m in METRICS if m in series},
            "metrics": {m: {"title": t, "log": lg} for m, (t, lg) in METRICS.items()}, "findings": found}
