"""A report carries plotly.js compressed (LZMA, base64): at most a third of a report with the library
whole, the very same library once decoded, and nothing fetched from anywhere."""

from __future__ import annotations

import base64
import lzma
import re
from pathlib import Path

import pytest
from plotly.offline import get_plotlyjs

from gradwatch.report import bundle, write
from tests.test_report import train

pytestmark = pytest.mark.slow  # trains a run


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> str:
    run = train(tmp_path_factory.mktemp("size") / "run", nan_step=20, big_step=30)
    return write(run).read_text(encoding="utf-8")


def _embedded(html: str) -> tuple[bytes, int, int]:
    found = re.search(r'<script type="application/octet-stream" id="plotly-bundle" data-size="(\d+)" '
                      r'data-properties="(\d+)">([A-Za-z0-9+/=]+)</script>', html)
    assert found, "the compressed library is in the page"
    return base64.b64decode(found.group(3)), int(found.group(1)), int(found.group(2))


def test_a_report_is_a_third_of_one_with_the_whole_library(report: str) -> None:
    library = len(get_plotlyjs().encode())
    packed, _, _ = _embedded(report)
    whole = len(report.encode()) - len(base64.b64encode(packed)) + library  # the page as it was, library inline
    assert len(report.encode()) * 3 <= whole, (len(report.encode()), whole)
    assert len(report.encode()) < 1_632_000, "a third of the 4.9 MB a report weighed"


def test_the_embedded_library_is_plotly_js_itself(report: str) -> None:
    packed, size, properties = _embedded(report)
    assert properties == 4, "lc 4, lp 0, pb 0: what the page's decoder is told"
    source = get_plotlyjs().encode()
    assert size == len(source)
    assert lzma.decompress(packed, format=lzma.FORMAT_RAW, filters=bundle.FILTERS) == source


def test_nothing_is_fetched(report: str) -> None:
    assert not re.search(r"<script[^>]*\bsrc=", report), "no script from anywhere"
    assert not re.search(r"<link[^>]*\bhref=", report) and "cdn.plot.ly" not in report.split("plotly-bundle")[0]


def test_a_damaged_cache_is_compressed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    bundle.plotly_bundle.cache_clear()
    try:
        first = bundle.plotly_bundle()
        [cached] = (tmp_path / "gradwatch").iterdir()
        cached.write_bytes(cached.read_bytes()[:1000])
        bundle.plotly_bundle.cache_clear()
        assert bundle.plotly_bundle() == first and cached.read_bytes() == base64.b64decode(first.data)
    finally:
        bundle.plotly_bundle.cache_clear()
