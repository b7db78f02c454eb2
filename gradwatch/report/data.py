"""Report data: what the HTML report shows, read from a run once and reduced to a bounded size."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from gradwatch.report import items as explained
from gradwatch.report import summary, text
from gradwatch.report.items import Item
from gradwatch.store import downsample, verdict
from gradwatch.store.reader import Run

#: points per curve on the step axis (extrema kept)
MAX_POINTS = 2000
#: heatmap size: step columns and layer rows
MAX_COLUMNS = 400
MAX_ROWS = 200
#: steps read per query when streaming per-layer metrics
CHUNK = 2048

#: heatmap metrics, in tab order: (metric, title, log10 scale)
HEATMAPS = (
    ("grad_norm", "gradient norm", True),
    ("act_norm", "activation norm", True),
    ("update_ratio", "update ratio", True),
    ("act_zero_frac", "zero fraction", False),
    ("act_sat_frac", "saturated fraction", False),
)


@dataclass
class Series:
    """A curve on the step axis (already downsampled)."""

    steps: np.ndarray
    values: np.ndarray


@dataclass
class Heat:
    """One heatmap: layers x step buckets."""

    metric: str
    title: str
    log: bool
    steps: np.ndarray
    layers: list[str]
    z: np.ndarray  # layers x columns, float32; log10 for log metrics
    note: str


@dataclass
class Flow:
    """Per-layer gradient norms at a few chosen steps, in model order."""

    layers: list[str]
    types: list[str]
    lines: list[tuple[str, int, np.ndarray]]  # (label, step, values per layer)


@dataclass
class LayerRow:
    """One row of the layer table."""

    layer: str
    type: str
    params: int
    grad_final: float
    grad_min: float
    grad_max: float
    ratio_final: float
    flags: list[str]


@dataclass
class Report:
    """Everything the report shows."""

    name: str
    path: str
    status: str
    state: str  # healthy, warnings, errors, halted
    headline: str
    facts: list[tuple[str, str]]
    counts: dict[str, int]
    items: list[Item]
    loss: Series | None
    grad: Series | None
    skipped: np.ndarray
    flow: Flow
    heats: list[Heat]
    layers: list[LayerRow]
    notes: list[str] = field(default_factory=list)
    layers_note: str = ""  # which layers have no gradient norm, and why
    restarts: list[int] = field(default_factory=list)  # the steps a resumed run's later processes went on from
    generated: float = field(default_factory=time.time)


# --------------------------------------------------------------- reading
def _stream(run: Run, metrics: list[str], first: int, last: int) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Per-layer metrics as (metric, steps, rows over ``run.layers``), ``CHUNK`` steps at a time.

    Chunked reads keep memory bounded on long runs.
    """
    for start in range(first, last + 1, CHUNK):
        for metric in metrics:
            frame = run.matrix(metric, steps=slice(start, start + CHUNK))
            if len(frame):
                yield metric, frame.index.to_numpy(dtype=np.int64), frame.to_numpy(dtype=np.float32)


class _Acc:
    """Running per-layer statistics of one metric, and its heatmap buckets."""

    def __init__(self, starts: np.ndarray, width: int) -> None:
        self.columns = downsample.Columns(starts, width, "max")
        self.final = np.full(width, np.nan)
        self.final_step = np.full(width, -1, dtype=np.int64)
        self.low = np.full(width, np.nan)
        self.high = np.full(width, np.nan)
        self.first: tuple[int, np.ndarray] | None = None
        self.last: tuple[int, np.ndarray] | None = None
        self.seen = False

    def add(self, steps: np.ndarray, rows: np.ndarray) -> None:
        """Fold rows (one per step, over ``run.layers``) into the statistics."""
        self.columns.add(steps, rows)
        finite = np.isfinite(rows)
        if not finite.any():
            return
        self.seen = True
        clean = np.where(finite, rows, np.nan)
        self.low = np.fmin(self.low, np.fmin.reduce(clean, axis=0))
        self.high = np.fmax(self.high, np.fmax.reduce(clean, axis=0))
        order = np.argsort(steps, kind="stable")
        s, f, r = steps[order], finite[order], rows[order]
        has = f.any(axis=0)
        at = len(s) - 1 - np.argmax(f[::-1], axis=0)
        newer = has & (s[at] > self.final_step)
        cols = np.flatnonzero(newer)
        self.final[cols] = r[at[cols], cols]
        self.final_step[cols] = s[at[cols]]
        useful = np.flatnonzero(f.any(axis=1))
        if len(useful):
            i, j = useful[0], useful[-1]
            if self.first is None or s[i] < self.first[0]:
                self.first = (int(s[i]), r[i].copy())
            if self.last is None or s[j] > self.last[0]:
                self.last = (int(s[j]), r[j].copy())


def collect(run: Run, name: str | None = None) -> Report:
    """Read a run and reduce it to what the report shows (bounded whatever the run's size)."""
    meta = run.meta
    status = run.status
    info = run.layer_info()
    names = list(info["layer"])
    types = dict(zip(info["layer"], info["type"]))
    scalars = run.scalars()
    steps_info = run.step_info()
    findings = run.findings()
    last = int(steps_info["step"].max()) if len(steps_info) else -1
    first = int(steps_info["step"].min()) if len(steps_info) else 0

    counts = summary.counts(findings)
    state = summary.state(status, counts)

    grad_global = scalars["grad_norm"] if "grad_norm" in scalars else pd.Series(dtype=float)
    loss = scalars["loss"] if "loss" in scalars else None

    # one pass over the per-layer metrics
    wanted = ["grad_norm"] + [m for m, _, _ in HEATMAPS if m != "grad_norm"]
    starts = downsample.bucket_starts(first, max(last, first), MAX_COLUMNS)
    accs = {m: _Acc(starts, len(names)) for m in wanted}
    error_steps = sorted({int(s) for s in findings.loc[findings["severity"] == "error", "step"]})[:20]
    captured: dict[int, np.ndarray] = {}
    peak: tuple[float, int, np.ndarray | None] = (-math.inf, -1, None)
    global_by_step = grad_global.to_dict()
    if last >= 0:
        for metric, block_steps, rows in _stream(run, wanted, first, last):
            accs[metric].add(block_steps, rows)
            if metric != "grad_norm":
                continue
            for step in error_steps:
                hit = np.flatnonzero(block_steps == step)
                if len(hit):
                    captured[step] = rows[hit[0]].copy()
            norms = np.array([global_by_step.get(int(s), np.nan) for s in block_steps], dtype=np.float64)
            norms[~np.isfinite(rows).any(axis=1)] = np.nan
            if np.isfinite(norms).any():
                i = int(np.nanargmax(norms))
                if norms[i] > peak[0]:
                    peak = (float(norms[i]), int(block_steps[i]), rows[i].copy())

    flow = _flow(names, types, accs["grad_norm"], error_steps, captured, peak)
    items = explained.items(run, findings, scalars)
    heats = [h for m, title, log in HEATMAPS if (h := _heat(m, title, log, accs[m], names, items)) is not None]
    layers = _layer_rows(info, accs["grad_norm"], accs["update_ratio"], findings)

    skipped = steps_info.loc[steps_info["skipped"], "step"].to_numpy(dtype=np.int64)
    notes = []
    if len(skipped) > MAX_POINTS:
        notes.append(f"{len(skipped):,} skipped steps: an even sample of {MAX_POINTS:,} is marked.")
        skipped = skipped[np.linspace(0, len(skipped) - 1, MAX_POINTS).astype(np.int64)]
    facts = summary.facts(run, meta, status, steps_info, scalars)
    return Report(
        name=name or run.path.name,
        path=str(run.path),
        status=status,
        state=state,
        headline=summary.headline(state, status, counts, items, run.steps, halted=verdict.halted(run.path),
                                  ended=run.ended),
        facts=facts,
        counts=counts,
        items=items,
        loss=_series(loss),
        grad=_series(grad_global) if len(grad_global) else None,
        skipped=skipped,
        flow=flow,
        heats=heats,
        layers=layers,
        notes=notes,
        restarts=[r["step"] for r in run.restarts],
        layers_note=text.without_gradients([(r.layer, r.type, r.params, math.isfinite(r.grad_max)) for r in layers]),
    )


def _series(values: pd.Series | None) -> Series | None:
    if values is None or not len(values):
        return None
    s, v = downsample.minmax(values.index.to_numpy(dtype=np.int64), values.to_numpy(dtype=np.float64), MAX_POINTS)
    return Series(s, v)


# --------------------------------------------------------------- per-layer views
def _flow(names: list[str], types: dict[str, str], acc: _Acc, error_steps: list[int],
          captured: dict[int, np.ndarray], peak: tuple[float, int, np.ndarray | None]) -> Flow:
    has = np.isfinite(acc.high)
    cols = np.flatnonzero(has)
    layers = [names[c] for c in cols]
    lines: list[tuple[str, int, np.ndarray]] = []
    if acc.first is None or acc.last is None:
        return Flow(layers, [types[n] for n in layers], lines)
    worst: tuple[str, int, np.ndarray] | None = None
    for step in error_steps:
        row = captured.get(step)
        if row is not None and np.isfinite(row[cols]).any():
            worst = ("first error", step, row)
            break
    if worst is None and peak[2] is not None:
        worst = ("largest global norm", peak[1], peak[2])
    lines.append(("first", acc.first[0], acc.first[1][cols]))
    if worst is not None and worst[1] not in (acc.first[0], acc.last[0]):
        lines.append((worst[0], worst[1], worst[2][cols]))
    if acc.last[0] != acc.first[0]:
        lines.append(("last", acc.last[0], acc.last[1][cols]))
    return Flow(layers, [types[n] for n in layers], lines)


def _heat(metric: str, title: str, log: bool, acc: _Acc, names: list[str], items: list[Item]) -> Heat | None:
    if not acc.seen:
        return None
    steps, table = acc.columns.result()
    z = table.T  # layers x columns
    rows = np.flatnonzero(np.isfinite(z).any(axis=1))
    if not len(rows) or not len(steps):
        return None
    if log:
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(z > 0, np.log10(np.where(z > 0, z, 1.0)), np.nan)
    note = ""
    if len(rows) > MAX_ROWS:
        rows, note = select_rows(rows, z, names, items)
    span = int(steps[-1] - steps[0] + 1) if len(steps) else 0
    if len(steps) >= MAX_COLUMNS * 0.9 and span > len(steps):
        note = (note + " " if note else "") + (
            f"Each column is a range of about {span // len(steps):,} steps showing its largest value.")
    return Heat(metric, title, log, steps.astype(np.int32), [names[r] for r in rows],
                z[rows].astype(np.float32), note)


def select_rows(rows: np.ndarray, z: np.ndarray, names: list[str], items: list[Item]) -> tuple[np.ndarray, str]:
    """At most MAX_ROWS layers: those with findings, the extremes, and an even sample of the rest."""
    flagged = {i.layer for i in items if i.layer is not None}
    position = {names[r]: k for k, r in enumerate(rows)}
    chosen = [0, len(rows) - 1]  # the first and the last layer frame the picture
    chosen += [position[n] for n in names if n in flagged and n in position][: MAX_ROWS // 2]
    with np.errstate(all="ignore"):
        level = np.nanmedian(z[rows], axis=1)
    order = np.argsort(np.where(np.isfinite(level), level, np.inf), kind="stable")
    extremes = 40
    chosen_set = set(chosen)
    for k in [*order[:extremes], *order[::-1][:extremes]]:
        if len(chosen_set) >= MAX_ROWS:
            break
        chosen_set.add(int(k))
    rest = [k for k in range(len(rows)) if k not in chosen_set]
    room = MAX_ROWS - len(chosen_set)
    if room > 0 and rest:
        chosen_set.update(rest[int(j)] for j in np.linspace(0, len(rest) - 1, min(room, len(rest))).astype(int))
    picked = rows[np.array(sorted(chosen_set), dtype=np.int64)]
    note = (f"Showing {len(picked):,} of {len(rows):,} layers: every layer with a finding, the {extremes} with the "
            f"smallest and the {extremes} with the largest values, and an even sample of the rest, in model order.")
    return picked, note


def _layer_rows(info: pd.DataFrame, grad: _Acc, ratio: _Acc, findings: pd.DataFrame) -> list[LayerRow]:
    flags: dict[str, set[str]] = {}
    for layer, kind in zip(findings["layer"], findings["kind"]):
        if isinstance(layer, str):
            flags.setdefault(layer, set()).add(str(kind))
    return [
        LayerRow(layer=name, type=str(typ), params=int(params), grad_final=float(grad.final[i]),
                 grad_min=float(grad.low[i]), grad_max=float(grad.high[i]), ratio_final=float(ratio.final[i]),
                 flags=sorted(flags.get(name, ())))
        for i, (name, typ, params) in enumerate(zip(info["layer"], info["type"], info["params"]))
    ]

