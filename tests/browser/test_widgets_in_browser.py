"""The explorer widgets in a real browser: JupyterLab, headless Chromium, a slider moved.

Each notebook that uses a widget (found by its source, see ``widget_notebooks``) is opened in
JupyterLab, run cell by cell ("Run All Cells") with ``WORKBENCH_FAST=1`` and must finish without
an error output. Then in every rendered explorer (an HBox holding the controls and the
figure's ``<img>``) the first slider whose move changes the message text is moved one step by
the keyboard (ArrowRight on the noUiSlider handle, ArrowLeft at the maximum, then Home and End
if one step changes no text: the keyboard fires the slider's "change" event, so
``continuous_update=False`` sliders update too), and the text and the figure (the PNG's bytes,
not only the blob URL) must both change.

On a failure the page's screenshot is saved and its path is in the message, with the server's
log and the browser console's last errors.
"""

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
WIDGETS = ROOT / "workbench" / "widgets"

# A notebook "uses a widget" when a code cell imports workbench.widgets or calls an explorer.
WIDGET_USE = re.compile(r"\bworkbench\.widgets\b|\b[A-Z]\w*Explorer\(")
EXPLORER_CALL = re.compile(r"(?<!class )\b[A-Z]\w*Explorer\(")  # each call is shown once
EXPLORER_CLASS = re.compile(r"^class ([A-Z]\w*Explorer)\(", re.M)

LOAD_TIMEOUT = 90_000  # ms: JupyterLab's page and the kernel's start
RUN_TIMEOUT = 300_000  # ms: Run All Cells, WORKBENCH_FAST=1
RENDER_TIMEOUT = 30_000  # ms: the widgets' first message and image
MOVE_TIMEOUT = 15_000  # ms: a slider move until the text, then the image, changes

EXPLORER = ".jp-OutputArea-output .widget-hbox:has(> img)"
SLIDER = ".widget-slider"


def _code_cells(path: Path) -> list[str]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def widget_notebooks() -> list[Path]:
    """The notebooks under notebooks/ whose code uses an explorer widget."""
    return [p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
            if any(WIDGET_USE.search(source) for source in _code_cells(p))]


NOTEBOOKS = widget_notebooks()


def test_every_explorer_is_in_a_notebook_tested_here():
    names = {p.name for p in NOTEBOOKS}
    assert {"04_privacy_accounting.ipynb", "05_dp_sgd_training.ipynb"} <= names, names
    used = "\n".join(s for p in NOTEBOOKS for s in _code_cells(p))
    classes = {m for f in WIDGETS.glob("*.py") for m in EXPLORER_CLASS.findall(f.read_text())}
    assert classes, "no Explorer class found in workbench/widgets"
    missing = sorted(c for c in classes if f"{c}(" not in used)
    assert not missing, f"explorers never shown in a notebook (so never tested in a browser): "\
                        f"{missing}"


# --- JavaScript run in the page (window.jupyterapp: --LabApp.expose_app_in_browser) ---------

# Each takes the notebook's path and finds its panel by it (not the current tab).
PANEL = """const nb = window.jupyterapp && Array.from(window.jupyterapp.shell.widgets('main'))
    .find(w => w.context && w.context.path === path && w.content && w.sessionContext);"""

NOTEBOOK_READY = """(path) => { %s
  if (!nb || !nb.context.isReady) return false;
  const kernel = nb.sessionContext.session && nb.sessionContext.session.kernel;
  return !!kernel && kernel.status === 'idle';
}""" % PANEL

RUN_ALL = """(path) => { %s
  window.jupyterapp.shell.activateById(nb.id);
  window.__runAll = null;
  window.jupyterapp.commands.execute('notebook:run-all-cells').then(
    ok => { window.__runAll = {ok: ok}; },
    err => { window.__runAll = {ok: false, error: String(err)}; });
}""" % PANEL

RUN_DONE = """(path) => { %s
  const kernel = nb.sessionContext.session && nb.sessionContext.session.kernel;
  return window.__runAll !== null && !!kernel && kernel.status === 'idle';
}""" % PANEL

CELLS = """(path) => { %s
  return nb.content.widgets
    .map((cell, index) => ({index: index, type: cell.model.type,
                            source: cell.model.sharedModel.getSource(),
                            count: cell.model.type === 'code' ? cell.model.executionCount : null,
                            outputs: cell.model.type === 'code' ? cell.model.outputs.toJSON()
                                                                : []}))
    .filter(cell => cell.type === 'code');
}""" % PANEL

SHUTDOWN = """(path) => { %s
  return nb ? nb.sessionContext.shutdown().then(() => true) : false;
}""" % PANEL

# The message text, and the image's URL and a digest of its PNG bytes.
STATE = """async (explorer) => {
  const img = explorer.querySelector(':scope > img');
  const messages = explorer.querySelectorAll('.widget-html-content');
  const text = messages.length ? messages[messages.length - 1].innerText : null;
  let digest = null;
  try {
    const bytes = await (await fetch(img.src)).arrayBuffer();
    digest = Array.from(new Uint8Array(await crypto.subtle.digest('SHA-256', bytes)))
      .map(b => b.toString(16).padStart(2, '0')).join('');
  } catch (err) { digest = 'unreadable: ' + err; }
  return {text: text, src: img.getAttribute('src') || '', digest: digest};
}"""

RENDERED = """(explorer) => {
  const img = explorer.querySelector(':scope > img');
  const messages = explorer.querySelectorAll('.widget-html-content');
  return !!img && !!img.getAttribute('src') && img.complete && img.naturalWidth > 0
    && messages.length > 0 && messages[messages.length - 1].innerText.trim() !== '';
}"""

CHANGED = """([explorer, before]) => {
  const img = explorer.querySelector(':scope > img');
  const messages = explorer.querySelectorAll('.widget-html-content');
  return messages[messages.length - 1].innerText !== before.text
    || (img.getAttribute('src') || '') !== before.src;
}"""

IMAGE_CHANGED = """([explorer, before]) => {
  const img = explorer.querySelector(':scope > img');
  return (img.getAttribute('src') || '') !== before.src && img.complete && img.naturalWidth > 0;
}"""


class Failure(Exception):
    pass


def _errors(cells) -> list[str]:
    found = []
    for cell in cells:
        for out in cell["outputs"]:
            if out.get("output_type") == "error":
                trace = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(out.get("traceback", [])))
                found.append(f"cell {cell['index']} ({cell['source'][:80]!r}): "
                             f"{out.get('ename')}: {out.get('evalue')}\n{trace[-2000:]}")
    return found


def _keys(handle) -> list[str]:
    """One step (right, or left at the maximum), then the ends not already there."""
    now, low, high = (handle.get_attribute(f"aria-value{a}") for a in ("now", "min", "max"))
    try:
        now, low, high = float(now), float(low), float(high)
    except (TypeError, ValueError):
        return ["ArrowRight", "Home", "End"]
    keys = ["ArrowLeft" if now >= high else "ArrowRight"]
    return keys + (["Home"] if now > low else []) + (["End"] if now < high else [])


def _move_slider(page, explorer, index: int) -> str:
    """Move a slider so that the text changes; assert that the image changes too.

    Sliders are tried in order, each first by one step, then to its ends (one step may change
    nothing shown: C above every norm clips none at C and at C + one step). Once the image has
    changed and the text not, that move is known not to change the text (the widget sets the
    text before the image). Returns a note of what was moved.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    sliders = explorer.locator(SLIDER)
    tried = []
    for i in range(sliders.count()):
        slider = sliders.nth(i)
        label = slider.locator(".widget-label").first.inner_text().strip() or f"slider {i}"
        handle = slider.locator(".noUi-handle").first
        if slider.locator(".noUi-target[disabled]").count() or not handle.count():
            tried.append(f"{label}: disabled")
            continue
        for key in _keys(handle):
            before = explorer.evaluate(STATE)
            handle.scroll_into_view_if_needed()
            handle.focus()
            handle.press(key)
            try:
                page.wait_for_function(CHANGED, arg=[explorer.element_handle(), before],
                                       timeout=MOVE_TIMEOUT)
            except PlaywrightTimeout:
                tried.append(f"{label} {key}: nothing changed in {MOVE_TIMEOUT} ms")
                continue
            if explorer.evaluate(STATE)["text"] == before["text"]:
                tried.append(f"{label} {key}: the image changed, the text not")
                continue
            try:
                page.wait_for_function(IMAGE_CHANGED, arg=[explorer.element_handle(), before],
                                       timeout=MOVE_TIMEOUT)
            except PlaywrightTimeout:
                raise Failure(f"slider {label!r} ({key}) changed the text but the image did not "
                              f"change in {MOVE_TIMEOUT} ms (tried before: {tried})") from None
            after = explorer.evaluate(STATE)
            if after["digest"] == before["digest"]:
                raise Failure(f"slider {label!r} ({key}): a new image with the same bytes:\n"
                              f"before {before}\nafter  {after}")
            return (f"explorer {index}: {label!r} {key}: {before['text']!r} -> "
                    f"{after['text']!r}" + (f" (tried before: {tried})" if tried else ""))
    raise Failure(f"no slider changed the message text: {tried}")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_widgets_respond_in_jupyterlab(browser, lab, notebook, tmp_path):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    console = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type == "error"
            else None)
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    cells, step = [], "open"
    try:
        # ?reset: an empty workspace, not the tabs of the notebooks opened before
        page.goto(f"{lab['url']}/lab/tree/{notebook.name}?reset&token={lab['token']}",
                  timeout=LOAD_TIMEOUT)
        page.wait_for_function(NOTEBOOK_READY, arg=notebook.name, timeout=LOAD_TIMEOUT,
                               polling=250)
        step = "Run All Cells"
        page.evaluate(RUN_ALL, notebook.name)
        page.wait_for_function(RUN_DONE, arg=notebook.name, timeout=RUN_TIMEOUT, polling=500)
        cells = page.evaluate(CELLS, notebook.name)
        errors = _errors(cells)
        if errors:
            raise Failure("error output(s):\n" + "\n\n".join(errors))
        unrun = [c["index"] for c in cells if c["source"].strip() and c["count"] is None]
        run_all = page.evaluate("() => window.__runAll")
        if unrun or not run_all.get("ok"):
            raise Failure(f"Run All Cells did not run every cell: {run_all}, "
                          f"cells without an execution count: {unrun}")
        step = "render the explorers"
        expected = sum(len(EXPLORER_CALL.findall(c["source"])) for c in cells)
        explorers = page.locator(EXPLORER)
        try:  # widget views render after their cell has finished
            page.wait_for_function("([selector, n]) => document.querySelectorAll(selector).length"
                                   " >= n", arg=[EXPLORER, expected], timeout=RENDER_TIMEOUT,
                                   polling=250)
        except PlaywrightTimeout:
            pass  # the count below says how many
        if explorers.count() != expected:
            raise Failure(f"{explorers.count()} explorer widget(s) rendered, {expected} "
                          f"constructed in the code (an Explorer(...) call per displayed widget)")
        notes = []
        for i in range(expected):
            step = f"explorer {i}"
            explorer = explorers.nth(i)
            page.wait_for_function(RENDERED, arg=explorer.element_handle(),
                                   timeout=RENDER_TIMEOUT)
            notes.append(_move_slider(page, explorer, i))
        print(f"\n{notebook.name}:", *notes, sep="\n  ")
    except (Failure, PlaywrightTimeout) as err:
        shot = tmp_path / f"{notebook.stem}.png"
        try:
            page.screenshot(path=str(shot), full_page=True, timeout=10_000)
        except Exception as shot_err:  # the report matters more than the picture
            shot = f"(no screenshot: {shot_err})"
        ran = [f"[{c['count']}] {c['source'][:60]!r}: "
               f"{[o.get('output_type') for o in c['outputs']]}" for c in cells]
        pytest.fail(f"{notebook.name}, {step}: {err}\nscreenshot: {shot}\n"
                    f"server log: {lab['log']}\nbrowser console errors: {console[-10:]}\n"
                    f"cells run (last 5): {ran[-5:]}", pytrace=False)
    finally:
        try:
            page.evaluate(SHUTDOWN, notebook.name)
        except Exception:  # the page may be gone; the server stops its kernels anyway
            pass
        page.close()
