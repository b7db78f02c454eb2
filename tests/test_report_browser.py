"""The report in a real browser (headless Chromium via Playwright): drawn, clean console, safe, sortable."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import gradwatch as gw
from gradwatch.report import write
from tests.test_report import BIG_STEP, NAN_STEP, XSS_RUN, store_findings, train

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
    assert page.evaluate("document.querySelectorAll('script').length") == 2 + page.locator(
        "script[type='application/json']").count()

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
