"""Build hook: the wheel ships the repository's top-level ``data/`` as ``workbench/_data/``.

Everything else about the package is in pyproject.toml. ``workbench.data.bundled`` reads the
installed ``workbench/_data/`` and, in a checkout, ``data/``.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

DATA = Path(__file__).resolve().parent / "data"


class BuildPyWithData(build_py):
    """``build_py``, then ``data/`` copied byte for byte into ``<build>/workbench/_data/``."""

    def run(self):
        super().run()
        if not self.editable_mode:  # an editable install reads data/ in place
            shutil.copytree(DATA, Path(self.build_lib) / "workbench" / "_data",
                            dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithData})
