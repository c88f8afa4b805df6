"""Shipped data files: where they are, and their checksums.

The data sets the workbench loads at run time live in the repository's top-level ``data/``
(provenance in ``data/README.md``); the wheel ships them as ``workbench/_data/``
(``setup.py``). Every loader checks a file's sha256 against the one the workbench was tested
with and refuses a file that differs (``DataChecksumError``), so a corrupted or edited data
set never trains silently.
"""

import hashlib
from importlib import resources
from pathlib import Path

from workbench.errors import WorkbenchError

__all__ = ["DataChecksumError", "bundled", "sha256_of"]


def bundled(*parts: str) -> Path:
    """Path of a shipped data file: ``workbench/_data/<parts>`` of an installed wheel, else
    ``data/<parts>`` of the checkout this package is imported from.

    Found with ``importlib.resources``, so it is the installed copy's file wherever the package
    lives. pip installs packages as files, so this is an ordinary path; imported from a zip
    archive it would not be, and this raises instead of handing back something ``open`` cannot
    read.
    """
    package = resources.files("workbench")
    if not isinstance(package, Path):
        raise RuntimeError(f"workbench is imported from {package!r}, not from files on disk; its "
                           f"data files need an unpacked install (pip install dpsgd-workbench)")
    installed = package / "_data"
    root = installed if installed.is_dir() else package.parent / "data"  # a wheel, a checkout
    return root.joinpath(*parts)


class DataChecksumError(WorkbenchError, ValueError):
    """A bundled data file's sha256 differs from the one the workbench was tested with."""


def sha256_of(path: Path) -> str:
    """Hex sha256 of the file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
