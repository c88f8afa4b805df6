"""Output paths of the command-line tools, checked before any work is done.

A benchmark or an audit can run for minutes; if its ``--out`` turns out to be unwritable only
when the results are written, the results are lost. Every command line of the workbench
(``python -m workbench.bench NAME --out/--out-dir``, ``python -m workbench audit --out``)
checks its output path here, at argument parsing, with one message style:

- a file output (``check_output_file``): not a directory; its folder exists or is created;
  the folder is writable (a probe file is created and removed) and so is the file if present;
- a folder output (``check_output_dir``): not a file; created if missing; writable (probe).

``output_file_arg`` / ``output_dir_arg`` wrap them as ``argparse`` types, so a bad path is a
usage error (exit 2, one line naming the option) before the benchmark starts.
"""

import argparse
import os
import tempfile
from pathlib import Path

from workbench.errors import WorkbenchError


class OutputPathError(WorkbenchError, ValueError):
    """An output path that cannot be written (the message names the option and the fix)."""


def _probe(folder: Path, option: str, path: Path) -> None:
    """Create ``folder`` (and parents) and prove it writable with a probe file."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as err:
        raise OutputPathError(f"{option} {str(path)!r} is not writable ({type(err).__name__}: "
                              f"{err.strerror or err}); choose a folder you can write "
                              f"to") from None


def check_output_dir(path, option: str = "--out-dir") -> Path:
    """``path`` as a writable folder (created if missing), or OutputPathError."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{option} {str(path)!r} is a file; give a folder for the "
                              f"results (a new name is created)")
    _probe(path, option, path)
    return path


def check_output_file(path, option: str = "--out") -> Path:
    """``path`` as a file that can be written (its folder created if missing)."""
    path = Path(path)
    if path.is_dir() or str(path).endswith(os.sep):
        raise OutputPathError(f"{option} {str(path)!r} is a folder; give a file name for the "
                              f"results, e.g. {str(path / 'results.csv')!r}")
    parent = path.parent
    for above in [parent, *parent.parents]:  # the nearest existing folder must be a folder
        if above.exists():
            if not above.is_dir():
                raise OutputPathError(f"{option} {str(path)!r}: {str(above)!r} is a file, so "
                                      f"no folder can be made there; choose another path")
            break
    _probe(parent, option, path)
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputPathError(f"{option} {str(path)!r} exists and is not writable; choose "
                              f"another file name or change its permissions")
    return path


def _argparse_type(check, option):
    def convert(value):
        try:
            return check(value, option)
        except OutputPathError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = "output path"
    return convert


def output_file_arg(option: str = "--out"):
    """An argparse ``type=`` for a file output (``check_output_file``)."""
    return _argparse_type(check_output_file, option)


def output_dir_arg(option: str = "--out-dir"):
    """An argparse ``type=`` for a folder output (``check_output_dir``)."""
    return _argparse_type(check_output_dir, option)


__all__ = [
    "OutputPathError", "check_output_dir", "check_output_file", "output_dir_arg", "output_file_arg",
]
