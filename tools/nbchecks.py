"""Keep notebooks clean, with their checked outputs: ``python tools/nbchecks.py record|strip``.

Notebooks are committed without outputs, except the cells whose first line is
``# NBVAL_CHECK_OUTPUT``: nbval (``pytest --nbval-lax``) compares those cells' fresh output
with the *stored* one, so a check cell committed empty checks nothing. This tool

- ``record NOTEBOOK...``: runs each notebook with ``WORKBENCH_FAST=1`` (as ``make test`` does)
  and stores the text output of the check cells only;
- ``strip NOTEBOOK...``: removes every other output, execution counts and widget state, and
  keeps the check cells' stored text.

tests/test_notebooks.py enforces the result: outputs only in check cells, and every check
cell has one.
"""

import argparse
import os
import sys
from pathlib import Path

import nbformat

CHECK = "# NBVAL_CHECK_OUTPUT"
TEXT_OUTPUTS = ("stream", "execute_result")


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
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return strip(nb)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["record", "strip"])
    parser.add_argument("notebooks", nargs="+", type=Path)
    args = parser.parse_args(argv)
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
