"""Report rendering: the report's data and figures through the Jinja template, written atomically."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup

from gradwatch.encoding import readable
from gradwatch.files import write_text_atomic
from gradwatch.report import figures
from gradwatch.report.bundle import plotly_bundle
from gradwatch.report.data import Report, collect
from gradwatch.report.items import MAX_CARDS, Item, card_order
from gradwatch.report.remedies import explain
from gradwatch.report.text import fmt
from gradwatch.store import owned
from gradwatch.store.reader import Run, open_run

TEMPLATE = "report.html.j2"
#: the report's default file name inside the run directory
DEFAULT_NAME = "report.html"


@functools.cache  # one per process: compiling the template takes longer than many a report's figures
def _environment() -> Environment:
    env = Environment(loader=PackageLoader("gradwatch.dashboards", "templates"), autoescape=True,
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = fmt
    env.filters["sortkey"] = lambda v: "" if v != v else f"{float(v):.6g}"  # no value (NaN) sorts last
    return env


def _groups(items: list[Item]) -> list[dict[str, Any]]:
    """The findings explained one by one, grouped by kind (most severe kind first)."""
    groups: dict[str, dict[str, Any]] = {}
    for item in card_order(items)[:MAX_CARDS]:
        group = groups.setdefault(item.kind, {"kind": item.kind, "explain": explain(item.kind), "items": [],
                                              "hints": []})
        group["items"].append(item)
        if item.hint and item.hint not in group["hints"]:
            group["hints"].append(item.hint)
    return list(groups.values())


def html(report: Report) -> str:
    """The report as one self-contained HTML page."""
    figs = {}
    timeline = figures.timeline(report)
    if timeline is not None:
        figs["timeline"] = figures.to_json(timeline)
    if report.flow.lines:
        figs["flow"] = figures.to_json(figures.flow(report.flow))
    for heat in report.heats:
        figs[f"heat-{heat.metric}"] = figures.to_json(figures.heatmap(heat))
    sparks = {i.index: Markup(figures.sparkline(i.spark)) for i in report.items if i.spark is not None}
    ranges = {i.index: figures.spark_range(i.spark) for i in report.items if i.spark is not None}
    template = _environment().get_template(TEMPLATE)
    return template.render(
        r=report,
        figs={k: Markup(v) for k, v in figs.items()},
        config=figures.CONFIG,
        sparks=sparks,
        ranges=ranges,
        groups=_groups(report.items),
        shown=min(len(report.items), MAX_CARDS),
        plotly=plotly_bundle(),
        generated=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.generated)),
        version=_version(),
    )


def _version() -> str:
    from gradwatch.version import __version__

    return __version__


def render(run: Run | str | os.PathLike[str], name: str | None = None) -> str:
    """Read a run (or the run at a path) and return its report as an HTML string."""
    if isinstance(run, Run):
        return readable(html(collect(run, name)))
    with open_run(run) as opened:
        return readable(html(collect(opened, name if name is not None else str(run))))


def write(run: str | os.PathLike[str], output: str | os.PathLike[str] | None = None) -> Path:
    """Write the report of the run at ``run`` to ``output`` (default ``<run>/report.html``), atomically.

    Raises:
        RunError: the run cannot be read.
        GradwatchError: the report cannot be written, or ``output`` is a file of a run (its store ...).
    """
    with open_run(run) as opened:
        target = Path(output) if output is not None else opened.path / DEFAULT_NAME
        owned.refuse(target, "the report", [run])  # never over a run's own files
        text = readable(html(collect(opened, str(run))))  # a non-ASCII path under any locale: its characters
    write_text_atomic(target, text, "the report")
    return target
