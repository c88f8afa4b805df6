"""The built book (``make book``, tools/book.py) in headless Chromium, with no network.

Opens the contents page and every chapter from the built folder (``file://``), with every
request that is not a local file aborted: each page must load without a console error or a
failed request, show every figure as an ``<img>`` that loaded (``naturalWidth > 0``) -- as many
as its executed notebook has image outputs and explorer widgets -- and the navigation must
work: from the contents to the first chapter, "next" through every chapter in the order of
the contents, "previous" back, "Contents" home.

The book is read from ``build/book`` (``WORKBENCH_BOOK_DIR`` overrides). When it is not built
the test is skipped with that reason, except under ``make book`` (``WORKBENCH_BOOK_REQUIRED=1``),
which builds it first and where a missing book fails.
"""

import os
import re
import sys
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
BOOK = Path(os.environ.get("WORKBENCH_BOOK_DIR", ROOT / "build" / "book"))
EXECUTED = ROOT / "build" / "executed"
# WORKBENCH_BOOK_GLOB="00*,10*" checks a book built from some notebooks only (tools/book.py
# NOTEBOOK...); the default, every notebook, is what make book and CI check.
NOTEBOOKS = sorted({p for pattern in os.environ.get("WORKBENCH_BOOK_GLOB", "*.ipynb").split(",")
                    for p in (ROOT / "notebooks").glob(pattern.strip())})
IMAGES = ("image/png", "image/jpeg", "image/svg+xml")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def book():
    if not (BOOK / "index.html").exists():
        message = f"the book is not built ({BOOK}/index.html missing): run make book"
        if os.environ.get("WORKBENCH_BOOK_REQUIRED") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return BOOK


@pytest.fixture()
def offline_page(browser):
    """A page whose non-file requests are aborted; ``page.problems`` collects what failed."""
    context = browser.new_context()
    context.route(re.compile(r"^(?!file:|data:).*"), lambda route: route.abort())
    page = context.new_page()
    page.problems = []
    page.on("console", lambda m: m.type == "error" and page.problems.append(
        f"console error: {m.text}"))
    page.on("pageerror", lambda e: page.problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: page.problems.append(f"request failed: {r.url}"))
    yield page
    context.close()


def expected_images(notebook: Path) -> int:
    """Image outputs plus explorer widgets (each becomes a snapshot image) of the executed
    copy; -1 when there is none."""
    sys.path.insert(0, str(ROOT / "tools"))
    from book import has_image

    executed = EXECUTED / notebook.name
    if not executed.exists():
        return -1
    nb = nbformat.read(executed, as_version=4)
    outputs = [out for c in nb.cells for out in c.get("outputs", [])]
    return (sum(any(m in out.get("data", {}) for m in IMAGES) for out in outputs)
            + sum(has_image(nb, out["data"][WIDGET_VIEW]["model_id"]) for out in outputs
                  if WIDGET_VIEW in out.get("data", {})))


def test_every_notebook_has_a_page_and_nothing_is_loaded_from_the_network(book):
    pages = {p.name for p in book.glob("*.html")}
    assert pages == {"index.html", *(n.stem + ".html" for n in NOTEBOOKS)}
    for page in book.glob("*.html"):
        text = page.read_text(encoding="utf-8")
        remote = re.findall(r'<(?:script|link|img|iframe)[^>]*(?:src|href)="(?:https?:)?//[^"]*',
                            text)
        assert not remote, f"{page.name} loads from the network: {remote[:3]}"


def test_every_page_loads_with_its_figures(book, offline_page):
    page = offline_page
    for path in [book / "index.html", *(book / (n.stem + ".html") for n in NOTEBOOKS)]:
        page.goto(path.as_uri())
        page.wait_for_load_state("load")
        sizes = page.eval_on_selector_all(
            "img", "imgs => imgs.map(i => [i.complete, i.naturalWidth])")
        broken = [i for i, (complete, width) in enumerate(sizes) if not complete or width == 0]
        assert not broken, f"{path.name}: images {broken} of {len(sizes)} did not load"
        notebook = ROOT / "notebooks" / path.with_suffix(".ipynb").name
        if notebook.exists():
            want = expected_images(notebook)
            if want >= 0:
                assert len(sizes) == want, (f"{path.name}: {len(sizes)} <img> elements, its "
                                            f"executed notebook has {want} figures/widgets")
        raw_tex = page.eval_on_selector_all(
            ".text_cell_render", "cs => cs.filter(c => c.innerText.includes('$')).length")
        assert raw_tex == 0, f"{path.name}: {raw_tex} markdown cells show TeX unrendered"
        assert not page.problems, f"{path.name}: {page.problems}"


def test_navigation_follows_the_contents(book, offline_page):
    page = offline_page
    page.goto((book / "index.html").as_uri())
    titles = page.eval_on_selector_all("ol.contents > li > a", "as => as.map(a => a.textContent)")
    assert len(titles) == len(NOTEBOOKS)
    page.click("ol.contents > li:first-child > a")
    assert page.title() == titles[0]
    for title in titles[1:]:
        page.click("nav.chapter-nav >> nth=0 >> a[rel=next]")
        assert page.title() == title
    assert page.locator("a[rel=next]").count() == 0, "the last chapter links to a next one"
    page.click("nav.chapter-nav >> nth=0 >> a[rel=prev]")
    assert page.title() == titles[-2]
    page.click("nav.chapter-nav >> nth=-1 >> a.toc")
    assert page.url.endswith("/index.html")
    assert not page.problems, page.problems
