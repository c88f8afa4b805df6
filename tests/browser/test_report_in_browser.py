"""The audit report in a real browser: headless Chromium opens report.html from disk.

The verdict and the whole summary table must be inside the first screen (1280x800, no
scrolling), every figure must have loaded (an <img> with a decoded, non-empty bitmap), no
request may leave the file (self-contained), and the print layout must render too. The page is
the small real report of ``tests/audit/report_helpers.py`` (every built-in section kind).

On a failure the screenshot's path is in the message.
"""

import pytest

from tests.audit.report_helpers import small_provenance, small_sections
from workbench.audit.report import write_report

pytestmark = pytest.mark.browser

VIEWPORT = {"width": 1280, "height": 800}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    html_path, _, document = write_report(out, small_sections(), small_provenance())
    return html_path, document


@pytest.fixture
def page(browser, report):
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(report[0].as_uri(), wait_until="load")
    page.requests = requests
    yield page
    context.close()


def _box(page, selector):
    element = page.locator(selector)
    assert element.count() == 1, f"{selector} not on the page"
    return element.bounding_box()


def test_verdict_and_summary_are_in_the_first_screen(page, report, tmp_path):
    shot = tmp_path / "first-screen.png"
    page.screenshot(path=str(shot))
    verdict, summary = _box(page, "#verdict"), _box(page, "#summary")
    assert page.locator("#verdict").is_visible() and page.locator("#summary").is_visible()
    assert verdict["y"] + verdict["height"] <= VIEWPORT["height"], shot
    assert summary["y"] + summary["height"] <= VIEWPORT["height"], f"summary below fold: {shot}"
    rows = page.locator("#summary tbody tr")
    assert rows.count() == len(report[1]["sections"]), shot
    assert report[1]["verdict"] in page.locator("#verdict").inner_text()
    assert "SKIPPED" in page.locator("#summary").inner_text()


def test_every_figure_loaded(page, report):
    expected = sum(s["figures"] for s in report[1]["sections"])
    images = page.locator("img")
    assert images.count() == expected > 0
    loaded = page.evaluate("""() => Array.from(document.images).map(
        img => img.complete && img.naturalWidth > 0 && img.naturalHeight > 0)""")
    assert all(loaded), f"figures not loaded: {[i for i, ok in enumerate(loaded) if not ok]}"


def test_nothing_is_fetched_and_it_prints(page, report, tmp_path):
    assert all(url.startswith(("file:", "data:")) for url in page.requests), page.requests
    page.emulate_media(media="print")
    assert page.locator("#verdict").is_visible()
    pdf = page.pdf(path=str(tmp_path / "report.pdf"))
    assert pdf[:4] == b"%PDF" and len(pdf) > 10_000
