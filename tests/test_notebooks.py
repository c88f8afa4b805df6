"""Notebook conventions (ARCHITECTURE.md, style item 8): checked by structure, run by nbval."""

import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from nbchecks import is_check_cell  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:3] == ["00_tour.ipynb", "00b_foundations.ipynb",
                                              "01_per_sample_gradients.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_clean_and_its_checks_are_real(path):
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# "), "H1 title first"
    assert "widgets" not in nb.metadata, "widget state must be stripped"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if is_check_cell(cell):
            assert cell.outputs and cell.execution_count, (
                f"cell {i} is a NBVAL_CHECK_OUTPUT cell without a stored output, so nbval "
                f"checks nothing: run python tools/nbchecks.py record {path.relative_to(ROOT)}")
        else:
            assert not cell.outputs and cell.execution_count is None, (
                f"cell {i}: output or execution count left in; python tools/nbchecks.py strip")


def _stream(text):
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def _result(data):
    return nbformat.v4.new_output("execute_result", data=data, execution_count=1)


def test_figure_problems_sees_a_bare_figure_repr_and_a_drawing_cell_without_image():
    from nbchecks import figure_problems

    png = {"image/png": "iVBOR", "text/plain": "<Figure size 600x300 with 1 Axes>"}
    shown = [nbformat.v4.new_output("display_data", data=png)]
    assert figure_problems("fig, ax = plt.subplots()\nplt.show()", shown) == []
    assert figure_problems("print(1)", [_stream("1\n")]) == []
    bare = [_result({"text/plain": "<Figure size 1500x420 with 3 Axes>"})]
    assert "as text" in figure_problems("figure_2(runtime)", bare)[0]
    assert "no image" in figure_problems("fig, ax = plt.subplots()\nax.plot([1])", [])[0]
    assert figure_problems("fig, ax = plt.subplots()", [_stream("<Figure size 6x3>\n")])
