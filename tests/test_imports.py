"""``import workbench`` loads torch and the training path only (issue 25 item 5).

pandas, scipy, matplotlib and ipywidgets load in the functions that use them; the heavy
submodules (audit, bench, viz, widgets) on first attribute access. Checked in a fresh
interpreter, since this test process has imported them all already.
"""

import json
import subprocess
import sys

from workbench.bench import imports

HEAVY_AFTER_USE = r"""
import json, sys
import workbench as wb
first = sorted(m for m in sys.argv[1:] if m in sys.modules)
wb.accounting.epsilon(0.01, 1.0, 100, 1e-5)  # scipy, loaded by the function that uses it
audit = wb.audit.audit_gradients  # the lazy submodule, by attribute
print(json.dumps({"first": first, "scipy_after": "scipy" in sys.modules,
                  "audit": "workbench.audit" in sys.modules}))
"""


def test_import_workbench_loads_no_heavy_library():
    row = imports.measure_once("workbench")
    assert row["heavy"] == [], f"import workbench loaded {row['heavy']}"


def test_heavy_libraries_and_submodules_load_on_use():
    out = subprocess.run([sys.executable, "-c", HEAVY_AFTER_USE, *imports.HEAVY],
                         capture_output=True, text=True, check=True, timeout=300)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row == {"first": [], "scipy_after": True, "audit": True}


def test_lazy_submodule_names_and_unknown_names():
    import workbench as wb

    assert wb.viz.__name__ == "workbench.viz"
    try:
        wb.no_such_name  # noqa: B018
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("wb.no_such_name did not raise AttributeError")
