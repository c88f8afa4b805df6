"""Let the notebook kernels started by nbval import ``workbench`` from this checkout.

``make`` installs the package into .venv (``pip install -e .``), and then this is a no-op in
effect. In a virtual environment without that install, ``python -m pytest`` finds
``workbench`` through the repository root on its own sys.path, but the kernels it starts run
in notebooks/ and would not; putting the root first on PYTHONPATH (inherited by the kernels)
makes them import the same code as the tests.
"""

import os
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
_paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
if ROOT not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, _paths)])
