"""Rule files register themselves: importing a package imports every module in it.

The layer rules (``rules/``) and the
accountants (``accounting/accountants/``) each live one file per rule, and each file registers
its rule with a decorator or a ``register_*`` call when it is imported. The package's
``__init__`` calls :func:`import_submodules`, so a new rule is a new file and nothing else:
no import line to add, none to forget (a forgotten import would leave the layer unsupported,
or the accountant unknown, without any error where the file was written).

Modules are imported in name order, so the registries fill in the same order on every run.
A module whose name starts with "_" is skipped (helpers shared by several rule files).
"""

import importlib
import pkgutil


def import_submodules(package_name, package_path):
    """Import every module of the package (``__name__``, ``__path__``); returns their names.

    >>> import workbench.rules as s
    >>> {"conv", "embedding", "linear"} <= set(import_submodules(s.__name__, s.__path__))
    True
    """
    names = sorted(m.name for m in pkgutil.iter_modules(package_path)
                   if not m.name.startswith("_"))
    for name in names:
        importlib.import_module(f"{package_name}.{name}")
    return names


__all__ = ["import_submodules"]
