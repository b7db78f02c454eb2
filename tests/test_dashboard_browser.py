"""The live dashboard in a real browser (Playwright + Debian's chromium): live updates, clicks, no console errors."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import gradwatch as gw
from gradwatch.dashboards.server import start
from tests.test_report import BIG_STEP, NAN_STEP, XSS_LAYER, XSS_RUN, loop, make_model, narrow, synthetic, train
from tests.test_report_browser import assert_log_ticks_read_true, laid_out_labels

pytestmark = pytest.mark.slow  # a real browser

SCREENSHOTS = Path("/tmp")


def watch_page(page) -> list[str]:  # type: ignore[no-untyped-def]
    problems: list[str] = []
    page.on("console", lambda msg: problems.append(f"console: {msg.text}") if msg.type == "error" else None)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("dialog", lambda dialog: (problems.append(f"dialog: {dialog.message}"), dialog.dismiss()))
    return problems


def wait_js(page, expression: str, timeout: float = 30.0) -> float:  # type: ignore[no-untyped-def]
    """Poll ``expression`` in the page until it is true; returns the seconds it took.

    (Playwright's wait_for_function evaluates a string, which the dashboard's CSP forbids.)
    """
    started = time.monotonic()
    while not page.evaluate(f"() => Boolean({expression})"):
        assert time.monotonic() - started < timeout, f"timed out waiting for {expression}"
        time.sleep(0.05)
    return time.monotonic() - started


class Trainer(threading.Thread):
    """Keeps training a watched model, a step every ``pause`` seconds, until stopped."""

    def __init__(self, path: Path, pause: float) -> None:
        super().__init__(daemon=True)
        # detect only: the model's learning rate wrecks it within ~30 steps, which the default rules halt
        self.model = gw.watch(make_model(odd_layer=True), run=path, console=False, tensorboard=False,
                              flush_seconds=0.1, rules=None)
        self.pause = pause
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                loop(self.model, 1)
                gw.watcher(self.model).flush()
                time.sleep(self.pause)
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.error = exc

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=30)
        gw.unwatch(self.model)


def test_run_page_updates_live(browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    trainer = Trainer(tmp_path.joinpath(*XSS_RUN), pause=0.15)
    trainer.start()
    try:
        with start(tmp_path, poll=0.25) as dash:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            problems = watch_page(page)
            page.goto(f"{dash.url}run?run={'/'.join(XSS_RUN).replace('<', '%3C').replace('>', '%3E')}")
            page.wait_for_selector("#timeline .main-svg")
            page.wait_for_selector("#flow .main-svg")
            page.wait_for_selector("#heatmap .main-svg")
            assert page.locator("#run-name").inner_text() == "/".join(XSS_RUN), "the name is text, not markup"

            # live: steps shown grow and the flow's step moves without a reload
            first_steps = int(page.locator("#steps").inner_text().replace(",", ""))
            first_flow = int(page.locator("#flow").get_attribute("data-step") or -1)
            page.evaluate("window.__marker = 1")  # gone if the page reloads
            deadline = time.monotonic() + 60  # a loaded machine delays the poll; only no update at all fails
            while True:
                steps = int(page.locator("#steps").inner_text().replace(",", ""))
                flow_step = int(page.locator("#flow").get_attribute("data-step") or -1)
                if steps >= first_steps + 5 and flow_step > first_flow:
                    break
                assert time.monotonic() < deadline, f"no live update: steps {first_steps} -> {steps}"
                time.sleep(0.2)
            assert page.evaluate("window.__marker") == 1, "updated without a reload"
            # a step written now reaches the page by itself (how fast is the benchmark's business, not a test's:
            # a loaded machine delays the poll; the wait fails only if the step never comes)
            with gw.open_run(tmp_path.joinpath(*XSS_RUN)) as run:
                written = run.progress()["last_step"]
            wait_js(page, f"Number(document.getElementById('flow').dataset.step) >= {written}", timeout=60)

            # a click on a layer of the gradient flow opens its detail, including the hostile layer name
            page.locator("#heatmap").scroll_into_view_if_needed()
            for tab in page.locator("#metrics button").all():
                tab.click()
                page.wait_for_timeout(300)
            page.locator("#metrics button").first.click()
            page.evaluate("""() => { const f = document.getElementById('flow');
                                     const names = f.data[0].customdata.map(c => c[0]);
                                     f.emit('plotly_click', {points: [{x: names.length - 2}]}); }""")
            page.wait_for_selector("#layer-panel:not([hidden]) #layer .main-svg")
            assert page.locator("#layer-name").inner_text() == XSS_LAYER
            page.screenshot(path=str(SCREENSHOTS / "gradwatch-dashboard-live.png"), full_page=True)
            assert not problems, problems
            page.close()
    finally:
        trainer.stop()
    assert trainer.error is None


def test_findings_zoom_and_runs_list(browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    train(tmp_path / "trouble", nan_step=NAN_STEP, big_step=BIG_STEP)
    with start(tmp_path, poll=0.25) as dash:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        problems = watch_page(page)
        page.goto(dash.url)
        page.wait_for_selector("#runs tbody tr[data-run='trouble']")
        assert page.locator("#runs tbody tr").count() == 1
        train(tmp_path / "fresh", steps=5)  # a new run appears without a reload
        page.wait_for_selector("#runs tbody tr[data-run='fresh']", timeout=60_000)
        page.locator("#runs tbody tr input[type=checkbox]").nth(0).check()
        page.locator("#runs tbody tr input[type=checkbox]").nth(1).check()
        page.locator("#compare").click()
        page.wait_for_selector("#cmp-flow .main-svg")
        assert page.locator("#cmp-grad .scatterlayer .trace").count() == 2
        page.screenshot(path=str(SCREENSHOTS / "gradwatch-dashboard-compare.png"), full_page=True)

        page.goto(f"{dash.url}run?run=trouble")
        page.wait_for_selector("#findings li")
        kinds = [li.get_attribute("data-kind") for li in page.locator("#findings > li").all()]
        with gw.open_run(tmp_path / "trouble") as run:
            assert sorted(kinds) == sorted(run.findings()["kind"])
        assert page.locator("#banner").get_attribute("class") == "banner state-errors"
        # a click on the NaN finding zooms every chart around its step
        page.locator(f"#findings > li[data-kind='nonfinite'][data-step='{NAN_STEP}'] .message").click()
        wait_js(page, "document.getElementById('range').textContent.startsWith('steps ')")
        assert page.locator("#range").inner_text() == f"steps 0 – {NAN_STEP + 50}"
        page.wait_for_selector("#layer-panel:not([hidden])")
        assert page.locator("#layer-name").inner_text() == "features"
        page.locator("#reset").click()
        wait_js(page, "document.getElementById('range').textContent === 'all steps'")
        page.screenshot(path=str(SCREENSHOTS / "gradwatch-dashboard-run.png"), full_page=True)
        assert not problems, problems
        page.close()


def test_log_axes_read_true(browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Gradient norms from 0.25 to 3 (a decade), then from 1e-6 to 1e4: every tick label is the value."""
    narrow(tmp_path / "narrow", 0.25, 3.0)
    synthetic(tmp_path / "wide", 8, 30, spike=(20, 3))
    with start(tmp_path, poll=0.25) as dash:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        problems = watch_page(page)
        page.goto(f"{dash.url}run?run=narrow")
        page.wait_for_selector("#timeline .main-svg")
        page.wait_for_selector("#flow .main-svg")
        timeline = assert_log_ticks_read_true(page, "#timeline .y2tick text", 0.25, 3.0)  # row 2: grad norm
        assert 0.3 in timeline and 1 in timeline and 2 in timeline
        assert_log_ticks_read_true(page, "#flow .ytick text", 0.25, 3.0)
        page.goto(f"{dash.url}compare?run=narrow&run=wide")
        page.wait_for_selector("#cmp-flow .main-svg")
        assert_log_ticks_read_true(page, "#cmp-grad .ytick text", 0.25, 1e4)
        page.goto(f"{dash.url}run?run=wide")
        page.wait_for_selector("#flow .main-svg")
        flow = assert_log_ticks_read_true(page, "#flow .ytick text", 1e-6, 1.5)  # the latest step's layers
        assert 1e-6 in flow or 1e-5 in flow
        assert not problems, problems
        page.close()


#: every tick label's box on the page's charts: [chart and axis, text, top, bottom, left, right]
_LABEL_BOXES = """() => [...document.querySelectorAll('.js-plotly-plot')].flatMap(plot =>
    [...plot.querySelectorAll('g.yaxislayer-above, g.xaxislayer-above')].flatMap((axis, i) =>
        [...axis.querySelectorAll('text')].filter(e => e.textContent).map(e => {
            const b = e.getBoundingClientRect();
            return [plot.id + ':' + i, e.textContent, b.top, b.bottom, b.left, b.right];
        })))"""


def _overlapping(boxes: list[list]) -> list[tuple[str, str, str]]:  # type: ignore[type-arg]
    found = []
    for i, (axis, text, top, bottom, left, right) in enumerate(boxes):
        for other, text2, top2, bottom2, left2, right2 in boxes[i + 1:]:
            apart = bottom2 - 0.5 <= top or bottom - 0.5 <= top2 or right2 - 0.5 <= left or right - 0.5 <= left2
            if other == axis and not apart:
                found.append((axis, text, text2))
    return found


@pytest.mark.parametrize(("low", "high", "least"), [(0.003, 0.2, [0.01, 0.1]), (0.7, 1.0, [0.7, 1])])
def test_log_axis_labels_never_overlap(browser, tmp_path: Path, low: float, high: float,  # type: ignore[no-untyped-def]
                                       least: list[float]) -> None:
    """Gradient norms over two decades, and within one: the labels stand apart, each still its value."""
    narrow(tmp_path / "narrow", low, high)
    with start(tmp_path, poll=0.25) as dash:
        page = browser.new_page(viewport={"width": 1000, "height": 700})
        problems = watch_page(page)
        page.goto(f"{dash.url}run?run=narrow")
        page.wait_for_selector("#timeline .main-svg")
        page.wait_for_selector("#flow .main-svg")
        flow = assert_log_ticks_read_true(page, "#flow .ytick text", low, high)
        timeline = assert_log_ticks_read_true(page, "#timeline .y2tick text", low, high)
        assert set(least) <= set(flow) and set(least) <= set(timeline), (flow, timeline)
        assert _overlapping(page.evaluate(_LABEL_BOXES)) == []
        page.evaluate("() => document.getElementById('flow').emit('plotly_click', {points: [{x: 1, pointNumber: 1}]})")
        page.wait_for_selector("#layer-panel:not([hidden]) #layer .main-svg")
        laid_out_labels(page, "#layer .ytick text")
        assert _overlapping(page.evaluate(_LABEL_BOXES)) == []
        assert not problems, problems
        page.close()
