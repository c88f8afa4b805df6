"""Moved to ``workbench.lm.gpt`` (this path is deprecated and kept for one release)."""

import sys

from workbench.deprecation import warn_renamed
from workbench.lm import gpt as _moved

warn_renamed("workbench.models_gpt", "workbench.lm.gpt", "import", stacklevel=2)
sys.modules[__name__] = _moved  # the same module object: patches and isinstance agree
