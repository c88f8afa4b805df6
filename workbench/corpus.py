"""Moved to ``workbench.lm.corpus`` (this path is deprecated and kept for one release)."""

import sys

from workbench.deprecation import warn_renamed
from workbench.lm import corpus as _moved

warn_renamed("workbench.corpus", "workbench.lm.corpus", "import", stacklevel=2)
sys.modules[__name__] = _moved  # the same module object: patches and isinstance agree
