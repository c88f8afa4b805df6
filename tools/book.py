"""Build the book: ``python tools/book.py [--out build/book]`` (``make book``).

A static HTML site of every notebook in notebooks/, in the order of the learning path (the
file names sort along it), run in *full* mode, with:

- an index page (``index.html``): the table of contents, each chapter's title and first
  paragraph;
- on every chapter page, links to the previous and next chapter and to the contents, at the
  top and at the bottom; links between notebooks (``NN_name.ipynb#anchor``) point to the pages;
- figures as embedded PNG ``<img>`` elements (data URIs), and each explorer widget as a static
  snapshot: the PNG its Image widget showed when the notebook was run and the values of its
  controls (read from the widget state the notebook was saved with), no JavaScript;
- math rendered to MathML at build time (latex2mathml), so no MathJax from a CDN.

Nothing is loaded from the network: the pages work offline from the built folder
(tests/browser/test_book.py opens every page with no network).

Executed notebooks are reused: ``make notebooks-full`` (tools/nbchecks.py run) saves each one
to ``build/executed/`` stamped with the hash of the cells it ran; a notebook whose stamp
matches its source is not run again, any other is run here in full mode (and saved). The
stamp covers the notebook's cells, not the library: after changing the library, run
``make notebooks-full`` again (CI always does, before ``make book``).
"""

import argparse
import base64
import html
import re
import shutil
import sys
import time
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nbchecks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
CONTROL_MODELS = ("FloatSliderModel", "IntSliderModel", "FloatLogSliderModel",
                  "DropdownModel", "CheckboxModel", "ToggleButtonsModel", "FloatTextModel",
                  "BoundedFloatTextModel", "IntTextModel", "BoundedIntTextModel",
                  "RadioButtonsModel", "SelectionSliderModel")


# ---------------------------------------------------------------- executed notebooks
def executed(path: Path) -> nbformat.NotebookNode:
    """The full-mode run of ``path``: build/executed's copy if it was made from this source,
    else a fresh run (tools/nbchecks.run_full, which saves it)."""
    saved = nbchecks.EXECUTED / path.name
    if saved.exists():
        nb = nbformat.read(saved, as_version=4)
        if nb.metadata.get("workbench", {}).get("source_hash") == nbchecks.source_hash(path):
            print(f"book: {path.name}: reusing {saved.relative_to(ROOT)}", flush=True)
            return nb
    print(f"book: {path.name}: running it in full mode (no up-to-date executed copy)",
          flush=True)
    seconds = nbchecks.run_full(path)
    print(f"book: {path.name}: ran in {seconds:.0f} s", flush=True)
    return nbformat.read(saved, as_version=4)


# ---------------------------------------------------------------- math
# $$display$$ or $inline$ (inline may wrap onto the next line, not across a blank line)
MATH = re.compile(r"(?<!\\)\$\$(.+?)\$\$"
                  r"|(?<![\\$])\$(?!\s)((?:[^$\n]|\n(?!\s*\n))+?)(?<!\s)\$(?!\d)", re.S)
CODE = re.compile(r"(```.*?```|`[^`\n]*`)", re.S)


def render_math(markdown: str) -> str:
    """``$...$`` and ``$$...$$`` in ``markdown`` (outside code) as MathML."""
    from latex2mathml.converter import convert

    def one(match):
        display, inline = match.group(1), match.group(2)
        tex = (display if display is not None else inline).strip()
        try:
            mathml = convert(tex, display="block" if display is not None else "inline")
        except Exception as err:  # noqa: BLE001  (a formula the converter cannot read)
            raise ValueError(f"latex2mathml cannot convert ${tex}$: {err}; simplify the "
                             "formula in the notebook's markdown") from err
        mathml = mathml.replace("\n", " ")
        return f"\n\n{mathml}\n\n" if display is not None else mathml

    parts = CODE.split(markdown)
    return "".join(p if i % 2 else MATH.sub(one, p) for i, p in enumerate(parts))


# ---------------------------------------------------------------- widgets
def _models(nb) -> dict:
    return nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})


def _descendants(models: dict, model_id: str):
    """Every model reachable from ``model_id`` through children (depth first)."""
    model = models.get(model_id)
    if model is None:
        return
    yield model_id, model
    for child in model.get("state", {}).get("children", []):
        yield from _descendants(models, child.removeprefix("IPY_MODEL_"))


def _image_png(model) -> str | None:
    """Base64 PNG of an Image model (its value is stored as a buffer)."""
    for buffer in model.get("buffers", []):
        if buffer.get("path") == ["value"]:
            data = buffer["data"]
            return data if buffer.get("encoding") == "base64" else base64.b64encode(
                data.encode("latin-1")).decode()
    return None


def _control_text(state) -> str:
    value = state.get("value", state.get("index"))
    labels = state.get("_options_labels")
    if labels and isinstance(state.get("index"), int):
        value = labels[state["index"]]  # a dropdown's chosen label, not its position
    if isinstance(value, float):
        value = f"{value:.4g}"
    label = state.get("description") or "control"
    note = " (disabled)" if state.get("disabled") else ""
    return f"{html.escape(str(label))} {html.escape(str(value))}{note}"


def has_image(nb, model_id: str) -> bool:
    """Whether the widget view ``model_id`` shows an image (an explorer's figure)."""
    return any(m.get("model_name") == "ImageModel"
               for _, m in _descendants(_models(nb), model_id))


def widget_snapshot(nb, model_id: str) -> str | None:
    """HTML for a widget view: its images and its controls' values, or None if unknown."""
    models = _models(nb)
    images, controls = [], []
    for _, model in _descendants(models, model_id):
        name = model.get("model_name")
        if name == "ImageModel" and (png := _image_png(model)):
            images.append(f'<img class="widget-image" alt="explorer snapshot" '
                          f'src="data:image/png;base64,{png}">')
        elif name in CONTROL_MODELS:
            controls.append(_control_text(model.get("state", {})))
        elif name == "HTMLModel" and model.get("state", {}).get("value"):
            controls.append(model["state"]["value"])
        elif name in ("FloatProgressModel", "IntProgressModel"):
            state = model.get("state", {})
            controls.append(f"[{state.get('value', 0):g} / {state.get('max', 100):g}]")
    if not images and not controls:
        return None
    if not images:  # a progress bar (tqdm) or a form without a figure: one line of text
        return f'<div class="widget-text">{" ".join(controls)}</div>'
    listed = "".join(f"<li>{c}</li>" for c in controls)
    return (f'<figure class="widget-snapshot">{"".join(images)}<figcaption>Static snapshot of '
            f'the explorer as the notebook left it (run the notebook to move the controls):'
            f'<ul>{listed}</ul></figcaption></figure>')


def freeze_widgets(nb) -> int:
    """Replace widget views by static snapshots (or their text fallback); how many."""
    count = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW not in data:
                continue
            snapshot = widget_snapshot(nb, data[WIDGET_VIEW]["model_id"])
            out.data = ({"text/html": snapshot} if snapshot is not None
                        else {"text/plain": data.get("text/plain", "")})
            count += snapshot is not None
    nb.metadata.pop("widgets", None)
    return count


# ---------------------------------------------------------------- pages
def title_and_summary(nb) -> tuple[str, str]:
    """The first ``# heading`` and the first paragraph after it (markdown, plain text)."""
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        lines = cell.source.strip().splitlines()
        if lines and lines[0].startswith("# "):
            rest = "\n".join(lines[1:]).strip().split("\n\n")[0]
            return lines[0][2:].strip(), rest
    raise ValueError("a notebook of the book has no '# Title' markdown heading: add one to "
                     "its first markdown cell")


def page_name(notebook: str) -> str:
    return Path(notebook).stem + ".html"


def link_pages(body: str) -> str:
    """``href="NN_x.ipynb#a"`` -> ``href="NN_x.html#a"`` (only links to sibling notebooks)."""
    return re.sub(r'href="([0-9][\w-]*)\.ipynb(#[^"]*)?"',
                  lambda m: f'href="{m.group(1)}.html{m.group(2) or ""}"', body)


def nav(chapters, i) -> str:
    prev = (f'<a class="prev" rel="prev" href="{chapters[i - 1]["page"]}">&larr; '
            f'{html.escape(chapters[i - 1]["title"])}</a>' if i > 0 else "<span></span>")
    nxt = (f'<a class="next" rel="next" href="{chapters[i + 1]["page"]}">'
           f'{html.escape(chapters[i + 1]["title"])} &rarr;</a>'
           if i + 1 < len(chapters) else "<span></span>")
    toc = '<a class="toc" href="index.html">Contents</a>'
    return f'<nav class="chapter-nav">{prev}{toc}{nxt}</nav>'


def page(title: str, body: str, top: str = "", bottom: str = "") -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{html.escape(title)}</title><link rel="stylesheet" href="book.css">'
            f'</head><body>{top}<main>{body}</main>{bottom}</body></html>\n')


def css() -> str:
    from pygments.formatters import HtmlFormatter

    own = (ROOT / "tools" / "book.css").read_text()
    return own + "\n" + HtmlFormatter(style="default").get_style_defs(".highlight")


def chapter_html(nb) -> str:
    from nbconvert import HTMLExporter

    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = render_math(cell.source)
    exporter = HTMLExporter(template_name="basic", exclude_input_prompt=True,
                            exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(nb)
    return link_pages(body)


def build(out: Path, notebooks: list[Path]) -> list[dict]:
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    chapters = []
    for path in notebooks:
        nb = executed(path)
        snapshots = freeze_widgets(nb)
        title, summary = title_and_summary(nb)
        chapters.append({"notebook": path.name, "page": page_name(path.name), "title": title,
                         "summary": summary, "nb": nb, "snapshots": snapshots})
    for i, chapter in enumerate(chapters):
        body = chapter_html(chapter.pop("nb"))
        (out / chapter["page"]).write_text(page(chapter["title"], body, nav(chapters, i),
                                                nav(chapters, i)))
    items = "".join(
        f'<li><a href="{c["page"]}">{html.escape(c["title"])}</a>'
        f'<p>{link_pages(_inline(c["summary"]))}</p></li>' for c in chapters)
    intro = ("<h1>The DP-SGD Workbench: the book</h1><p>Every notebook of the workbench, run "
             "top to bottom in full mode, with its figures and a static snapshot of each "
             "explorer widget. Read them in this order; to change a number and see what "
             "happens, open the notebook itself (<code>make lab</code>).</p>")
    (out / "index.html").write_text(page("DP-SGD Workbench: contents",
                                         f'{intro}<ol class="contents">{items}</ol>'))
    (out / "book.css").write_text(css())
    print(f"book: {len(chapters)} chapters in {out} ({time.perf_counter() - start:.0f} s); "
          f"open {out / 'index.html'}")
    return chapters


def _inline(markdown: str) -> str:
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    text = markdown2html_mistune(render_math(markdown)).strip()
    return re.sub(r"^<p>|</p>$", "", text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "book")
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="default: every notebooks/*.ipynb, in file-name order")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.out.exists():
        shutil.rmtree(args.out)
    build(args.out, notebooks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
