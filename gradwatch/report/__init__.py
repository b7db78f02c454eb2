"""Report: a recorded run as one self-contained HTML page (``gradwatch report``).

``write(run)`` reads the run once (bounded memory, downsampled curves and heatmaps), renders the
Jinja template ``gradwatch.dashboards/templates/report.html.j2`` with plotly figures and writes
``<run>/report.html`` atomically; ``render(run)`` returns the page as a string.
"""

from __future__ import annotations

from gradwatch.report.data import Report, collect
from gradwatch.report.render import DEFAULT_NAME, html, render, write

__all__ = ["DEFAULT_NAME", "Report", "collect", "html", "render", "write"]
