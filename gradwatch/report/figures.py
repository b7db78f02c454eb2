"""Report figures: plotly figures (as JSON safe inside HTML) and inline SVG sparklines."""

from __future__ import annotations

import html
import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from plotly.utils import PlotlyJSONEncoder

from gradwatch import encoding
from gradwatch.report.data import Flow, Heat, Report
from gradwatch.report.items import Item, Spark
from gradwatch.report.marks import loss_log
from gradwatch.report.text import fmt

#: severity colours (the page's CSS uses the same)
COLOURS = {"error": "#d92d20", "warning": "#e39c0b", "info": "#5b8def"}
#: the colour of the line marking where a resumed run went on (the dashboard's app.js uses the same)
RESTART = "#475467"
#: marker symbol of each action
SYMBOLS = {"warn": "circle", "clip": "diamond", "skip": "x", "rollback": "triangle-left", "halt": "square",
           "scale_lr": "star"}
FONT = dict(family="Inter, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif", size=12, color="#1f2933")
GRID = "#edf0f3"
#: most layer names written under the gradient-flow chart
MAX_TICKS = 24
#: characters never left raw in JSON embedded in HTML (``<`` ends a script, ``&`` starts an entity)
_UNSAFE = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))
#: plotly config for every figure
CONFIG = {"displaylogo": False, "responsive": True, "modeBarButtonsToRemove": ["lasso2d", "select2d"]}
#: a log axis whose values all lie in this range labels its ticks as plain numbers (the dashboard's app.js too)
PLAIN_LOG = (1e-3, 1e4)


def label(text: str) -> str:
    """Text for plotly (which reads a little HTML): every name shown literally."""
    return html.escape(text, quote=False)


def script_json(value: object) -> str:
    """JSON that is safe inside a ``<script>`` element (no ``<``, ``>`` or ``&``).

    numpy arrays travel as plotly's base64 typed arrays; a non-finite number is null (chart data: a gap;
    :mod:`gradwatch.encoding`), and the text is strict JSON.
    """
    text = encoding.dumps(value, cls=PlotlyJSONEncoder, beside=False, separators=(",", ":"))
    for char, escaped in _UNSAFE:
        text = text.replace(char, escaped)
    return text


def to_json(fig: go.Figure) -> str:
    """A figure as JSON that is safe inside a ``<script>`` element."""
    return script_json(fig.to_plotly_json())


def _base(fig: go.Figure, height: int) -> go.Figure:
    fig.update_layout(template=go.layout.Template(), height=height, font=FONT, paper_bgcolor="white",
                      plot_bgcolor="white", margin=dict(l=64, r=24, t=16, b=40), hoverlabel=dict(font=FONT))
    fig.update_xaxes(gridcolor=GRID, zeroline=False, linecolor="#c9d1d9", showline=True)
    fig.update_yaxes(gridcolor=GRID, zeroline=False, linecolor="#c9d1d9", showline=True)
    return fig


def log_axis(*series: object) -> dict[str, object]:
    """A log-scale axis on which every tick label reads as its value, for the values of ``series``.

    plotly labels the ticks between two powers of ten with their first digit alone, so that on an
    axis spanning less than a few decades 0.4 and 0.3 read "4" and "3" and 20 reads "2". Values
    within ``PLAIN_LOG`` are labelled as plain numbers (``~g``: 0.3, 0.5, 1, 2, 20); wider ones by
    powers of ten with every tick between them written whole (5x10^-1), so a zoom stays readable.
    The dashboard's ``logAxis`` (dashboards/web/app.js) decides the same way.
    """
    arrays = [np.asarray(s, dtype=np.float64).ravel() for s in series]
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    shown = values[np.isfinite(values) & (values > 0)]
    if not shown.size or (shown.min() >= PLAIN_LOG[0] and shown.max() <= PLAIN_LOG[1]):
        return dict(type="log", tickformat="~g")
    return dict(type="log", exponentformat="power", minorloglabels="complete")


def _steps(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


# --------------------------------------------------------------- timeline
def timeline(report: Report) -> go.Figure | None:
    """Loss, global gradient norm (log) and one lane per finding kind on a shared step axis.

    Rows without data are left out; None when the run has nothing to draw.
    """
    lanes = list(dict.fromkeys(i.kind for i in report.items)) + (["skipped step"] if len(report.skipped) else [])
    rows = [name for name, present in (("loss", report.loss is not None), ("grad", report.grad is not None),
                                       ("events", bool(lanes))) if present]
    if not rows:
        return None
    share = {"loss": 0.38, "grad": 0.42, "events": 0.2 if len(rows) > 1 else 1.0}
    fig = make_subplots(rows=len(rows), cols=1, shared_xaxes=True, vertical_spacing=0.05,
                        row_heights=[share[r] for r in rows])
    row = {name: k + 1 for k, name in enumerate(rows)}
    if report.loss is not None:
        fig.add_trace(go.Scatter(x=_steps(report.loss.steps), y=report.loss.values, name="loss", mode="lines",
                                 line=dict(color="#2f6fde", width=1.4),
                                 hovertemplate="step %{x}<br>loss %{y:.4g}<extra></extra>"), row=row["loss"], col=1)
        log = loss_log(report.loss.values)  # the dashboard's timeline decides the same way
        fig.update_yaxes(title_text="loss", **(log_axis(report.loss.values) if log else {}), row=row["loss"], col=1)
    if report.grad is not None:
        fig.add_trace(go.Scatter(x=_steps(report.grad.steps), y=report.grad.values, name="global grad norm",
                                 mode="lines", line=dict(color="#7c3aed", width=1.4),
                                 hovertemplate="step %{x}<br>grad norm %{y:.3g}<extra></extra>"),
                      row=row["grad"], col=1)
        fig.update_yaxes(title_text="grad norm", **log_axis(report.grad.values), row=row["grad"], col=1)
    curves = [row[r] for r in ("loss", "grad") if r in row]
    if lanes:
        _events(fig, report, lanes, row["events"], curves)
    for step, text in [(i.step, "halted" if i.action == "halt" else "") for i in report.items
                       if i.severity == "error" or i.action in ("halt", "rollback")][:30]:
        fig.add_vline(x=step, line=dict(color=COLOURS["error"], width=1, dash="dot"), opacity=0.5)
        if text:
            fig.add_annotation(x=step, y=1, xref="x", yref="paper", text=text, showarrow=False, yshift=8,
                               font=dict(color=COLOURS["error"], size=11))
    for step in report.restarts:  # a resumed run: where a later process went on (earlier steps from it superseded)
        fig.add_vline(x=step, line=dict(color=RESTART, width=1.2, dash="dash"))
        fig.add_annotation(x=step, y=1, xref="x", yref="paper", text="resumed", showarrow=False, yshift=8,
                           font=dict(color=RESTART, size=11), hovertext=f"the run resumed at step {step}")
    fig.update_xaxes(title_text="step", row=len(rows), col=1)
    fig.update_layout(showlegend=False, hovermode="closest")
    _base(fig, 170 * len(curves) + (40 + 30 * len(lanes) if lanes else 0) + 90)
    fig.update_yaxes(automargin=True)
    return fig


def _events(fig: go.Figure, report: Report, lanes: list[str], row: int, curves: list[int]) -> None:
    """The lanes: a marker per finding (grouped by kind, step and action), skipped steps, rollback arrows."""
    for severity in ("info", "warning", "error"):
        # one marker per (kind, step, action): ten layers vanishing at once are one marker listing them
        groups: dict[tuple[str, int, str], list[Item]] = {}
        for item in report.items:
            if item.severity == severity:
                groups.setdefault((item.kind, item.step, item.action or ""), []).append(item)
        if not groups:
            continue
        keys = list(groups)
        fig.add_trace(go.Scatter(
            x=_steps(np.array([k[1] for k in keys])), y=[lanes.index(k[0]) for k in keys], mode="markers",
            name=severity, customdata=[groups[k][0].index for k in keys],
            marker=dict(color=COLOURS[severity], size=[min(18, 11 + len(groups[k]) - 1) for k in keys],
                        symbol=[SYMBOLS.get(k[2], "circle-open") for k in keys], line=dict(width=1, color="white")),
            text=[_marker_text(groups[k], severity) for k in keys],
            hovertemplate="%{text}<extra></extra>"), row=row, col=1)
    if len(report.skipped):
        fig.add_trace(go.Scatter(x=_steps(report.skipped), y=[lanes.index("skipped step")] * len(report.skipped),
                                 mode="markers", name="skipped step",
                                 marker=dict(color="#8a94a6", size=9, symbol="line-ns-open", line=dict(width=2)),
                                 hovertemplate="step %{x} skipped<extra></extra>"), row=row, col=1)
    axis = "" if row == 1 else str(row)
    for item in report.items:
        if item.restored_step is None:
            continue
        lane = lanes.index(item.kind)
        fig.add_annotation(x=item.restored_step, y=lane, ax=item.step, ay=lane, xref=f"x{axis}", yref=f"y{axis}",
                           axref=f"x{axis}", ayref=f"y{axis}", showarrow=True, arrowhead=2, arrowsize=1.2,
                           arrowwidth=1.6, arrowcolor=COLOURS["error"], text="",
                           hovertext=f"rollback to step {item.restored_step}")
        fig.add_annotation(x=(item.step + item.restored_step) / 2, y=lane, xref=f"x{axis}", yref=f"y{axis}",
                           text=f"rollback → {item.restored_step}", showarrow=False, yshift=12,
                           font=dict(size=10, color=COLOURS["error"]))
        for curve in curves:  # the updates the rollback undid
            fig.add_vrect(x0=item.restored_step, x1=item.step, fillcolor=COLOURS["error"], opacity=0.07,
                          line_width=0, row=curve, col=1)
    fig.update_yaxes(tickvals=list(range(len(lanes))), ticktext=[label(x) for x in lanes],
                     range=[len(lanes) - 0.3, -0.7], showgrid=True, row=row, col=1)


def _marker_text(items: list[Item], severity: str) -> str:
    first = items[0]
    head = f"<b>{label(first.kind)}</b> · {severity} · step {first.step}"
    if len(items) == 1:
        where = label(first.where) + (f" · x{first.repeats}" if first.repeats > 1 else "")
    else:
        names = ", ".join(label(i.where) for i in items[:6]) + (f" and {len(items) - 6} more" if len(items) > 6 else "")
        where = f"{len(items)} findings: {names}"
    return f"{head}<br>{where}<br>action: {label(first.action or 'none')}"


# --------------------------------------------------------------- gradient flow
def flow(data: Flow) -> go.Figure:
    """Per-layer gradient norm at the chosen steps, in model order, on a log scale.

    The x axis is the layer's position; at most ``MAX_TICKS`` names label it, evenly spaced, and
    every layer's name is in its hover text.
    """
    fig = go.Figure()
    colours = {"first": "#8a94a6", "last": "#0f9960"}
    n = len(data.layers)
    x = np.arange(n, dtype=np.int32)
    names = [[label(name), label(typ)] for name, typ in zip(data.layers, data.types)]
    for name, step, values in data.lines:
        colour = colours.get(name, COLOURS["error"])
        fig.add_trace(go.Scatter(
            x=x, y=np.where(np.asarray(values) > 0, values, np.nan), customdata=names,
            name=f"{name} (step {step})", mode="lines+markers" if n <= 300 else "lines",
            line=dict(color=colour, width=1.6 if n <= 300 else 1.1), marker=dict(size=6 if n <= 60 else 3),
            hovertemplate="%{customdata[0]} (%{customdata[1]})<br>grad norm %{y:.3g}<extra>"
                          + label(f"{name}, step {step}") + "</extra>"))
    ticks = np.unique(np.linspace(0, n - 1, min(n, MAX_TICKS)).round().astype(int)) if n else np.zeros(0, int)
    fig.update_yaxes(**log_axis(*(values for _, _, values in data.lines)), title_text="grad norm")
    fig.update_xaxes(title_text="layer (input → output)", tickangle=-35 if n > 6 else 0, automargin=True,
                     tickvals=ticks.tolist(), ticktext=[names[t][0] for t in ticks], range=[-0.5, n - 0.5])
    fig.update_layout(legend=dict(orientation="h", y=1.1, x=0), hovermode="closest")
    _base(fig, 400)
    if n > 6 and data.layers:  # room for the first name, which slants left past the y axis
        fig.update_layout(margin=dict(l=min(240, max(64, int(6 * len(data.layers[0]) * 0.82) + 12))))
    return fig


# --------------------------------------------------------------- heatmaps
def heatmap(heat: Heat) -> go.Figure:
    """Layers x steps of one metric (log10 for norms and ratios)."""
    unit = f"log10 {heat.title}" if heat.log else heat.title
    scale = "Viridis" if heat.log else [[0, "#f7f9fc"], [0.5, "#f5a524"], [1, "#b42318"]]
    trace = go.Heatmap(
        z=heat.z, x=_steps(heat.steps), y=[label(n) for n in heat.layers], colorscale=scale,
        colorbar=dict(title=dict(text=label(unit), side="right"), thickness=12),
        hovertemplate="%{y}<br>step %{x}<br>" + label(unit) + " %{z:.3g}<extra></extra>",
        hoverongaps=False, zmin=None if heat.log else 0.0, zmax=None if heat.log else 1.0)
    fig = go.Figure(trace)
    fig.update_yaxes(type="category", autorange="reversed", automargin=True, title_text="layer")
    fig.update_xaxes(title_text="step")
    return _base(fig, int(min(900, max(300, 14 * len(heat.layers) + 110))))


# --------------------------------------------------------------- sparklines
def sparkline(spark: Spark, width: int = 260, height: int = 56) -> str:
    """An inline SVG of the evidence series; the finding's step is marked in red.

    The SVG holds only numbers and fixed text, so it needs no escaping.
    """
    steps = np.asarray(spark.steps, dtype=np.float64)
    values = np.asarray(spark.values, dtype=np.float64)
    shown = np.where(np.isfinite(values) & ((values > 0) if spark.log else True), values, np.nan)
    y = np.log10(np.where(np.isnan(shown), 1.0, shown)) if spark.log else np.nan_to_num(shown)
    y = np.where(np.isnan(shown), np.nan, y)
    pad = 4
    x0, x1 = float(steps.min()), float(max(steps.max(), spark.step))
    ok = np.isfinite(y)
    lo, hi = (float(y[ok].min()), float(y[ok].max())) if ok.any() else (0.0, 1.0)
    if hi - lo < 1e-12 * max(1.0, abs(hi)):  # a flat series, however large its value (1e16 + 0.5 is 1e16)
        half = 0.5 * max(1.0, abs(hi))
        lo, hi = lo - half, hi + half

    def px(s: float) -> float:
        return pad + (s - x0) / max(x1 - x0, 1.0) * (width - 2 * pad)

    def py(v: float) -> float:
        return height - pad - (v - lo) / (hi - lo) * (height - 2 * pad)

    path, pen = [], "M"
    for s, v in zip(steps, y):
        if not math.isfinite(v):
            pen = "M"
            continue
        path.append(f"{pen}{px(s):.1f} {py(v):.1f}")
        pen = "L"
    at = np.flatnonzero(steps == spark.step)
    mark_y = py(float(y[at[0]])) if len(at) and math.isfinite(y[at[0]]) else pad
    marker = (f'<line x1="{px(spark.step):.1f}" x2="{px(spark.step):.1f}" y1="0" y2="{height}" class="spark-at"/>'
              f'<circle cx="{px(spark.step):.1f}" cy="{mark_y:.1f}" r="3.2" class="spark-dot"/>')
    dots = "".join(f'<circle cx="{px(s):.1f}" cy="{py(v):.1f}" r="1.6" class="spark-pt"/>'
                   for s, v in zip(steps, y) if math.isfinite(v)) if len(steps) <= 12 else ""
    return (f'<svg class="spark" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">'
            f'{marker}<path d="{" ".join(path)}" class="spark-line"/>{dots}</svg>')


def spark_range(spark: Spark) -> str:
    """The shown range of the evidence series, for the caption."""
    values = np.asarray(spark.values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    if not len(finite):
        return "no finite values"
    return f"{fmt(float(finite.min()))} … {fmt(float(finite.max()))}"
