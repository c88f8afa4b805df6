"""Keep notebooks clean, with their checked outputs: ``python tools/nbchecks.py record|strip|run``.

Notebooks are committed without outputs, except the cells whose first line is
``# NBVAL_CHECK_OUTPUT``: nbval (``pytest --nbval-lax``) compares those cells' fresh output
with the *stored* one, so a check cell committed empty checks nothing. This tool

- ``record NOTEBOOK...``: runs each notebook with ``WORKBENCH_FAST=1`` (as ``make test`` does)
  and stores the text output of the check cells only;
- ``strip NOTEBOOK...``: removes every other output, execution counts and widget state, and
  keeps the check cells' stored text;
- ``run NOTEBOOK...``: runs each notebook as a learner does, top to bottom in *full* mode
  (``WORKBENCH_FAST`` unset), fails on the first error or on a figure that would not show
  (:func:`figure_problems`), prints each notebook's wall time, and saves the executed copy
  (outputs and widget state) to ``build/executed/NN.ipynb`` with the source's hash in its
  metadata, so that ``make book`` (tools/book.py) reuses it instead of running it again
  (``make notebooks-full``).

The figure check also runs in ``make test``: ``notebooks/conftest.py`` applies
:func:`figure_problems` to every cell nbval executes.

tests/test_notebooks.py enforces the result: outputs only in check cells, and every check
cell has one.
"""

import argparse
import os
import re
import sys
import time
from pathlib import Path

import nbformat

CHECK = "# NBVAL_CHECK_OUTPUT"
TEXT_OUTPUTS = ("stream", "execute_result")
IMAGES = ("image/png", "image/svg+xml", "image/jpeg")
EXECUTED = Path(__file__).resolve().parents[1] / "build" / "executed"
# a cell that makes or shows a pyplot figure must display an image
DRAWS = re.compile(r"\bplt\.(subplots|figure|show)\(|\bdisplay\(fig")
BARE_FIGURE = "<Figure size"


def is_check_cell(cell) -> bool:
    return cell.cell_type == "code" and cell.source.lstrip().startswith(CHECK)


def text_only(outputs):
    """Stream text and plain-text results; no images, HTML or widget views."""
    kept = []
    for out in outputs:
        if out.output_type == "stream":
            kept.append(out)
        elif out.output_type == "execute_result" and "text/plain" in out.get("data", {}):
            out.data = {"text/plain": out.data["text/plain"]}
            out.metadata = {}
            kept.append(out)
    return kept


def figure_problems(source: str, outputs) -> list[str]:
    """What a learner would miss in this cell's ``outputs``: a figure shown as its text repr
    (``<Figure size 640x480 with 1 Axes>``: the cell ended in a bare Figure that the front end
    did not render), or a cell that draws with pyplot (``plt.subplots``, ``plt.show``, ...)
    but displays no image. Fix: end the drawing cell with ``plt.show()`` or ``display(fig)``.
    """
    problems = []
    texts = [out.get("text", "") if out.get("output_type") == "stream"
             else out.get("data", {}).get("text/plain", "") for out in outputs
             if not any(m in out.get("data", {}) for m in IMAGES)]  # an image's own alt text
    for text in texts:
        text = "".join(text) if isinstance(text, list) else text
        if BARE_FIGURE in text:
            line = next(t for t in text.splitlines() if BARE_FIGURE in t)
            problems.append(f"a figure shows as text, not as an image: {line.strip()!r}")
    images = sum(any(m in out.get("data", {}) for m in IMAGES) for out in outputs)
    if DRAWS.search(source) and not images:
        problems.append("the cell draws with pyplot but displays no image")
    return problems


def strip(nb):
    """Clear outputs except check cells' text; clear widget state and execution counts
    (check cells keep theirs: nbval skips a stored output whose cell looks unrun)."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)
        if is_check_cell(cell) and cell.outputs:
            cell.outputs = text_only(cell.outputs)
            cell.execution_count = cell.execution_count or 1
        else:
            cell.outputs = []
            cell.execution_count = None
    nb.metadata.pop("widgets", None)
    return nb


def record(path: Path, timeout: int = 600):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    os.environ["WORKBENCH_FAST"] = "1"
    os.environ["WORKBENCH_SOLUTIONS"] = "1"  # the on-ramp's reference solutions (exercises.py)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return strip(nb)


def source_hash(path: Path) -> str:
    """sha256 of the notebook's cells' sources: what an executed copy was made from."""
    import hashlib

    nb = nbformat.read(path, as_version=4)
    text = "\n\0".join(f"{c.cell_type}\0{c.source}" for c in nb.cells)
    return hashlib.sha256(text.encode()).hexdigest()


def run_full(path: Path, timeout: int = 1800, save_to: Path | None = EXECUTED) -> float:
    """Run ``path`` top to bottom in full mode (no ``WORKBENCH_FAST``); seconds it took.
    The executed notebook goes to ``save_to / path.name`` (None: nowhere), stamped with
    ``metadata.workbench.source_hash`` (:func:`source_hash`) once it passed.

    Raises ``nbclient.exceptions.CellExecutionError`` on a failing cell and ``AssertionError``
    on a figure a learner would not see.
    """
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    os.environ.pop("WORKBENCH_FAST", None)
    os.environ["WORKBENCH_SOLUTIONS"] = "1"  # the on-ramp's reference solutions (exercises.py)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.perf_counter() - start
    problems = [f"cell {i}: {p}" for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
                for p in figure_problems(cell.source, cell.outputs)]
    assert not problems, f"{path}: " + "; ".join(problems)
    if save_to is not None:
        save_to.mkdir(parents=True, exist_ok=True)
        nb.metadata["workbench"] = {"source_hash": source_hash(path), "mode": "full",
                                    "seconds": round(seconds, 1)}
        nbformat.write(nb, save_to / path.name)
    return seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["record", "strip", "run"])
    parser.add_argument("notebooks", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        total = 0.0
        for path in args.notebooks:
            seconds = run_full(path)
            total += seconds
            print(f"full mode: {path} ran top to bottom in {seconds:.0f} s", flush=True)
        print(f"full mode: {len(args.notebooks)} notebooks in {total:.0f} s")
        return 0
    for path in args.notebooks:
        if args.command == "record":
            nb = record(path)
        else:
            nb = strip(nbformat.read(path, as_version=4))
        nbformat.write(nb, path)
        checks = sum(is_check_cell(c) for c in nb.cells)
        print(f"{args.command}: {path} ({checks} check cells)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
