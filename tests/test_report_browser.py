"""The report in a real browser (headless Chromium via Playwright): drawn, clean console, safe, sortable."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest

import gradwatch as gw
from gradwatch.report import write
from tests.test_report import BIG_STEP, NAN_STEP, XSS_RUN, narrow, store_findings, synthetic, train

pytestmark = pytest.mark.slow  # a real browser

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = Path("/tmp/gradwatch-report.png")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with every kind of trouble the page has to show, under a hostile directory name and layer name."""
    path = tmp_path_factory.mktemp("browser").joinpath(*XSS_RUN)
    return train(path, nan_step=NAN_STEP, big_step=BIG_STEP, odd_layer=True)


def test_report_in_a_browser(browser, run: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    report = write(run)
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    problems: list[str] = []
    page.on("console", lambda msg: problems.append(f"console: {msg.text}") if msg.type == "error" else None)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("dialog", lambda dialog: (problems.append(f"dialog: {dialog.message}"), dialog.dismiss()))
    page.goto(report.resolve().as_uri())
    page.wait_for_selector("#fig-timeline .main-svg")

    # charts are drawn: timeline, gradient flow and the first heatmap (the others draw when their tab opens)
    drawn = page.locator(".js-plotly-plot")
    assert drawn.count() >= 3
    for i in range(drawn.count()):
        assert drawn.nth(i).locator(".main-svg").count() >= 1
    assert page.locator("#fig-timeline .scatterlayer .trace").count() >= 4, "loss, norm, markers, skipped steps"
    assert page.locator("#fig-heat-grad_norm .heatmaplayer image, #fig-heat-grad_norm .hm").count() >= 1
    page.click("#tab-heat-act_norm")
    page.wait_for_selector("#fig-heat-act_norm .main-svg")
    assert page.locator(".js-plotly-plot").count() >= 4
    assert page.is_hidden("#panel-heat-grad_norm")

    # the findings in the page are the store's
    rows = page.eval_on_selector_all(
        "tr.finding-row", "rows => rows.map(r => [r.dataset.kind, Number(r.dataset.step), r.dataset.layer])")
    assert [tuple(r) for r in rows] == store_findings(run)
    assert page.locator(".finding").count() == len(rows)
    assert page.get_attribute("#verdict", "data-state") == "errors"
    assert page.inner_text("#verdict").strip() == "Errors"

    # names are text, never markup
    assert page.locator("img").count() == 0
    assert "<script>alert(1)</script>" in page.inner_text(".bar .run")
    assert page.evaluate("document.querySelectorAll('script').length") == 4 + page.locator(
        "script[type='application/json']").count(), "plotly.js compressed, its decoder, plotly.js, the page's script"

    # sorting the layer table by a header
    def column(n: int) -> list[str]:
        return page.eval_on_selector_all(
            "#layer-table tbody tr", f"rows => rows.map(r => r.cells[{n}].getAttribute('data-v'))")

    with gw.open_run(run) as opened:
        in_model_order = list(opened.layers)
    layer_names = "rows => rows.map(r => r.dataset.layer)"
    assert page.eval_on_selector_all("#layer-table tbody tr", layer_names) == in_model_order
    header = page.locator("#layer-table th", has_text="max grad norm")
    header.click()
    assert header.get_attribute("aria-sort") == "ascending"
    values = [float(v) for v in column(6) if v]
    assert values == sorted(values) and len(values) >= 3
    assert column(6)[len(values):] == [""] * (len(in_model_order) - len(values)), "layers without a value last"
    header.click()
    assert header.get_attribute("aria-sort") == "descending"
    assert [float(v) for v in column(6) if v] == sorted(values, reverse=True)
    page.locator("#layer-table th", has_text="layer").first.click()
    names = page.eval_on_selector_all("#layer-table tbody tr", layer_names)
    assert names == sorted(in_model_order, key=str.lower)

    # clicking a finding's marker on the timeline is wired to its explanation
    assert page.locator("#finding-0").count() == 1

    page.locator("#layer-table th", has_text="#").click()  # back to model order for the picture
    page.evaluate("window.scrollTo({top: 0, behavior: 'instant'})")
    shot = tmp_path / "report.png"
    page.screenshot(path=str(shot), full_page=True)
    shutil.copyfile(shot, SCREENSHOT)
    assert shot.stat().st_size > 50_000
    assert problems == []
    page.close()


def test_report_decodes_its_plotly_offline(browser, run: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from plotly.offline import get_plotlyjs_version

    report = write(run, tmp_path / "offline.html")
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    fetched: list[str] = []
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
               else (fetched.append(route.request.url), route.abort()))
    page.goto(report.resolve().as_uri())
    page.wait_for_selector("#fig-timeline .main-svg")
    assert page.evaluate("Plotly.version") == get_plotlyjs_version(), "the library decoded in the page is plotly.js"
    assert page.evaluate("document.getElementById('plotly-bundle').textContent") == "", "its text let go once run"
    assert fetched == [] and problems == []
    page.close()


def tick_value(text: str) -> float:
    """What a log axis's tick label says: "0.4", "20", "10\u200b−6\u200b" (10^-6), "5x10\u200b−1\u200b", "2x10"."""
    head, *exponent = text.replace("\u2212", "-").split("\u200b")
    power = float(exponent[0]) if exponent and exponent[0] else None
    found = re.fullmatch(r"(\d+(?:\.\d*)?)x10|10|(\d+(?:\.\d*)?(?:e[-+]?\d+)?)", head)
    assert found, f"not a number: {text!r}"
    if found.group(1) is not None:  # "5x10", then its power
        return float(found.group(1)) * 10 ** (1 if power is None else power)
    if found.group(2) is not None:
        assert power is None, text
        return float(found.group(2))
    return 10 ** (1 if power is None else power)  # "10", or 10 to a power


def laid_out_labels(page, selector: str, timeout: float = 10.0) -> list[list]:  # type: ignore[no-untyped-def]
    """The labels at `selector` with their vertical middles, once plotly has laid them out.

    A chart's first draw and its redraw on the next progress event place the tick labels in steps:
    read too early, every label sits at one place (a loaded CI machine did). The labels are read
    when at least three sit at different places and two animation frames agree.
    """
    handle = page.wait_for_function(
        """selector => {
            const read = () => [...document.querySelectorAll(selector)].map(e => {
                const box = e.getBoundingClientRect(); return [e.textContent, box.top + box.height / 2]; });
            const now = JSON.stringify(read());
            const seen = window.__gwLabels || (window.__gwLabels = {});
            const same = seen[selector] === now;
            seen[selector] = now;
            const places = new Set(JSON.parse(now).filter(([text]) => text).map(([, y]) => Math.round(y)));
            return same && places.size >= 3 ? JSON.parse(now) : null;
        }""",
        arg=selector, polling="raf", timeout=timeout * 1000)
    return handle.json_value()


def assert_log_ticks_read_true(page, selector: str, low: float, high: float) -> list[float]:  # type: ignore[no-untyped-def]
    """The tick labels of a log axis say the values at their places: rising, evenly in log, around the data.

    plotly's default writes the ticks between powers of ten as their first digit: on an axis from
    0.25 to 3, "3 4 5 6 7 8 9 1 2 3", which is neither rising nor the values.
    """
    labels = laid_out_labels(page, selector)
    labels = sorted(((tick_value(text), y) for text, y in labels if text), key=lambda label: -label[1])
    values = [v for v, _ in labels]
    assert len(values) >= 3, labels
    assert all(a < b for a, b in zip(values, values[1:])), f"{selector}: not rising from the bottom: {labels}"
    assert low / 3 <= values[0] and values[-1] <= high * 3, f"{selector}: {values} for data from {low} to {high}"
    (v0, y0), (v1, y1) = labels[0], labels[-1]
    per_pixel = (math.log10(v1) - math.log10(v0)) / (y0 - y1)
    for value, y in labels:  # each label where its value is on the axis (within 0.05 of a decade)
        assert abs(math.log10(v0) + (y0 - y) * per_pixel - math.log10(value)) < 0.05, (selector, labels)
    return values


def test_log_axes_read_true_in_a_browser(browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Gradient norms from 0.25 to 3 (a decade), then from 1e-6 to 1e4: every tick label is the value."""
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    narrow_run = write(narrow(tmp_path / "narrow", 0.25, 3.0))
    page.goto(narrow_run.resolve().as_uri())
    page.wait_for_selector("#fig-flow .main-svg")
    timeline = assert_log_ticks_read_true(page, "#fig-timeline .y2tick text", 0.25, 3.0)  # row 2: grad norm
    assert 0.3 in timeline and 1 in timeline and 2 in timeline
    assert_log_ticks_read_true(page, "#fig-flow .ytick text", 0.25, 3.0)
    wide_run = write(synthetic(tmp_path / "wide", 8, 30, spike=(20, 3)))
    page.goto(wide_run.resolve().as_uri())
    page.wait_for_selector("#fig-flow .main-svg")
    assert_log_ticks_read_true(page, "#fig-timeline .y2tick text", 0.55, 1e4)
    flow = assert_log_ticks_read_true(page, "#fig-flow .ytick text", 1e-6, 1e4)  # the spike's step too
    assert 1e-6 in flow or 1e-5 in flow
    page.close()
