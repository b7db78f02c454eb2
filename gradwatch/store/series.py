"""Store reader, series: a run's scalar and per-layer series, read in blocks and shaped for pandas."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from gradwatch.store import decode
from gradwatch.store import names as _names
from gradwatch.store.layouts import Layouts
from gradwatch.store.records import LAYER, PARAM


@dataclass
class _Block:
    """Vectors of one metric stored under one layout: rows are steps, columns entries."""

    metric: str
    names: list[str]
    steps: np.ndarray
    values: np.ndarray
    present: np.ndarray


#: up to this many entries are sliced out of raw vectors inside SQLite
_SLICE_LIMIT = 64


def where_clause(column: str, names: list[str] | None, steps: slice | None) -> tuple[str, list[Any]]:
    """A WHERE clause keeping rows whose ``column`` is in ``names`` and whose step is in ``steps``."""
    where, args = "1", []
    if names is not None:
        where += f" AND {column} IN ({','.join('?' * len(names))})"
        args += names
    if steps is not None and steps.start is not None:
        where += " AND step >= ?"
        args.append(steps.start)
    if steps is not None and steps.stop is not None:
        where += " AND step < ?"
        args.append(steps.stop)
    return where, args


def bounds(steps: slice | None, end: int) -> tuple[int, int]:
    """The first step and the end (exclusive) of ``steps`` (a ``slice(start, stop)``, None: all) within 0..end."""
    if steps is None:
        return 0, end
    return max(0, steps.start or 0), end if steps.stop is None else min(end, steps.stop)


def _bits(mask: bytes, cols: list[int]) -> np.ndarray:
    flags = np.unpackbits(np.frombuffer(mask, dtype=np.uint8))
    return flags[cols].astype(bool)


class Series(Layouts):
    """The series half of :class:`gradwatch.store.reader.Run` (``scalars``, ``series``, ``metrics``,
    ``matrix`` ...), read along the run's layouts; the run's connection and metadata come from the run itself.
    """

    def _scalar_rows(self, names: list[str] | None, steps: slice | None) -> pd.DataFrame:
        """Global scalars in long form (step, metric, value); a stored NaN stays a row."""
        where, args = where_clause("name", names, steps)
        frame = pd.DataFrame(self._query(f"SELECT step, name, value FROM scalars WHERE {where}", args),
                             columns=["step", "metric", "value"])
        with decode.decoding(self._db, "the global scalars"):
            if not all(isinstance(m, str) for m in frame["metric"]):
                raise TypeError("a scalar's name is not text")
            if len(frame) and (not pd.api.types.is_integer_dtype(frame["step"]) or (frame["step"] < 0).any()):
                raise TypeError("a step is not a whole number >= 0")
            frame["step"] = frame["step"].astype("int64")
            frame["value"] = pd.to_numeric(frame["value"], errors="raise").astype("float64")  # NULL is NaN
        return frame

    def scalars(self, names: Iterable[str] | None = None) -> pd.DataFrame:
        """Global per-step numbers (``grad_norm``, ``loss``, ``lr``, observed values), wide by step.

        Raises:
            ValueError: a name that is neither one of gradwatch's scalars nor stored in the run.
        """
        wanted = [names] if isinstance(names, str) else (list(names) if names is not None else None)
        if wanted is not None:
            self._check_metrics(wanted, ())
        long = self._scalar_rows(wanted, None)
        wide = long.pivot(index="step", columns="metric", values="value")
        wide.columns.name = None
        wide.index = wide.index.astype("int64")
        return wide.sort_index()

    def series(self, name: str, steps: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One global scalar (``grad_norm``, ``loss`` ...) as ``(steps, values)`` arrays, in step order.

        The fast path for long runs (no DataFrame); a stored NaN or NULL is NaN. ``steps`` is a
        ``slice(start, stop)`` of steps.

        Raises:
            ValueError: a name that is neither one of gradwatch's scalars nor stored in the run.
        """
        self._check_metrics([name], ())
        where, args = where_clause("name", [name], steps)
        rows = self._query(f"SELECT step, value FROM scalars WHERE {where} ORDER BY step", args)
        if not rows:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        with decode.decoding(self._db, f"the series {name!r}"):
            if any(isinstance(v, (str, bytes)) for row in rows for v in row):
                raise ValueError("a step or value that is not a number")
            table = np.array(rows, dtype=np.float64)  # NULL becomes NaN
            if not np.array_equal(table[:, 0], np.floor(table[:, 0])) or (table[:, 0] < 0).any():  # NaN, -1, 0.5
                raise ValueError("a step is not a whole number >= 0")
            return table[:, 0].astype(np.int64), table[:, 1]

    def skipped_steps(self, steps: slice | None = None) -> np.ndarray:
        """Steps whose update was not applied (a skip action, a rollback, a GradScaler overflow)."""
        where, args = where_clause("skipped", None, steps)
        rows = self._query(f"SELECT step FROM steps WHERE skipped = 1 AND {where} ORDER BY step", args)
        return np.array([decode.integer(self._db, "a step", r[0]) for r in rows], dtype=np.int64)

    def measured_at(self, metric: str, at: int | None = None, scope: str = LAYER) -> int | None:
        """The newest step at or before ``at`` (default: any) that stored ``metric``, or None."""
        sql = "SELECT MAX(step) FROM vectors WHERE scope = ? AND metric = ?"
        args: list[Any] = [scope, metric]
        if at is not None:
            sql += " AND step <= ?"
            args.append(at)
        (step,), = self._query(sql, args)
        return None if step is None else decode.integer(self._db, f"a step of {metric!r}", step)

    def step_info(self) -> pd.DataFrame:
        """One row per step: time, logged, sampled, skipped."""
        rows = self._query("SELECT step, time, logged, sampled, skipped FROM steps ORDER BY step")
        for row in rows:
            decode.integer(self._db, "a step", row[0])
            if not isinstance(row[1], (int, float)):
                raise decode.damaged(self._db, f"the time of step {row[0]} is not a number ({row[1]!r})")
        frame = pd.DataFrame(rows, columns=["step", "time", "logged", "sampled", "skipped"])
        for col in ("logged", "sampled", "skipped"):
            frame[col] = frame[col].astype(bool)
        return frame

    def _blocks(
        self, scope: str, metrics: list[str] | None, steps: slice | None, names: set[str] | None = None
    ) -> list[_Block]:
        """Stored vectors grouped by (metric, layout), decoded into 2-D arrays (steps x entries).

        With ``names``, only those entries are decoded; raw vectors are then sliced inside SQLite,
        so one layer's series costs a few bytes per step rather than a whole vector.
        """
        where, args = where_clause("metric", metrics, steps)
        where, args = f"scope = ? AND {where}", [scope, *args]
        blocks = []
        for (layout,) in self._query(f"SELECT DISTINCT layout FROM vectors WHERE {where}", args):
            all_names = self._entries(layout, scope)
            if not all_names:
                raise decode.damaged(self._db, f"vectors are stored for layout {layout!r}, which has no {scope} "
                                               "entries")
            cols = [i for i, n in enumerate(all_names) if names is None or n in names]
            if not cols:
                continue
            sliced = names is not None and len(cols) <= _SLICE_LIMIT
            select = "metric, step, codec, data, mask"
            if sliced:  # raw vectors: 4 bytes per wanted entry (and their size); compressed ones are decoded whole
                select = ("metric, step, codec, CASE codec WHEN 0 THEN NULL ELSE data END, mask, "
                          "CASE WHEN typeof(data) = 'blob' THEN length(data) END, ") + ", ".join(
                    f"CASE codec WHEN 0 THEN substr(data, {4 * c + 1}, 4) END" for c in cols
                )
            rows = self._query(f"SELECT {select} FROM vectors WHERE {where} AND layout = ? ORDER BY metric, step",
                               [*args, layout])
            by_metric: dict[str, list[tuple[Any, ...]]] = {}
            for row in rows:
                by_metric.setdefault(row[0], []).append(row[1:])
            idx = np.asarray(cols, dtype=np.intp)
            n = len(all_names)
            for metric, group in by_metric.items():
                values = np.empty((len(group), len(cols)), dtype=np.float32)
                present = np.empty((len(group), len(cols)), dtype=bool)
                for r, (step, codec, data, mask, *parts) in enumerate(group):
                    decode.integer(self._db, f"a step of {metric!r}", step)
                    if sliced and data is None:
                        size, parts = parts[0], parts[1:]
                        if codec != 0 or size != 4 * n or (mask is not None and
                                                           (not isinstance(mask, bytes) or len(mask) != (n + 7) // 8)):
                            decode.vector(self._db, codec, b"" if size is None else bytes(size), mask, n)  # says why
                        values[r] = np.frombuffer(b"".join(parts), dtype="<f4")
                        present[r] = True if mask is None else _bits(mask, cols)
                    else:
                        full, full_present = decode.vector(self._db, codec, data, mask, n)
                        values[r], present[r] = full[idx], full_present[idx]
                blocks.append(_Block(
                    metric=metric,
                    names=[all_names[c] for c in cols],
                    steps=np.array([g[0] for g in group], dtype=np.int64),
                    values=values,
                    present=present,
                ))
        return blocks

    def metrics(
        self,
        metrics: Iterable[str] | str | None = None,
        layers: Iterable[str] | str | None = None,
        steps: slice | None = None,
        *,
        per_parameter: bool = False,
        include_global: bool = True,
    ) -> pd.DataFrame:
        """Long-format metrics: one row per (step, layer, metric) with its value.

        Args:
            metrics: metric names to keep (default: all), e.g. ``"grad_norm"``.
            layers: layer names to keep (default: all).
            steps: a ``slice(start, stop)`` of steps to read (default: all).
            per_parameter: also return per-parameter rows, whose ``layer`` is the qualified
                parameter name (``fc1.weight``).
            include_global: include the global scalars (``grad_norm``, ``loss``, ``lr`` ...)
                as rows whose ``layer`` is None.

        Returns:
            DataFrame with columns ``step``, ``layer``, ``metric``, ``value``.

        Raises:
            ValueError: a metric that is neither one of gradwatch's nor stored in the run, or a
                layer (a parameter, with ``per_parameter``) that the run does not have; the
                message lists the valid names.
        """
        wanted_metrics = [metrics] if isinstance(metrics, str) else (list(metrics) if metrics else None)
        wanted_layers = {layers} if isinstance(layers, str) else (set(layers) if layers else None)
        scopes = (LAYER, PARAM) if per_parameter else (LAYER,)
        if wanted_metrics is not None:
            self._check_metrics(wanted_metrics, scopes, scalars=include_global)
        if wanted_layers is not None:
            valid = [n for scope in scopes for n in _names.stored_entries(self._query, scope)]
            if not per_parameter and (wanted_layers - set(valid)):
                params = set(_names.stored_entries(self._query, PARAM)) & (wanted_layers - set(valid))
                if params:
                    raise ValueError(f"{min(params)!r} is a parameter, not a layer: pass per_parameter=True "
                                     "to read per-parameter rows")
            where = "run.layers and run.parameters" if per_parameter else "run.layers"
            _names.check("layer", sorted(wanted_layers, key=str), valid, where)
        frames = []
        for scope in scopes:
            for block in self._blocks(scope, wanted_metrics, steps, wanted_layers):
                rows, cols = np.nonzero(block.present)
                frames.append(pd.DataFrame({
                    "step": block.steps[rows],
                    "layer": np.asarray(block.names, dtype=object)[cols],
                    "metric": block.metric,
                    "value": block.values[rows, cols].astype(np.float64),
                }))
        if include_global and wanted_layers is None:
            long = self._scalar_rows(wanted_metrics, steps)
            long.insert(1, "layer", None)
            frames.append(long)
        frames = [f for f in frames if not f.empty]
        if not frames:
            return pd.DataFrame({"step": pd.Series(dtype="int64"), "layer": pd.Series(dtype=object),
                                 "metric": pd.Series(dtype=object), "value": pd.Series(dtype="float64")})
        out = pd.concat(frames, ignore_index=True)
        out["step"] = out["step"].astype("int64")
        out["value"] = out["value"].astype("float64")
        return out.sort_values(["step", "metric"], kind="stable", ignore_index=True)

    def matrix(self, metric: str, *, scope: str = LAYER, steps: slice | None = None) -> pd.DataFrame:
        """One metric as a steps x layers table (NaN where not measured), for heatmaps.

        Columns follow the latest layout; layers that did not exist yet are NaN. ``steps``
        (a ``slice(start, stop)``) reads a range, so long runs can be read a chunk at a time.

        Raises:
            ValueError: an unknown ``scope`` (``layer`` or ``param``), a global scalar (read
                those with :meth:`scalars` or :meth:`series`), or a metric that is neither one of
                gradwatch's nor stored in the run; the message lists the valid ones.
        """
        _names.scope_of(scope)
        if metric not in _names.KNOWN_VECTORS and metric not in _names.stored_metrics(self._query, scope):
            if metric in (*_names.KNOWN_SCALARS, *_names.stored_metrics(self._query, "global")):
                raise ValueError(f"{metric!r} is a global scalar, not a per-{scope} metric: read it with "
                                 f"run.scalars() or run.series({metric!r})")
            self._check_metrics([metric], (scope,), scalars=False)
        names = self._entries(self._latest_layout(), scope)
        position = {n: i for i, n in enumerate(names)}
        parts = []
        for block in self._blocks(scope, [metric], steps):
            data = np.full((len(block.steps), len(names)), np.nan, dtype=np.float32)
            src = [i for i, n in enumerate(block.names) if n in position]
            dst = [position[block.names[i]] for i in src]
            data[:, dst] = np.where(block.present[:, src], block.values[:, src], np.nan)
            parts.append(pd.DataFrame(data, index=pd.Index(block.steps, name="step"), columns=names))
        if not parts:
            return pd.DataFrame(columns=names, index=pd.Index([], name="step", dtype="int64"), dtype=np.float32)
        return pd.concat(parts).sort_index()

    def _check_metrics(self, wanted: list[str], scopes: Iterable[str], *, scalars: bool = True) -> None:
        """Raise ValueError for a metric name that is neither gradwatch's own nor stored in the run.

        Names gradwatch measures are accepted without touching the store (a run that lacks one
        gives an empty result); only other names are looked up.
        """
        scopes = tuple(scopes)
        known = {*(_names.KNOWN_VECTORS if scopes else ()), *(_names.KNOWN_SCALARS if scalars else ())}
        if all(m in known for m in wanted):
            return
        stored = {m for scope in scopes for m in _names.stored_metrics(self._query, scope)}
        if scalars:
            stored |= set(_names.stored_metrics(self._query, "global"))
        _names.check("metric", wanted, sorted(known | stored), "see the metrics of run.metrics()")

    # ----------------------------------------------------------------- findings
