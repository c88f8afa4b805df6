"""Let the notebook kernels started by nbval import ``workbench`` from this checkout.

``make`` installs the package into .venv (``pip install -e .``), and then this is a no-op in
effect. In a virtual environment without that install, ``python -m pytest`` finds
``workbench`` through the repository root on its own sys.path, but the kernels it starts run
in notebooks/ and would not; putting the root first on PYTHONPATH (inherited by the kernels)
makes them import the same code as the tests.

It also fails a cell whose figure a learner would not see (``pytest_runtest_call`` below).
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[1])
_paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
if ROOT not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, _paths)])


# What a learner sees: every cell nbval runs is also checked for figures that would not show
# (a bare `<Figure size ...>` text, or a pyplot cell without an image; tools/nbchecks.py).
sys.path.insert(0, str(Path(ROOT) / "tools"))
from nbchecks import figure_problems  # noqa: E402


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    outputs = getattr(item, "test_outputs", None)  # nbval's IPyNbCell: this run's outputs
    if outputs is not None:
        problems = figure_problems(item.cell.source, outputs)
        if problems:
            pytest.fail(f"{item.name}: " + "; ".join(problems)
                        + " (end the cell with plt.show() or display(fig))", pytrace=False)
    return result
