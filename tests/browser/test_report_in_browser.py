"""The audit report in a real browser: headless Chromium opens report.html from disk.

The cover (verdict, what is audited, the claim under test with one verdict per element) must be
inside the first screen (1280x800, no scrolling), the summary table right after it; the
subject's sections come first, the tool's self-checks and other libraries in appendices with
their own counts; a library that cannot run a model reads "not applicable", never FAILED; no
table is wider than the page; the provenance shows the CPU model and the uncommitted-changes
flag; every figure must have loaded (an <img> with a decoded, non-empty bitmap), no
request may leave the file (self-contained), and the print layout must render too. The page is
the small real report of ``tests/audit/report_helpers.py`` (every built-in section kind).

On a failure the screenshot's path is in the message.
"""

import pytest

from tests.audit.report_helpers import small_claim, small_provenance, small_sections
from workbench.audit.report_files import write_report

pytestmark = pytest.mark.browser

VIEWPORT = {"width": 1280, "height": 800}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    html_path, _, document = write_report(out, small_sections(), small_provenance(),
                                          claim=small_claim())
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


def test_the_cover_is_in_the_first_screen(page, report, tmp_path):
    shot = tmp_path / "first-screen.png"
    page.screenshot(path=str(shot))
    for selector in ("#verdict", "#subject", "#claim-elements"):
        box = _box(page, selector)
        assert page.locator(selector).is_visible(), selector
        assert box["y"] + box["height"] <= VIEWPORT["height"], f"{selector} below fold: {shot}"
    cover, summary = _box(page, "#cover"), _box(page, "#summary")
    assert cover["y"] + cover["height"] <= summary["y"] <= cover["y"] + cover["height"] + 80
    assert report[1]["verdict"] in page.locator("#verdict").inner_text()
    assert "a tiny MLP" in page.locator("#subject").inner_text()
    elements = report[1]["claim"]["elements"]
    rows = page.locator("#claim-elements tbody tr")
    assert rows.count() == len(elements) > 5
    for k, element in enumerate(elements):  # one verdict per element, as a badge
        badge = rows.nth(k).locator(".badge")
        assert badge.count() == 1 and badge.inner_text() == element["verdict"]
    summary = page.locator("#summary tbody tr:not(.part)")
    assert summary.count() == len(report[1]["sections"]), shot
    assert "SKIPPED" in page.locator("#summary").inner_text()


def test_subject_first_then_the_appendices_each_counted(page, report):
    parts = [s["part"] for s in report[1]["sections"]]
    assert parts == sorted(parts, key=["subject", "self-check", "library"].index)
    heads = page.locator("h2.part")
    assert [heads.nth(k).inner_text() for k in range(heads.count())] == [
        "What is audited", "Appendix A: the tool's self-checks", "Appendix B: other libraries"]
    tops = [_box(page, f"#part-{p}")["y"] for p in ("subject", "self-check", "library")]
    assert tops == sorted(tops)
    for part in ("subject", "self-check", "library"):
        c = report[1]["by_part"][part]
        line = page.locator(f"#count-{part}").inner_text()
        assert f"{c['passed']} passed" in line, line
    assert report[1]["by_part"]["library"]["not_applicable"] == 1


def test_a_library_that_cannot_run_a_model_is_not_applicable(page, report):
    rows = page.locator("#summary tbody tr", has_text="library picky on mlp")
    assert rows.count() == 1
    assert rows.first.locator(".badge.na").inner_text() == "not applicable"
    assert "FAILED" not in rows.first.inner_text()
    partly = page.locator("#summary tbody tr", has_text="library picky").first
    assert "not applicable on mlp" in partly.inner_text()
    section = page.locator("section", has_text="picky has no rule for Tanh").first
    assert "not applicable" in section.inner_text()


def test_every_table_fits_the_page(page):
    width = page.evaluate("() => document.documentElement.clientWidth")
    right = page.evaluate("""() => Array.from(document.querySelectorAll('table')).map(
        t => t.getBoundingClientRect().right)""")
    assert right and max(right) <= width + 1, (max(right), width)
    assert page.evaluate("() => document.documentElement.scrollWidth") <= width + 1


def test_provenance_shows_cpu_and_uncommitted_changes(page, report):
    text = page.locator("#provenance").inner_text()
    assert "cpu_model" in text and report[1]["provenance"]["machine"]["cpu_model"] in text
    assert "uncommitted changes" in text


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
